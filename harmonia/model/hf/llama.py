"""Llama / Mistral / Qwen2 / Qwen3 checkpoints <-> `DecoderLM`.

HF names (after the ``model.`` prefix) map one to one onto ours; the families differ only in their
config (read strictly by `harmonia.model.hf.llama_config`: sliding windows, RoPE scaling, biases,
Qwen3's per-head q/k norms). A field that would change the numbers and that harmonia does not
implement is refused with a `ConfigError` naming it, rather than loaded wrongly.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.hf.io import (
    find_prefix,
    load_into,
    read_config,
    read_state_dict,
    rename,
    write_checkpoint,
)
from harmonia.model.hf.llama_config import MODEL_TYPES, llm_config_to_hf, llm_spec_from_hf
from harmonia.model.llm import DecoderLM, build_llm
from harmonia.model.lora import merge_lora
from harmonia.model.spec import LLMSpec

__all__ = [
    "MODEL_TYPES", "llm_config_to_hf", "llm_spec_from_hf", "llm_state_from_hf", "llm_state_to_hf", "load_hf_llm",
    "save_hf_llm",
]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
TABLE = [
    ("embed_tokens.", "embed."),
    *[(f"layers.{{i}}.self_attn.{p}.", f"layers.{{i}}.attn.{p}.") for p in _ATTN],
    *[(f"layers.{{i}}.mlp.{p}.", f"layers.{{i}}.mlp.{p}.") for p in ("gate_proj", "up_proj", "down_proj")],
    ("layers.{i}.input_layernorm.", "layers.{i}.attn_norm."),
    ("layers.{i}.post_attention_layernorm.", "layers.{i}.mlp_norm."),
    ("norm.", "norm."),
]


def llm_state_from_hf(state: dict[str, torch.Tensor], spec: LLMSpec) -> dict[str, torch.Tensor]:
    """HF tensors -> our names for the whole model (stages pick their own keys).

    With tied embeddings every stage that uses the matrix reads ``embed.weight`` (the head has no
    tensor of its own, as in transformers); otherwise the head is ``lm_head.weight``.
    """
    prefix = find_prefix(state, "embed_tokens.weight", "Llama-family LLM")
    ours = rename(state, TABLE, to_ours=True, src_prefix=prefix)
    head = next((t for k, t in state.items() if k.endswith("lm_head.weight")), None)
    if not spec.tie_embeddings and head is not None:
        ours["head.weight"] = head
    return ours


def llm_state_to_hf(state: dict[str, torch.Tensor], spec: LLMSpec) -> dict[str, torch.Tensor]:
    """Our names -> HF names (``model.`` prefix, ``lm_head`` unless tied)."""
    hf = rename(state, TABLE, to_ours=False, dst_prefix="model.")
    if not spec.tie_embeddings and "head.weight" in state:
        hf["lm_head.weight"] = state["head.weight"]
    return hf


def load_hf_llm(path: str | Path, layers: tuple[int, int] | None = None) -> DecoderLM:
    """Build a `DecoderLM` (or the stage of blocks ``[a, b)``) from an HF checkpoint directory."""
    spec = llm_spec_from_hf(read_config(path), name=Path(path).name)
    model = build_llm(spec, layers)
    load_into(model, llm_state_from_hf(read_state_dict(path), spec), f"LLM checkpoint {path}")
    return model


def save_hf_llm(model: DecoderLM, path: str | Path) -> None:
    """Write a whole `DecoderLM` as an HF checkpoint (LoRA adapters merged into a copy first)."""
    if not (model.is_first and model.is_last):
        raise ConfigError("save_hf_llm needs the whole model; gather the stages' state dicts first")
    model = copy.deepcopy(model)
    merge_lora(model)
    write_checkpoint(path, llm_state_to_hf(model.state_dict(), model.spec), llm_config_to_hf(model.spec))
