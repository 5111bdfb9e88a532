"""Checkpoints with torch.distributed.checkpoint: sharded model and optimizer, trainer state, RNG.

Every module's parameters are saved under their whole-model names (``llm.blocks.3.attn.q.weight``),
whatever the layout that holds them, through `get_state_dict` / `set_state_dict`, which understand
FSDP2 and DTensor shards. Distributed checkpoint writes each rank's shards and a global index, so a
checkpoint written under one layout loads under another (a different DP degree, TP on or off, other
pipeline stage boundaries): each rank reads exactly the slices it now owns.

Beside the tensors: ``trainer.json`` (step, data position, scheduler state; written by rank 0) and
one ``rng-<rank>.pt`` per rank (torch, numpy and Python generators, as tensors and numbers), so a
resumed run continues the same stream.

A checkpoint cannot be half-written or lost: it is written to ``step-N.tmp``, every file and the
directory are fsynced, and only then is it renamed to ``step-N`` (atomic); a complete ``step-N`` is
never deleted to make room for a new one, and deleting an old one (retention) renames it to
``step-N.deleting`` first. Loading never runs code from the files: RNG files load with
``weights_only=True``, and distributed checkpoint's pickled ``.metadata`` is read through an
unpickler that admits only its own classes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from harmonia.errors import ConfigError

log = logging.getLogger(__name__)


class CheckpointError(ConfigError):
    """A checkpoint cannot be read or trusted; the message names the file and what to do."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step}"


def complete_steps(directory: str | Path) -> list[int]:
    """Steps of the complete checkpoints in ``directory`` (``step-N`` with its ``trainer.json``), ascending."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = [int(p.name.removeprefix("step-")) for p in root.glob("step-*")
             if p.name.removeprefix("step-").isdigit() and (p / "trainer.json").is_file()]
    return sorted(steps)


def latest_step(directory: str | Path) -> int | None:
    """The newest complete checkpoint's step in ``directory``, or None."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def read_trainer_state(directory: str | Path, step: int) -> dict:
    """``trainer.json`` of checkpoint ``step``."""
    path = step_dir(directory, step) / "trainer.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read ({err}); remove that checkpoint to resume from an older one") \
            from None


