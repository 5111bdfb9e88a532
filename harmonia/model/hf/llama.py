"""Llama / Qwen2 / Mistral checkpoints <-> `DecoderLM`.

HF names (after the ``model.`` prefix) map one to one onto ours; Qwen2 differs only by q/k/v biases
and its default tied head. Rotary scaling variants (``llama3``, ``yarn``) are not implemented and are
refused with a clear error rather than loaded wrongly.
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
from harmonia.model.llm import DecoderLM, build_llm
from harmonia.model.lora import merge_lora
from harmonia.model.spec import LLMSpec, TransformerSpec

TABLE = [
    ("embed_tokens.", "embed."),
    *[(f"layers.{{i}}.self_attn.{p}.", f"layers.{{i}}.attn.{p}.") for p in ("q_proj", "k_proj", "v_proj", "o_proj")],
    *[(f"layers.{{i}}.mlp.{p}.", f"layers.{{i}}.mlp.{p}.") for p in ("gate_proj", "up_proj", "down_proj")],
    ("layers.{i}.input_layernorm.", "layers.{i}.attn_norm."),
    ("layers.{i}.post_attention_layernorm.", "layers.{i}.mlp_norm."),
    ("norm.", "norm."),
]
MODEL_TYPES = ("llama", "qwen2", "mistral")


def llm_spec_from_hf(config: dict, name: str | None = None) -> LLMSpec:
    """An `LLMSpec` from a Llama / Qwen2 / Mistral ``config.json``."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"config model_type={kind!r} is not a supported LLM; supported: {MODEL_TYPES}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"rotary scaling {rope.get('rope_type', rope.get('type'))!r} is not implemented; "
                          "only default RoPE checkpoints can be loaded")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={config['hidden_act']!r}: Llama-family adapters expect silu (SwiGLU)")
    qkv_bias = kind == "qwen2" or bool(config.get("attention_bias", False))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    body = TransformerSpec(
        n_layers=config["num_hidden_layers"], hidden=hidden, n_heads=heads,
        ffn_hidden=config["intermediate_size"], n_kv_heads=config.get("num_key_value_heads") or heads,
        mlp="swiglu", norm="rmsnorm", qkv_bias=qkv_bias,
        out_bias=kind != "qwen2" and bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)), head_dim=config.get("head_dim") or hidden // heads,
        norm_eps=config.get("rms_norm_eps", 1e-6),
    )
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return LLMSpec(name or config.get("_name_or_path") or kind, body, config["vocab_size"],
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)), rope_theta=float(theta))


def llm_config_to_hf(spec: LLMSpec) -> dict:
    """A ``config.json`` (Qwen2 when q/k/v have biases and the output has none, else Llama)."""
    b = spec.body
    qwen = b.qkv_bias and not b.out_bias
    if b.mlp != "swiglu" or b.norm != "rmsnorm" or b.qk_norm or b.layer_scale:
        raise ConfigError(f"llm {spec.name!r} is not a Llama-family architecture (swiglu, rmsnorm, no qk-norm)")
    config = {
        "model_type": "qwen2" if qwen else "llama",
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "hidden_size": b.hidden, "intermediate_size": b.ffn_hidden, "num_hidden_layers": b.n_layers,
        "num_attention_heads": b.n_heads, "num_key_value_heads": b.kv_heads, "head_dim": b.dim_head,
        "rms_norm_eps": b.norm_eps, "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_embeddings,
        "rope_theta": spec.rope_theta, "hidden_act": "silu", "mlp_bias": b.mlp_bias,
        "torch_dtype": "float32",
    }
    if not qwen:
        config["attention_bias"] = b.qkv_bias
    return config


def llm_state_from_hf(state: dict[str, torch.Tensor], spec: LLMSpec) -> dict[str, torch.Tensor]:
    """HF tensors -> our names for the whole model (stages pick their own keys)."""
    prefix = find_prefix(state, "embed_tokens.weight", "Llama-family LLM")
    ours = rename(state, TABLE, to_ours=True, src_prefix=prefix)
    head = next((t for k, t in state.items() if k.endswith("lm_head.weight")), None)
    ours["head.weight"] = ours["embed.weight"] if spec.tie_embeddings or head is None else head
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
