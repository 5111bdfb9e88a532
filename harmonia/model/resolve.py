"""Which MLLM a job, a plan or a scenario means: a preset name, an HF checkpoint, or a composition.

A *model source* is one of

- a preset name (``tiny-omni``, ``llava-siglip-8b``; see `harmonia models`),
- a directory holding an HF ``config.json`` (a whole multimodal checkpoint such as
  ``LlavaForConditionalGeneration`` or ``LlavaNextForConditionalGeneration``), or
- a composition ``{"llm": DIR, "encoders": {"vision": DIR, "audio": DIR}}`` of separate HF
  checkpoints whose projectors start fresh.

The architecture is read from the checkpoints' ``config.json`` only (no weights), so the cost
model and the planner work on a real checkpoint without a preset.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harmonia.errors import ConfigError
from harmonia.model.spec import MLLMSpec
from harmonia.model.training_mode import ModuleTraining

ModelSource = str | dict


def is_checkpoint_dir(name: str | Path) -> bool:
    """Whether ``name`` is a directory holding an HF ``config.json``."""
    return Path(name).is_dir() and (Path(name) / "config.json").is_file()


def resolve_mllm(source: ModelSource, training: dict[str, str] | None = None,
                 lora_rank: int | None = None, lora: dict[str, dict] | None = None) -> MLLMSpec:
    """The `MLLMSpec` of a model source, with training modes (``{"vision": "frozen"}``) applied, and
    the LoRA modules' settings: one ``lora_rank`` for all, or ``lora`` per module
    (`ModuleTraining.lora_options`, as a checkpoint records them).

    Raises:
        ConfigError: an unknown preset, a path without ``config.json``, or an architecture or config
            field harmonia does not implement (named in the message).
    """
    if isinstance(source, dict) or is_checkpoint_dir(source):
        from harmonia.model.hf.mllm import mllm_spec_from_hf

        spec = mllm_spec_from_hf(source)
        spec = spec.with_training(**(training or {}))
    elif isinstance(source, str) and ("/" in source or source.startswith(".")):
        raise ConfigError(f"model {source!r}: no config.json there; pass an HF checkpoint directory or a preset "
                          "name (see `harmonia models`)")
    else:
        from harmonia.model.presets import mllm_preset

        spec = mllm_preset(source, training=training)
    if lora_rank is not None:
        spec = replace(spec, training={m: ModuleTraining(t.mode, lora_rank=lora_rank)
                                       for m, t in spec.training.items()})
    if lora:
        spec = replace(spec, training={**spec.training, **{
            m: ModuleTraining("lora", lora_rank=o["rank"], lora_alpha=o["alpha"], lora_dropout=o["dropout"],
                              lora_targets=tuple(o["targets"])) for m, o in lora.items()}})
    return spec


def source_identity(source: ModelSource) -> str | dict:
    """A model source with absolute paths (what a checkpoint records, valid from any directory)."""
    if isinstance(source, dict):
        return {"llm": str(Path(source["llm"]).resolve()),
                "encoders": {k: str(Path(v).resolve()) for k, v in source.get("encoders", {}).items()}}
    return str(Path(source).resolve()) if is_checkpoint_dir(source) else source


def tokenizer_identity(directory: str | Path | None) -> str | None:
    """A digest of a checkpoint's tokenizer files (vocabulary, merges, special tokens, chat template),
    or None when there is no directory (the byte tokenizer)."""
    import hashlib

    if not directory:
        return None
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model"):
        path = Path(directory) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]
