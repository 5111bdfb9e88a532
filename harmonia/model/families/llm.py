"""An LLM checkpoint alone (Llama, Mistral, Qwen2, Qwen3): an MLLM of one module, no encoders."""

from __future__ import annotations

from harmonia.model.families.base import Family
from harmonia.model.hf.llama_config import MODEL_TYPES, llm_spec_from_hf
from harmonia.model.spec import MLLMSpec


def llm_only_spec(config: dict, name: str) -> MLLMSpec:
    """A graph of one module: the LLM of ``config``."""
    return MLLMSpec(name, {}, {}, llm_spec_from_hf(config, name=name))


LLM = Family("LLM", tuple(MODEL_TYPES), llm_only_spec)
