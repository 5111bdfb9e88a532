"""Whisper encoder checkpoints (``WhisperForConditionalGeneration``, ``WhisperModel`` or the encoder alone)
<-> `AudioEncoder`.

Whisper's ``k_proj`` has no bias; ours does. A key bias adds the same ``q . b`` to every score of a
query, which softmax cancels, so it is loaded as zeros and dropped on saving without changing outputs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.audio import AudioEncoder, build_audio_encoder
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

TABLE = [
    ("conv1.", "conv1."),
    ("conv2.", "conv2."),
    *[(f"layers.{{i}}.self_attn.{p}.", f"layers.{{i}}.attn.{q}.")
      for p, q in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj"))],
    ("layers.{i}.self_attn_layer_norm.", "layers.{i}.attn_norm."),
    ("layers.{i}.final_layer_norm.", "layers.{i}.mlp_norm."),
    ("layers.{i}.fc1.", "layers.{i}.mlp.fc1."),
    ("layers.{i}.fc2.", "layers.{i}.mlp.fc2."),
    ("layer_norm.", "post_norm."),
]


def whisper_spec_from_hf(config: dict, name: str = "whisper-encoder", token_merge: int = 1) -> EncoderSpec:
    """An `EncoderSpec` from a Whisper ``config.json``; 30 s chunks of 16 kHz audio, hop 160."""
    if config.get("activation_function", "gelu") != "gelu":
        raise ConfigError(f"Whisper activation_function={config['activation_function']!r} unsupported; expected gelu")
    d = config["d_model"]
    body = TransformerSpec(n_layers=config["encoder_layers"], hidden=d, n_heads=config["encoder_attention_heads"],
                           ffn_hidden=config["encoder_ffn_dim"], norm_eps=1e-5)
    positions = config["max_source_positions"]
    hop = 160
    return EncoderSpec(name, ("audio",), body, n_mels=config["num_mel_bins"], sample_rate=16000,
                       hop_length=hop, conv_stride=2, chunk_seconds=positions * 2 * hop / 16000,
                       max_positions=positions, pre_norm=False, post_norm=True, token_merge=token_merge)


def whisper_config_to_hf(spec: EncoderSpec) -> dict:
    b = spec.body
    return {
        "model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"], "d_model": b.hidden,
        "encoder_layers": b.n_layers, "encoder_attention_heads": b.n_heads, "encoder_ffn_dim": b.ffn_hidden,
        "num_mel_bins": spec.n_mels, "max_source_positions": spec.max_positions, "activation_function": "gelu",
        # Only the encoder is written; the decoder fields just keep the config valid for transformers.
        "decoder_layers": b.n_layers, "decoder_attention_heads": b.n_heads, "decoder_ffn_dim": b.ffn_hidden,
    }


def whisper_state_from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = find_prefix(state, "conv1.weight", "Whisper encoder")
    ours = rename(state, TABLE, to_ours=True, src_prefix=prefix)
    ours["pos_embed"] = state[prefix + "embed_positions.weight"]
    for key in [k for k in ours if k.endswith("attn.k_proj.weight")]:
        bias = key.replace(".weight", ".bias")
        ours.setdefault(bias, torch.zeros(ours[key].shape[0], dtype=ours[key].dtype))
    return ours


def whisper_state_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    prefix = "model.encoder."
    hf = rename({k: v for k, v in state.items() if not k.endswith("attn.k_proj.bias")}, TABLE, to_ours=False,
                dst_prefix=prefix)
    hf[prefix + "embed_positions.weight"] = state["pos_embed"]
    return hf


def load_hf_whisper(path: str | Path, layers: tuple[int, int] | None = None, token_merge: int = 1) -> AudioEncoder:
    """Build an `AudioEncoder` (or a stage of it) from a Whisper checkpoint directory (encoder only)."""
    spec = whisper_spec_from_hf(read_config(path), name=Path(path).name, token_merge=token_merge)
    model = build_audio_encoder(spec, layers)
    load_into(model, whisper_state_from_hf(read_state_dict(path)), f"Whisper checkpoint {path}")
    return model


def save_hf_whisper(model: AudioEncoder, path: str | Path) -> None:
    """Write a whole Whisper-architecture `AudioEncoder` as the encoder of a Whisper checkpoint."""
    if not (model.is_first and model.is_last):
        raise ConfigError("save_hf_whisper needs the whole encoder; gather the stages' state dicts first")
    model = copy.deepcopy(model)
    merge_lora(model)
    write_checkpoint(path, whisper_state_to_hf(model.state_dict()), whisper_config_to_hf(model.spec))
