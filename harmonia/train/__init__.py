# The trainer: plan, data, launch, per-rank loop, checkpoints, reports (`harmonia train`).
# Its entry points load on first use: `harmonia plan` reads `harmonia.train.backend` without the
# trainer's imports (torch, transformers).
from __future__ import annotations

import importlib

_EXPORTS = {"TrainResult": "harmonia.train.job", "run_training": "harmonia.train.job",
            "Trainer": "harmonia.train.loop", "TrainingError": "harmonia.train.loop",
            "train_worker": "harmonia.train.worker"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
