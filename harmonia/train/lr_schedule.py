"""Learning-rate schedules: the lr of a step as a pure function of the step and the schedule.

Every schedule warms up linearly over ``warmup`` steps, then follows its shape (``train.lr_schedule``),
with ``r = min_ratio`` and ``p`` the step's progress through the decay (`decay_progress`)::

    cosine    peak * (r + (1 - r) * (1 + cos(pi * p)) / 2)   p over the steps after the warm-up
    linear    peak * (r + (1 - r) * (1 - p))                 p over the steps after the warm-up
    constant  peak
    wsd       peak (stable), then linear as above             p over the job's last decay_steps

A schedule is independent of its peak: each module's lr is the schedule at that module's own peak
(``train.lr``, or its ``train.modules`` entry), so the ratio of two modules' lrs is the same at
every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harmonia.config import LR_SCHEDULES


def warmup_lr(peak: float, step: int, warmup: int) -> float:
    """The lr of warm-up step ``step < warmup``: ``peak * (step + 1) / warmup``.

    Step 0 trains at ``peak / warmup`` (never at 0, which would waste a step) and step
    ``warmup - 1`` at the peak itself.
    """
    return peak * (step + 1) / warmup


def decay_progress(step: int, start: int, steps: int) -> float:
    """How far ``step`` is into a decay from step ``start`` to the job's end: ``(step - start) / (steps - start)``.

    0 at ``start``; the last step (``steps - 1``) is at ``1 - 1 / (steps - start)``, so the minimum
    is what the schedule reaches one step past the job's end, and the last step trains just above
    it. A decay of no steps (``start == steps``) divides by 1.
    """
    return (step - start) / max(1, steps - start)


def cosine_lr(peak: float, progress: float, min_ratio: float) -> float:
    """Half a cosine from the peak down to ``min_ratio x peak``:
    ``peak * (r + (1 - r) * (1 + cos(pi * progress)) / 2)`` with ``r = min_ratio``."""
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def linear_lr(peak: float, progress: float, min_ratio: float) -> float:
    """A straight line from the peak down to ``min_ratio x peak``: ``peak * (r + (1 - r) * (1 - progress))``."""
    return peak * (min_ratio + (1 - min_ratio) * (1 - progress))


@dataclass(frozen=True)
class LRSchedule:
    """The shape of the learning rate over a job, for any peak.

    Attributes:
        kind: ``cosine``, ``linear``, ``constant`` or ``wsd`` (`LR_SCHEDULES`).
        steps: the job's optimizer steps.
        warmup: linear warm-up steps, ``0..steps``.
        min_ratio: where ``cosine``, ``linear`` and ``wsd`` decay to, as a fraction of the peak.
        decay_steps: ``wsd``'s decay: the job's last ``decay_steps`` steps (after the warm-up
            when the two would overlap); the steps between warm-up and decay hold the peak.
    """

    kind: str = "cosine"
    steps: int = 1
    warmup: int = 0
    min_ratio: float = 0.1
    decay_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"learning-rate schedule {self.kind!r}: expected one of {LR_SCHEDULES}")

    @property
    def decay_start(self) -> int:
        """The first step of the decay: the end of the warm-up, or for ``wsd`` the end of the stable phase."""
        if self.kind == "wsd":
            return max(self.warmup, self.steps - self.decay_steps)
        return self.warmup

    def lr(self, peak: float, step: int) -> float:
        """The lr of ``step`` (0-based) for a module whose peak lr is ``peak``."""
        if step < self.warmup:
            return warmup_lr(peak, step, self.warmup)
        if self.kind == "constant" or step < self.decay_start:
            return peak
        progress = decay_progress(step, self.decay_start, self.steps)
        if self.kind == "cosine":
            return cosine_lr(peak, progress, self.min_ratio)
        return linear_lr(peak, progress, self.min_ratio)
