"""`harmonia export`: a training checkpoint back to an HF directory that transformers loads.

Every checkpoint's ``trainer.json`` carries the run's fingerprint (`harmonia.train.preflight`): the
model source with absolute paths, how each module trains, the LoRA rank. Export reads the
distributed checkpoint's tensors (keyed by whole-model names, whatever the layout that wrote them)
one output shard at a time (`checkpoint_state`, a `harmonia.model.hf.lazy.LazyTensors`), frozen
weights from the source itself (`with_source_frozen`), and writes the source's HF format
(`harmonia.model.hf.export.export_hf`): config, safetensors shards with their index, tokenizer and
processor files copied, LoRA merged. Its peak memory is about one output shard, whatever the model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from harmonia.errors import ConfigError
from harmonia.model.hf.lazy import LazyTensors

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


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "source",
                      max_shard_bytes: int = 5 * 2**30, adapter: bool = False) -> Path:
    """Export a training checkpoint (a job's ``checkpoint.dir``: its newest step; or a ``step-N``).

    Args:
        checkpoint: the checkpoint directory or one step of it.
        out: a new or empty directory.
        dtype: ``source`` (the source checkpoint's dtype) or a torch dtype name.
        max_shard_bytes: the largest safetensors file written (about the export's peak memory).
        adapter: write the LoRA adapters as a PEFT adapter directory for the source checkpoint
            (`harmonia.model.hf.adapter`) instead of the merged model.

    Raises:
        ConfigError: no checkpoint, a checkpoint of a preset model (no HF source), or an ``out`` that
            is not a new or empty directory.
    """
    import torch

    from harmonia.model.hf.export import export_hf

    if dtype not in DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: expected one of {DTYPES}")
    step = _step_dir(Path(checkpoint))
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; pass a new directory to export to")
    fingerprint, source, spec = _trained_from(step)
    state = checkpoint_state(step, spec, source)
    written = _source_dtype(source) if dtype == "source" else getattr(torch, dtype)
    if adapter:
        from harmonia.model.hf.adapter import export_peft_adapter

        return export_peft_adapter(state, spec, source, out, written)
    state = with_source_frozen(state, spec, source, [m for m, t in fingerprint["training"].items() if t != "full"])
    export_hf(state, spec, source, out, written, max_shard_bytes)
    return out


def _trained_from(step: Path) -> tuple[dict, str | dict, object]:
    """A checkpoint step's fingerprint, HF source and model spec (its modules trained as they were).

    Raises:
        ConfigError: a checkpoint of a preset (no HF source), or a source whose files changed.
    """
    from harmonia.model.resolve import is_checkpoint_dir, resolve_mllm

    fingerprint = json.loads((step / "trainer.json").read_text()).get("fingerprint") or {}
    source = fingerprint.get("model")
    if not (isinstance(source, dict) or (isinstance(source, str) and is_checkpoint_dir(source))):
        raise ConfigError(f"{step} was trained from {source!r}, not from HF checkpoints (model.hf or model.llm): "
                          "there is no HF format to export to")
    lora = {m: t for m, t in fingerprint["training"].items() if t != "full"}
    spec = resolve_mllm(source, training=lora, lora_rank=fingerprint.get("lora_rank") or None,
                        lora=fingerprint.get("lora"))
    _check_source_files(step, source, fingerprint)
    return fingerprint, source, spec


def checkpoint_model(checkpoint: str | Path):
    """A training checkpoint of an HF-sourced run as one whole model in this process (fp32, CPU):
    ``(spec, model)``, its frozen tensors read from the source as the ranks read them.

    Args:
        checkpoint: the checkpoint directory (its newest step) or one ``step-N``.
    """
    from harmonia.train.weights import initial_model

    step = _step_dir(Path(checkpoint))
    _, source, spec = _trained_from(step)
    model = initial_model(spec, 0, source)  # every tensor the checkpoint lacks is the source's
    load_beside_source(model, step, spec, source)
    return spec, model.eval()


def load_beside_source(model, step: Path, spec, source: str | dict) -> None:
    """Load checkpoint ``step`` into ``model`` (built from ``source``, fp32, this process): the tensors
    the checkpoint holds; the rest keep the source's values, which must be its frozen ones
    (`checkpoint_state` refuses a checkpoint lacking anything else)."""
    import torch.distributed.checkpoint as dcp

    checkpoint_state(step, spec, source)
    held = set(dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata)
    state = {"model": {k: t for k, t in model.state_dict().items() if f"model.{k}" in held}}
    with warnings.catch_warnings():  # reading in one process is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step), no_dist=True)


def _check_source_files(step: Path, source, fingerprint: dict) -> None:
    """Refuse a source whose files changed since training: the checkpoint lacks its frozen tensors."""
    from harmonia.train.source_state import source_digest

    if "model_files" in fingerprint and fingerprint["model_files"] != source_digest(source):
        raise ConfigError(f"{step} was trained on {source} as it was then (digest {fingerprint['model_files']}); its "
                          f"files changed since (digest {source_digest(source)}), and the checkpoint holds only what "
                          "training changed: restore the source the run trained from")


def checkpoint_state(step: Path, spec, source: str | dict | None = None) -> LazyTensors:
    """A training checkpoint's whole-model tensors, read from the distributed checkpoint a batch at a
    time (`torch.distributed.checkpoint` reads each tensor's pieces from every rank's file). Frozen
    tensors the ``source`` gives may be absent (`harmonia.train.source_state`): they are listed, with
    their shapes, for `with_source_frozen` to read from the source.

    Raises:
        ConfigError: the checkpoint's tensors are not the model's (names as ``build_mllm_model(spec)``).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from harmonia.model.mllm import build_mllm_model

    stored = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    meta = {k.removeprefix("model."): m for k, m in stored.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    from harmonia.train.source_state import source_provided

    with torch.device("meta"):
        want = build_mllm_model(spec).state_dict()
    given = source_provided(spec, source, set(want) - set(meta), ())
    differ = sorted((set(want) - given) ^ set(meta))
    if differ:
        raise ConfigError(f"{step} holds other tensors than the model it was trained as (e.g. {differ[:3]}); "
                          "export the checkpoint with the code version that wrote it")

    def load(keys: list[str]) -> dict:
        absent = [k for k in keys if k not in meta]
        if absent:
            raise ConfigError(f"{step} does not hold {absent[:3]}: frozen tensors its source gives; read them from "
                              "the source (with_source_frozen)")
        state = {"model": {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}}
        with warnings.catch_warnings():  # reading in one process is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(step), no_dist=True)
        return state["model"]

    keys = [*meta, *sorted(given - set(meta))]
    dtypes = {**{k: m.properties.dtype for k, m in meta.items()}, **{k: torch.float32 for k in given - set(meta)}}
    shapes = {**{k: m.size for k, m in meta.items()}, **{k: want[k].shape for k in given - set(meta)}}
    return LazyTensors(keys, load, dtypes, shapes)


def with_source_frozen(state: LazyTensors, spec, source: str | dict, frozen: list[str]) -> LazyTensors:
    """``state`` with the tensors of the ``frozen`` modules (frozen, or LoRA-trained: everything but
    their adapters) read from the source checkpoint instead. Training never changes a frozen
    weight, but mixed precision holds it in bf16 (`harmonia.runtime.parallelize.hold_frozen_in`),
    so the training checkpoint has it rounded: the export writes (and merges adapters into) what the
    source had."""
    from harmonia.model.hf.stages import ModuleReader
    from harmonia.model.mllm import state_prefix
    from harmonia.train.weights import is_adapter, unwrapped

    readers = {state_prefix(spec, m): ModuleReader(source, spec, m) for m in frozen}

    def reader_of(key: str):
        hit = [(p, r) for p, r in readers.items() if key.startswith(p)]
        return None if not hit or is_adapter(key) or hit[0][1].fresh else hit[0]

    def load(keys: list[str]) -> dict:
        out = state.load([k for k in keys if reader_of(k) is None])
        for key in keys:
            if key not in out:
                prefix, reader = reader_of(key)
                out[key] = reader.read(unwrapped(key[len(prefix):]), state.shapes[key], state.dtypes[key])
        return out

    return LazyTensors(state, load, state.dtypes, state.shapes)
