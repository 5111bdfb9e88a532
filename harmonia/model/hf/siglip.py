"""SigLIP vision checkpoints (``SiglipVisionModel`` or the vision half of ``SiglipModel``) <-> `VisionEncoder`.

The attention-pooling head is not part of an MLLM's vision path and is neither loaded nor saved.
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
from harmonia.model.lora import merge_lora
from harmonia.model.spec import EncoderSpec, TransformerSpec
from harmonia.model.vit import VisionEncoder, build_vision_encoder

TABLE = [
    ("embeddings.patch_embedding.", "patch_embed."),
    *[(f"encoder.layers.{{i}}.self_attn.{p}.", f"layers.{{i}}.attn.{q}.")
      for p, q in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj"))],
    ("encoder.layers.{i}.layer_norm1.", "layers.{i}.attn_norm."),
    ("encoder.layers.{i}.layer_norm2.", "layers.{i}.mlp_norm."),
    ("encoder.layers.{i}.mlp.fc1.", "layers.{i}.mlp.fc1."),
    ("encoder.layers.{i}.mlp.fc2.", "layers.{i}.mlp.fc2."),
    ("post_layernorm.", "post_norm."),
]
_ACTS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def siglip_spec_from_hf(config: dict, name: str = "siglip", token_merge: int = 1) -> EncoderSpec:
    """An `EncoderSpec` from a SigLIP ``config.json`` (vision or dual-encoder)."""
    vc = config.get("vision_config", config)
    if vc.get("hidden_act", "gelu_pytorch_tanh") not in _ACTS:
        raise ConfigError(f"SigLIP hidden_act={vc['hidden_act']!r} unsupported; expected one of {sorted(_ACTS)}")
    body = TransformerSpec(
        n_layers=vc["num_hidden_layers"], hidden=vc["hidden_size"], n_heads=vc["num_attention_heads"],
        ffn_hidden=vc["intermediate_size"], norm_eps=vc.get("layer_norm_eps", 1e-6),
        gelu_approximate=_ACTS[vc.get("hidden_act", "gelu_pytorch_tanh")],
    )
    return EncoderSpec(name, ("image", "video"), body, patch_size=vc["patch_size"], image_size=vc["image_size"],
                       channels=vc.get("num_channels", 3), pre_norm=False, post_norm=True, token_merge=token_merge)


def siglip_config_to_hf(spec: EncoderSpec) -> dict:
    b = spec.body
    return {
        "model_type": "siglip_vision_model", "architectures": ["SiglipVisionModel"],
        "hidden_size": b.hidden, "intermediate_size": b.ffn_hidden, "num_hidden_layers": b.n_layers,
        "num_attention_heads": b.n_heads, "patch_size": spec.patch_size, "image_size": spec.image_size,
        "num_channels": spec.channels, "layer_norm_eps": b.norm_eps, "vision_use_head": False,
        "hidden_act": "gelu_pytorch_tanh" if b.gelu_approximate == "tanh" else "gelu",
    }


def siglip_state_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = find_prefix(state, "embeddings.patch_embedding.weight", "SigLIP vision")
    ours = rename(state, TABLE, to_ours=True, src_prefix=prefix)
    ours["pos_embed"] = state[prefix + "embeddings.position_embedding.weight"]
    return ours


def siglip_state_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = rename(state, TABLE, to_ours=False, dst_prefix="vision_model.")
    hf["vision_model.embeddings.position_embedding.weight"] = state["pos_embed"]
    return hf


def load_hf_siglip(path: str | Path, layers: tuple[int, int] | None = None, token_merge: int = 1) -> VisionEncoder:
    """Build a `VisionEncoder` (or a stage of it) from a SigLIP checkpoint directory."""
    spec = siglip_spec_from_hf(read_config(path), name=Path(path).name, token_merge=token_merge)
    model = build_vision_encoder(spec, layers)
    load_into(model, siglip_state_from_hf(read_state_dict(path)), f"SigLIP checkpoint {path}")
    return model


def save_hf_siglip(model: VisionEncoder, path: str | Path) -> None:
    """Write a whole SigLIP-architecture `VisionEncoder` as a ``SiglipVisionModel`` checkpoint."""
    if not (model.is_first and model.is_last):
        raise ConfigError("save_hf_siglip needs the whole encoder; gather the stages' state dicts first")
    model = copy.deepcopy(model)
    merge_lora(model)
    write_checkpoint(path, siglip_state_to_hf(model.state_dict()), siglip_config_to_hf(model.spec))
