"""Checkpoints of a training job: every rank's named parameters and optimizer states, by whole-model name.

Keys are whole-model names, never stage or rank positions, so a checkpoint written under one plan
loads under any other (another DP degree, other stage boundaries, FSDP on or off): distributed
checkpoint gives each rank exactly the slices it now holds. Optimizer states (AdamW's ``step``,
``exp_avg``, ``exp_avg_sq``) are created before loading so there is a tensor to load into.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harmonia.runtime.checkpoint import load_state, save_state
from harmonia.train.rank import RankModel

ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def _param_names(model: RankModel) -> dict[int, str]:
    return {id(t): n for n, t in model.trainable_named().items()}


def ensure_optimizer_state(model: RankModel) -> None:
    """Give every trainable parameter AdamW state (zeros) if it has none yet."""
    for opt in model.executor.optimizers.values():
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                    "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def rank_state(model: RankModel) -> dict:
    """``{"model": {name: tensor}, "optim": {name: {state: tensor}}}`` of this rank (tensors shared, not copied)."""
    names = _param_names(model)
    optim = {}
    for opt in model.executor.optimizers.values():
        for p, s in opt.state.items():
            optim[names[id(p)]] = {k: s[k] for k in ADAM_STATE if k in s}
    return {"model": {n: t.detach() for n, t in model.named.items()}, "optim": optim}


def save_training(directory: str | Path, step: int, model: RankModel, trainer_state: dict) -> Path:
    """Save the job after ``step`` (collective)."""
    ensure_optimizer_state(model)
    return save_state(directory, step, rank_state(model), trainer_state)


def load_training(directory: str | Path, model: RankModel, step: int | None = None) -> dict:
    """Load the newest (or ``step``'s) checkpoint into ``model`` in place; returns the trainer state."""
    ensure_optimizer_state(model)
    state = rank_state(model)
    with torch.no_grad():
        return load_state(directory, state, step)
