"""A Whisper encoder checkpoint's spec and tensor names (`harmonia.model.hf.whisper` loads and saves
its weights): no torch, so reading a spec to plan with does not import it."""

from __future__ import annotations

import re

from harmonia.errors import ConfigError
from harmonia.model.hf.io import Table, find_prefix, rename
from harmonia.model.spec import EncoderSpec, TransformerSpec

TABLE: Table = [
    ("conv1.", "conv1."),
    ("conv2.", "conv2."),
    ("embed_positions.weight", "pos_embed"),
    *[(f"layers.{{i}}.self_attn.{p}.", f"layers.{{i}}.attn.{q}.")
      for p, q in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj"))],
    ("layers.{i}.self_attn_layer_norm.", "layers.{i}.attn_norm."),
    ("layers.{i}.final_layer_norm.", "layers.{i}.mlp_norm."),
    ("layers.{i}.fc1.", "layers.{i}.mlp.fc1."),
    ("layers.{i}.fc2.", "layers.{i}.mlp.fc2."),
    ("layer_norm.", "post_norm."),
]
ZERO_KEYS = re.compile(r"^layers\.\d+\.attn\.k_proj\.bias$")  # ours, absent from Whisper
TRAINING_ONLY = ("dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop")


def whisper_spec_from_hf(config: dict, name: str = "whisper-encoder", token_merge: int = 1) -> EncoderSpec:
    """An `EncoderSpec` from a Whisper ``config.json``; chunks of ``max_source_positions`` tokens, 16 kHz, hop 160."""
    if config.get("model_type") != "whisper":
        raise ConfigError(f"config model_type={config.get('model_type')!r} is not a Whisper checkpoint; a whole "
                          "multimodal checkpoint is read with harmonia.model.hf.mllm.mllm_spec_from_hf")
    if config.get("activation_function", "gelu") != "gelu":
        raise ConfigError(f"Whisper activation_function={config['activation_function']!r} unsupported; expected gelu")
    for field in TRAINING_ONLY:
        if config.get(field, 0.0):
            raise ConfigError(f"Whisper {field}={config[field]} is not implemented (harmonia trains without dropout "
                              "or layer drop); set it to 0.0")
    if config.get("apply_spec_augment", False):
        raise ConfigError("Whisper apply_spec_augment=true (SpecAugment masking in training) is not implemented; "
                          "set it to false")
    d = config["d_model"]
    body = TransformerSpec(n_layers=config["encoder_layers"], hidden=d, n_heads=config["encoder_attention_heads"],
                           ffn_hidden=config["encoder_ffn_dim"], norm_eps=1e-5)
    positions = config["max_source_positions"]
    hop = 160
    return EncoderSpec(name, ("audio",), body, n_mels=config["num_mel_bins"], sample_rate=16000,
                       hop_length=hop, conv_stride=2, chunk_seconds=positions * 2 * hop / 16000,
                       max_positions=positions, pre_norm=False, post_norm=True, token_merge=token_merge)


def whisper_names(keys: list[str]) -> dict[str, str]:
    """Our encoder names -> the checkpoint's names (keys only); ``k_proj`` biases have none (`ZERO_KEYS`)."""
    prefix = find_prefix(dict.fromkeys(keys), "conv1.weight", "Whisper encoder")
    return rename({k: k for k in keys}, TABLE, to_ours=True, src_prefix=prefix)
