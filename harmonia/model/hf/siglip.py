"""SigLIP vision checkpoints (``SiglipVisionModel`` or the vision half of ``SiglipModel``) <-> `VisionEncoder`.

The attention-pooling head is not part of an MLLM's vision path and is neither loaded nor trained;
saving over a source checkpoint copies it (and a dual encoder's text tower) from there unchanged.
Anything else (a LLaVA directory, a CLIP tower) is refused with a `ConfigError` naming its
``model_type``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.hf.clip import TABLES, vision_names, vision_spec_from_hf
from harmonia.model.hf.io import CheckpointFiles, load_into, read_full_config, rename, write_checkpoint
from harmonia.model.lora import merge_lora
from harmonia.model.spec import EncoderSpec
from harmonia.model.vit import VisionEncoder, build_vision_encoder


def siglip_spec_from_hf(config: dict, name: str = "siglip", token_merge: int = 1) -> EncoderSpec:
    """An `EncoderSpec` from a SigLIP ``config.json`` (vision or dual-encoder): its post-normed last hidden state."""
    return vision_spec_from_hf(config, name, family="siglip", token_merge=token_merge)


def siglip_config_to_hf(spec: EncoderSpec) -> dict:
    """A ``SiglipVisionModel`` config of a SigLIP-architecture spec (no head)."""
    b = spec.body
    if spec.cls_token or spec.pre_norm or not spec.post_norm or spec.feature_layers:
        raise ConfigError(f"encoder {spec.name!r} is not a SigLIP tower's last hidden state; export it with its source")
    return {
        "model_type": "siglip_vision_model", "architectures": ["SiglipVisionModel"],
        "hidden_size": b.hidden, "intermediate_size": b.ffn_hidden, "num_hidden_layers": b.n_layers,
        "num_attention_heads": b.n_heads, "patch_size": spec.patch_size, "image_size": spec.image_size,
        "num_channels": spec.channels, "layer_norm_eps": b.norm_eps, "vision_use_head": False,
        "hidden_act": "gelu_pytorch_tanh" if b.gelu_approximate == "tanh" else "gelu",
    }


def siglip_state_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> ``SiglipVisionModel`` names."""
    return rename(state, TABLES["siglip"], to_ours=False)


def load_hf_siglip(path: str | Path, layers: tuple[int, int] | None = None, token_merge: int = 1) -> VisionEncoder:
    """Build a `VisionEncoder` (or a stage of it) from a SigLIP checkpoint directory."""
    spec = siglip_spec_from_hf(read_full_config(path), name=Path(path).name, token_merge=token_merge)
    model = build_vision_encoder(spec, layers)
    files = CheckpointFiles(path)
    names = vision_names(files.keys(), "siglip")
    own = [k for k in model.state_dict() if k in names]
    state = files.read(names[k] for k in own)
    load_into(model, {k: state[names[k]] for k in own}, f"SigLIP checkpoint {path}")
    return model


def save_hf_siglip(model: VisionEncoder, path: str | Path, source: str | Path | None = None,
                   dtype: torch.dtype = torch.float32) -> None:
    """Write a whole SigLIP-architecture `VisionEncoder` as a checkpoint (LoRA merged into a copy first).

    Args:
        model: the whole encoder.
        path: output directory.
        source: the checkpoint it came from: the output is then in its format (a dual encoder's text
            tower, the pooling head, tokenizer and processor files copied from it); None writes a
            ``SiglipVisionModel`` without head.
        dtype: dtype of the written tensors.
    """
    if not (model.is_first and model.is_last):
        raise ConfigError("save_hf_siglip needs the whole encoder; gather the stages' state dicts first")
    model = copy.deepcopy(model)
    merge_lora(model)
    if source is None:
        state = {k: v.to(dtype) for k, v in model.state_dict().items()}
        write_checkpoint(path, siglip_state_to_hf(state), {**siglip_config_to_hf(model.spec), "dtype": str(dtype).removeprefix("torch.")})
        return
    from harmonia.model.hf.export import write_like_source

    names = vision_names(CheckpointFiles(source).keys(), "siglip")
    write_like_source(source, path, {names[k]: v for k, v in model.state_dict().items()}, dtype)
