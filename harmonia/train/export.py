"""`harmonia export`: a training checkpoint back to an HF directory that transformers loads.

Every checkpoint's ``trainer.json`` carries the run's fingerprint (`harmonia.train.preflight`): the
model source with absolute paths, how each module trains, the LoRA rank. Export rebuilds the model
from it, gathers the whole model's weights from the distributed checkpoint in one process (they
are keyed by whole-model names, whatever the layout that wrote them), and writes the source's HF
format (`harmonia.model.hf.export.export_hf`): config, safetensors shards with their index, tokenizer
and processor files copied, LoRA merged.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from harmonia.errors import ConfigError

DTYPES = ("source", "float32", "bfloat16", "float16")


def _step_dir(checkpoint: Path) -> Path:
    """The step directory to export: ``checkpoint`` itself, or the newest step inside it."""
    from harmonia.runtime.checkpoint import latest_step

    if (checkpoint / "trainer.json").is_file():
        return checkpoint
    step = latest_step(checkpoint) if checkpoint.is_dir() else None
    if step is None:
        raise ConfigError(f"{checkpoint} holds no complete checkpoint (step-N with trainer.json); pass a "
                          "checkpoint directory written by harmonia train, or one of its step-N directories")
    return checkpoint / f"step-{step}"


def _source_dtype(source: str | dict):
    """The dtype of the source checkpoint's config (its LLM's for a composition)."""
    import torch

    root = Path(source if isinstance(source, str) else source["llm"])
    config = json.loads((root / "config.json").read_text())
    name = config.get("torch_dtype") or config.get("dtype") or config.get("text_config", {}).get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.float32


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "source") -> Path:
    """Export a training checkpoint (a job's ``checkpoint.dir``: its newest step; or a ``step-N``).

    Args:
        checkpoint: the checkpoint directory or one step of it.
        out: a new or empty directory.
        dtype: ``source`` (the source checkpoint's dtype) or a torch dtype name.

    Raises:
        ConfigError: no checkpoint, a checkpoint of a preset model (no HF source), or an ``out`` that
            is not a new or empty directory.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    from harmonia.model.hf.export import export_hf
    from harmonia.model.mllm import build_mllm_model
    from harmonia.model.resolve import is_checkpoint_dir, resolve_mllm

    if dtype not in DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: expected one of {DTYPES}")
    step = _step_dir(Path(checkpoint))
    fingerprint = json.loads((step / "trainer.json").read_text()).get("fingerprint") or {}
    source = fingerprint.get("model")
    if not (isinstance(source, dict) or (isinstance(source, str) and is_checkpoint_dir(source))):
        raise ConfigError(f"{step} was trained from {source!r}, not from HF checkpoints (model.hf or model.llm): "
                          "there is no HF format to export to")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; pass a new directory to export to")
    lora = {m: t for m, t in fingerprint["training"].items() if t != "full"}
    spec = resolve_mllm(source, training=lora, lora_rank=fingerprint.get("lora_rank") or None)
    model = build_mllm_model(spec)
    state = {"model": dict(model.state_dict())}
    with warnings.catch_warnings():  # loading in one process is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step), no_dist=True)
    frozen_from_source(state["model"], spec, source, [m for m, t in fingerprint["training"].items() if t != "full"])
    export_hf(state["model"], spec, source, out, _source_dtype(source) if dtype == "source" else getattr(torch, dtype))
    return out


def frozen_from_source(state: dict, spec, source: str | dict, frozen: list[str]) -> int:
    """Put the source checkpoint's own tensors of the ``frozen`` modules (frozen, or LoRA-trained:
    everything but their adapters) into ``state`` (a whole model's, as `MLLM.state_dict` names
    them, LoRA wrappers included); returns how many. Training never changes a frozen weight, but
    mixed precision holds it in bf16 (`harmonia.runtime.parallelize.hold_frozen_in`), so the
    training checkpoint has it rounded: the export writes (and merges adapters into) what the
    source had."""
    import torch

    from harmonia.model.hf.stages import load_module_state
    from harmonia.model.mllm import state_prefix
    from harmonia.train.weights import is_adapter, unwrapped

    count = 0
    for name in frozen:
        prefix = state_prefix(spec, name)
        ours = {unwrapped(k[len(prefix):]): k for k in state if k.startswith(prefix) and not is_adapter(k)}
        with torch.no_grad():
            for key, t in load_module_state(source, spec, name, None, set(ours)).items():
                state[ours[key]].copy_(t)
                count += 1
    return count
