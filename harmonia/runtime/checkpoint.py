"""Checkpoints with torch.distributed.checkpoint: sharded model and optimizer, trainer state, RNG.

Every module's parameters are saved under their whole-model names (``llm.blocks.3.attn.q.weight``),
whatever the layout that holds them, through `get_state_dict` / `set_state_dict`, which understand
FSDP2 and DTensor shards. Distributed checkpoint writes each rank's shards and a global index, so a
checkpoint written under one layout loads under another (a different DP degree, TP on or off, other
pipeline stage boundaries): each rank reads exactly the slices it now owns.

Beside the tensors: ``trainer.json`` (step, data position, scheduler state; written by rank 0) and
one ``rng-<rank>.pt`` per rank (torch, numpy and Python generators), so a resumed run continues the
same stream. A checkpoint is written to ``step-N.tmp`` and renamed when complete, so a crash while
saving never leaves a directory that looks valid.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from harmonia.errors import ConfigError


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest_step(directory: str | Path) -> int | None:
    """The newest complete checkpoint's step in ``directory``, or None."""
    steps = [int(p.name.removeprefix("step-")) for p in Path(directory).glob("step-*")
             if p.is_dir() and p.name.removeprefix("step-").isdigit() and (p / "trainer.json").is_file()]
    return max(steps, default=None)


def _states(modules: dict[str, nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> dict:
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


def save_state(directory: str | Path, step: int, state: dict, trainer_state: dict) -> Path:
    """Save a nested dict of tensors (DTensors sharded as they are) as checkpoint ``step``, collectively.

    Args:
        directory: the run's checkpoint directory (``step-N`` is written inside).
        step: the step the state is after.
        state: this rank's tensors, keyed so that the same key means the same tensor on every rank
            and under every layout (e.g. whole-model parameter names).
        trainer_state: JSON-able trainer state (data position, ...), written by rank 0.
    """
    final = Path(directory) / f"step-{step}"
    tmp = Path(directory) / f"step-{step}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               tmp / f"rng-{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def load_checkpoint(directory: str | Path, modules: dict[str, nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer], step: int | None = None,
                    restore_rng: bool = True) -> dict:
    """Load a checkpoint (the newest when ``step`` is None) into this rank's modules and optimizers.

    Returns:
        The trainer state saved with it (``step`` included).

    Raises:
        ConfigError: when there is no checkpoint to load.
    """
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
    """
    step = latest_step(directory) if step is None else step
    path = Path(directory) / f"step-{step}"
    if step is None or not (path / "trainer.json").is_file():
        raise ConfigError(f"no complete checkpoint in {directory}; train without resume or point "
                          "checkpoint.dir at a run that saved one")
    dcp.load(state, checkpoint_id=str(path))
    rng_file = path / f"rng-{_rank()}.pt"
    if restore_rng and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
    return json.loads((path / "trainer.json").read_text())
