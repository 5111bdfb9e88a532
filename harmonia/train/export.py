"""`harmonia export`: a training checkpoint back to an HF directory that transformers loads.

A job started from HF checkpoints writes ``model.json`` beside its checkpoints (the model source,
the training modes, the precision). Export reads it, gathers the whole model's weights from a
distributed checkpoint in one process (they are keyed by whole-model names, whatever the layout
that wrote them), and writes the source's HF format (`harmonia.model.hf.export.export_hf`): config,
safetensors shards with their index, tokenizer and processor files copied, LoRA merged.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from harmonia.errors import ConfigError

MODEL_CARD = "model.json"


def model_card(source: str | dict, training: dict[str, str], lora_rank: int, dtype: str) -> dict:
    """What export needs to rebuild the model: its source, training modes, LoRA rank and dtype."""
    if isinstance(source, str):
        source = str(Path(source).resolve()) if Path(source).is_dir() else source
    else:
        source = {"llm": str(Path(source["llm"]).resolve()),
                  "encoders": {k: str(Path(v).resolve()) for k, v in source["encoders"].items()}}
    return {"source": source, "training": training, "lora_rank": lora_rank, "dtype": dtype}


def write_model_card(directory: str | Path, card: dict) -> None:
    """Write ``model.json`` into the checkpoint directory (atomically)."""
    path = Path(directory) / MODEL_CARD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(card, indent=1))
    tmp.replace(path)


def _step_dir(checkpoint: Path) -> tuple[Path, Path]:
    """(checkpoint root holding model.json, the step directory to export)."""
    from harmonia.runtime.checkpoint import latest_step

    if (checkpoint / "trainer.json").is_file():
        return checkpoint.parent, checkpoint
    step = latest_step(checkpoint)
    if step is None:
        raise ConfigError(f"{checkpoint} holds no complete checkpoint (step-N with trainer.json); pass a "
                          "checkpoint directory written by harmonia train, or one of its step-N directories")
    return checkpoint, checkpoint / f"step-{step}"


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Export a training checkpoint (its root: the newest step; or a ``step-N``) to ``out``.

    Raises:
        ConfigError: no checkpoint, no ``model.json`` (a job trained from a preset has no HF source),
            or an ``out`` that is not a new or empty directory.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    from harmonia.model.hf.export import export_hf
    from harmonia.model.mllm import build_mllm_model
    from harmonia.model.resolve import resolve_mllm

    root, step = _step_dir(Path(checkpoint))
    card_path = root / MODEL_CARD
    if not card_path.is_file():
        raise ConfigError(f"{card_path} not found: only jobs started from HF checkpoints (model.hf or model.llm) "
                          "can be exported")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; pass a new directory to export to")
    card = json.loads(card_path.read_text())
    spec = resolve_mllm(card["source"], training=card["training"], lora_rank=card["lora_rank"])
    model = build_mllm_model(spec)
    state = {"model": dict(model.state_dict())}
    with warnings.catch_warnings():  # loading in one process is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step), no_dist=True)
    dtype = getattr(torch, card["dtype"])
    export_hf(state["model"], spec, card["source"], out, dtype)
    return out
