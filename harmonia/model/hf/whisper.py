"""Whisper encoder checkpoints (``WhisperForConditionalGeneration``, ``WhisperModel``) <-> `AudioEncoder`.

Whisper's ``k_proj`` has no bias; ours does. A key bias adds the same ``q . b`` to every score of a
query, which softmax cancels (and its gradient is zero), so it is loaded as zeros and dropped on
saving without changing outputs. An encoder alone is not a loadable Whisper checkpoint: saving
writes the source checkpoint's format with its decoder copied unchanged.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.audio import AudioEncoder, build_audio_encoder
from harmonia.model.hf.io import CheckpointFiles, load_into, read_full_config
from harmonia.model.hf.whisper_config import ZERO_KEYS, whisper_names, whisper_spec_from_hf
from harmonia.model.lora import merge_lora

def load_hf_whisper(path: str | Path, layers: tuple[int, int] | None = None, token_merge: int = 1) -> AudioEncoder:
    """Build an `AudioEncoder` (or a stage of it) from a Whisper checkpoint directory (encoder only)."""
    spec = whisper_spec_from_hf(read_full_config(path), name=Path(path).name, token_merge=token_merge)
    model = build_audio_encoder(spec, layers)
    files = CheckpointFiles(path)
    names = whisper_names(files.keys())
    own = model.state_dict()
    state = files.read(names[k] for k in own if k in names)
    ours = {k: state[names[k]] if k in names else torch.zeros_like(t) for k, t in own.items()
            if k in names or ZERO_KEYS.match(k)}
    load_into(model, ours, f"Whisper checkpoint {path}")
    return model


def save_hf_whisper(model: AudioEncoder, path: str | Path, source: str | Path,
                    dtype: torch.dtype = torch.float32) -> None:
    """Write a whole `AudioEncoder` into a copy of its source Whisper checkpoint (LoRA merged first).

    The decoder, tokenizer, processor and generation files come from ``source`` unchanged, so
    transformers loads the result with no missing keys.
    """
    if not (model.is_first and model.is_last):
        raise ConfigError("save_hf_whisper needs the whole encoder; gather the stages' state dicts first")
    from harmonia.model.hf.export import write_like_source

    model = copy.deepcopy(model)
    merge_lora(model)
    names = whisper_names(CheckpointFiles(source).keys())
    write_like_source(source, path, {names[k]: v for k, v in model.state_dict().items() if k in names}, dtype)
