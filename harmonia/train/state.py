"""Checkpoints of a training job: every rank's named parameters and optimizer states, by whole-model name.

Frozen tensors an HF source gives are left out of both (`harmonia.train.source_state`). Keys are
whole-model names, never stage or rank positions, so a checkpoint written under one plan
loads under any other (another DP degree, other stage boundaries, FSDP on or off): distributed
checkpoint gives each rank exactly the slices it now holds. Optimizer states (AdamW's ``step``,
``exp_avg``, ``exp_avg_sq``) are created before loading so there is a tensor to load into.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from harmonia.errors import HarmoniaError
from harmonia.model.dtensors import is_dtensor
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


def rank_state(model: RankModel, omit: frozenset[str] = frozenset()) -> dict:
    """``{"model": {name: tensor}, "optim": {name: {state: tensor}}}`` of this rank (tensors shared, not
    copied), without the ``omit`` names (frozen tensors the source gives: `harmonia.train.source_state`)."""
    names = _param_names(model)
    optim = {}
    for opt in model.executor.optimizers.values():
        for p, s in opt.state.items():
            optim[names[id(p)]] = {k: s[k] for k in ADAM_STATE if k in s}
    return {"model": {n: t.detach() for n, t in model.named.items() if n not in omit}, "optim": optim}


class NonFiniteWeights(HarmoniaError):
    """A parameter holds inf or NaN; the job stops instead of saving it."""

    exit_code = 1


def first_nonfinite(named: dict[str, torch.Tensor]) -> str | None:
    """The name of the first tensor of ``named`` (this rank's part of it) with an inf or NaN, else None."""
    for name, t in named.items():
        local = t.to_local() if is_dtensor(t) else t
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return name
    return None


def check_finite_weights(model: RankModel, step: int) -> None:
    """Raise `NonFiniteWeights` on every rank when any rank holds a non-finite parameter (collective)."""
    bad = first_nonfinite(model.named)
    flag = torch.tensor([0.0 if bad is None else 1.0], device=next(iter(model.named.values())).device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        where = f"{bad} on rank {dist.get_rank() if dist.is_initialized() else 0}" if bad else "on another rank"
        raise NonFiniteWeights(f"the weights are not finite after step {step - 1}'s update ({where}); checkpoint "
                               f"step-{step} was not saved, so every checkpoint holds finite weights; lower "
                               "train.lr (or raise train.warmup) and resume")


def save_training(directory: str | Path, step: int, model: RankModel, trainer_state: dict, keep: int = 0,
                  before_commit: Callable[[], None] | None = None, omit: frozenset[str] = frozenset()) -> Path:
    """Save the job after ``step`` (collective), refusing non-finite weights; keep the newest ``keep``.
    The ``omit`` tensors (frozen, given by the source) are not written."""
    check_finite_weights(model, step)
    ensure_optimizer_state(model)
    return save_state(directory, step, rank_state(model, omit), trainer_state, keep=keep,
                      before_commit=before_commit)


def load_training(directory: str | Path, model: RankModel, step: int | None = None,
                  omit: frozenset[str] = frozenset()) -> dict:
    """Load the newest (or ``step``'s) checkpoint into ``model`` in place; returns the trainer state.
    The ``omit`` tensors keep the values the rank built them with (from the source)."""
    ensure_optimizer_state(model)
    state = rank_state(model, omit)
    with torch.no_grad():
        return load_state(directory, state, step)