def _states(modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # DTensor: 0.6 s to import

    out = {}
    for name, module in modules.items():
        opt = optimizers.get(name)
        model_sd, opt_sd = get_state_dict(module, [opt] if opt else [], options=StateDictOptions())
        out[f"model.{name}"] = model_sd
        if opt is not None:
            out[f"optim.{name}"] = opt_sd
    return out


def save_checkpoint(directory: str | Path, step: int, modules: dict[str, nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer], trainer_state: dict) -> Path:
    """Save a checkpoint of ``step`` collectively (every rank calls it). Returns its directory."""
    return save_state(directory, step, _states(modules, optimizers), trainer_state)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _agree(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank."""
    if not dist.is_initialized():
        return flag
    box = [flag]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def save_state(directory: str | Path, step: int, state: dict, trainer_state: dict, keep: int = 0,
               before_commit: Callable[[], None] | None = None) -> Path:
    """Save a nested dict of tensors (DTensors sharded as they are) as checkpoint ``step``, collectively.

    A complete ``step-N`` already there is kept as it is (a finished job is not re-saved).

    Args:
        directory: the run's checkpoint directory (``step-N`` is written inside).
        step: the step the state is after.
        state: this rank's tensors, keyed so that the same key means the same tensor on every rank
            and under every layout (e.g. whole-model parameter names).
        trainer_state: JSON-able trainer state (data position, ...), written by rank 0.
        keep: after saving, delete all but the newest ``keep`` checkpoints (0 = keep all).
        before_commit: called on every rank once its files are written, before the rename.
    """
    final, tmp = step_dir(directory, step), Path(directory) / f"step-{step}.tmp"
    if _agree(_rank() == 0 and (final / "trainer.json").is_file()):
        log.warning("checkpoint %s already exists; kept as it is", final)
        return final
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that crashed earlier
        tmp.mkdir(parents=True)
    _barrier()
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    _write_synced(tmp / f"rng-{_rank()}.pt", buffer.getvalue())
    if before_commit is not None:
        before_commit()
    _barrier()
    if _rank() == 0:
        _write_synced(tmp / "trainer.json", json.dumps({"step": step, **trainer_state}, indent=1).encode())
        _fsync_dir(tmp)
        if final.exists():  # not complete (checked above): nothing of value, e.g. an interrupted copy
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(final.parent)
        if keep:
            prune_checkpoints(directory, keep)
    _barrier()
    return final


def prune_checkpoints(directory: str | Path, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints; returns the deleted steps.

    Each is renamed to ``step-N.deleting`` before its files go, so a crash while deleting never
    leaves a ``step-N`` that looks complete and is not.
    """
    old = complete_steps(directory)[:-keep] if keep else []
    for step in old:
        doomed = Path(directory) / f"step-{step}.deleting"
        step_dir(directory, step).rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return old


def remove_partial(directory: str | Path) -> list[str]:
    """Delete what crashed saves and deletions left (``step-N.tmp``, ``step-N.deleting``); returns their names.

    Only safe while no job writes the directory (hold its lock).
    """
    root = Path(directory)
    removed = []
    for pattern in ("step-*.tmp", "step-*.deleting"):
        for path in sorted(root.glob(pattern)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def rng_state() -> dict:
    """This process's torch, numpy and Python generator states as tensors and numbers only."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_file(path: Path) -> dict:
    """An ``rng-<rank>.pt`` file, read with ``weights_only=True`` (tensors and numbers only, no code)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"{path} is not an RNG state harmonia wrote (it holds more than tensors and numbers, "
                              "so it was not unpickled); restore the checkpoint from a trusted copy or remove it") \
            from None
    except Exception as err:  # noqa: BLE001 -- unreadable or truncated: not a file harmonia wrote either
        raise CheckpointError(f"{path} cannot be read as an RNG state ({str(err).splitlines()[0]}); restore the "
                              "checkpoint from a trusted copy or remove it") from None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes distributed checkpoint's metadata is made of."""

    MODULES = ("torch.distributed.checkpoint.metadata",)
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"),
             ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("collections", "OrderedDict"),
             ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
             ("pathlib", "PureWindowsPath"), ("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module: str, name: str):
        if module in self.MODULES or (module, name) in self.NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of a checkpoint index")


def verify_checkpoint(directory: str | Path, step: int, rng: bool = True) -> None:
    """Refuse a checkpoint whose pickled files could run code: its ``.metadata`` (and RNG files)."""
    path = step_dir(directory, step)
    metadata = path / ".metadata"
    try:
        with open(metadata, "rb") as f:
            _MetadataUnpickler(f).load()
    except OSError as err:
        raise CheckpointError(f"{metadata} cannot be read ({err}); the checkpoint is incomplete") from None
    except Exception as err:  # noqa: BLE001 -- anything else: not an index distributed checkpoint wrote
        raise CheckpointError(f"{metadata} is not a checkpoint index (refused to load it: {err}); restore the "
                              "checkpoint from a trusted copy or remove it") from None
    for rng_file in sorted(path.glob("rng-*.pt")) if rng else []:
        load_rng_file(rng_file)


def load_checkpoint(directory: str | Path, modules: dict[str, nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer], step: int | None = None,
                    restore_rng: bool = True) -> dict:
    """Load a checkpoint (the newest when ``step`` is None) into this rank's modules and optimizers.

    Returns:
        The trainer state saved with it (``step`` included).

    Raises:
        ConfigError: when there is no checkpoint to load.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    states = _states(modules, optimizers)
    trainer = load_state(directory, states, step, restore_rng)
    for name, module in modules.items():
        opt = optimizers.get(name)
        set_state_dict(module, [opt] if opt else [], model_state_dict=states[f"model.{name}"],
                       optim_state_dict=states.get(f"optim.{name}", {}))
    return trainer


def load_state(directory: str | Path, state: dict, step: int | None = None, restore_rng: bool = True) -> dict:
    """Load checkpoint ``step`` (default: the newest) into ``state``'s tensors in place.

    Each rank reads exactly the slices its tensors (or DTensor shards) hold, whatever layout wrote
    them. Returns the trainer state saved with the checkpoint (``step`` included).

    Raises:
        ConfigError: when there is no checkpoint to load.
        CheckpointError: when a file of it is not one harmonia wrote.
    """
    step = latest_step(directory) if step is None else step
    path = step_dir(directory, step) if step is not None else None
    if path is None or not (path / "trainer.json").is_file():
        raise ConfigError(f"no complete checkpoint in {directory}; train without resume or point "
                          "checkpoint.dir at a run that saved one")
    verify_checkpoint(directory, step, rng=False)  # this rank's RNG file is read safely below
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(path))
    rng_file = path / f"rng-{_rank()}.pt"
    if restore_rng and rng_file.is_file():
        set_rng_state(load_rng_file(rng_file))
    return read_trainer_state(directory, step)
