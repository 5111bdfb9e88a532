"""HF-format checkpoints in and out: whole multimodal models (LLaVA) and compositions of an LLM
(Llama / Qwen2 / Mistral) with encoders (CLIP / SigLIP vision, Whisper audio).

The training job's interface is `harmonia.model.hf.mllm`: `mllm_spec_from_hf`,
`load_module_state`, `export_hf`. The per-part loaders and savers below serve single modules; they
load on first use, so reading a checkpoint's spec (planning) does not import torch.
"""

from importlib import import_module

_PARTS = {"load_hf_llm": "llama", "save_hf_llm": "llama", "load_hf_siglip": "siglip", "save_hf_siglip": "siglip",
          "load_hf_whisper": "whisper", "save_hf_whisper": "whisper"}

__all__ = sorted(_PARTS)


def __getattr__(name: str):
    if name in _PARTS:
        return getattr(import_module(f"harmonia.model.hf.{_PARTS[name]}"), name)
    raise AttributeError(f"module 'harmonia.model.hf' has no attribute {name!r}")
