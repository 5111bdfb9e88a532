"""Faults injected on purpose, to exercise what harmonia does when things fail.

``HARMONIA_FAULT`` holds comma-separated ``<kind>:<rank>:<step>`` entries; each makes that rank
fail at that step:

| kind      | what happens                                                                 |
| --------- | ---------------------------------------------------------------------------- |
| `raise`   | an exception at the start of the step                                        |
| `kill`    | the rank dies by SIGKILL at the start of the step                            |
| `term`    | the rank receives SIGTERM at the start of the step (as from outside)         |
| `stop`    | the rank stops itself with SIGSTOP at the start of the step (a hang)         |
| `nan`     | a weight becomes NaN before the step, so its loss is NaN                     |
| `nangrad` | a gradient becomes NaN after the step's backward (one non-finite update)     |
| `save`    | the rank dies by SIGKILL inside the save of checkpoint ``step``, files written |

Faults fire on a job's first attempt only (`harmonia.runtime.attempt.current_attempt` 0), so a
restarted job gets past them.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

from harmonia.errors import ConfigError
from harmonia.runtime.attempt import current_attempt
from harmonia.train.rank import RankModel

FAULT_ENV = "HARMONIA_FAULT"
KINDS = ("raise", "kill", "term", "stop", "nan", "nangrad", "save")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse_faults(spec: str) -> list[Fault]:
    """The faults of a ``HARMONIA_FAULT`` value."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ConfigError(f"{FAULT_ENV} entry {entry!r} is invalid: expected <kind>:<rank>:<step> with kind one "
                              f"of {KINDS}")
        faults.append(Fault(parts[0], int(parts[1]), int(parts[2])))
    return faults


class Faults:
    """This rank's faults from the environment (none on a restarted attempt)."""

    def __init__(self, rank: int) -> None:
        restarted = current_attempt() > 0
        self.rank = rank
        self.faults = [] if restarted else [f for f in parse_faults(os.environ.get(FAULT_ENV, "")) if f.rank == rank]

    def _due(self, kinds: tuple[str, ...], step: int) -> list[str]:
        return [f.kind for f in self.faults if f.kind in kinds and f.step == step]

    def before_step(self, step: int, model: RankModel) -> None:
        for kind in self._due(("raise", "kill", "term", "stop", "nan"), step):
            if kind == "raise":
                raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            if kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if kind == "nan":
                with torch.no_grad():
                    next(iter((model.trainable_named() or model.named).values())).fill_(float("nan"))

    def after_backward(self, step: int, model: RankModel) -> None:
        if self._due(("nangrad",), step):
            grads = [p.grad for p in model.trainable_named().values() if p.grad is not None]
            if grads:
                with torch.no_grad():
                    grads[0].fill_(float("nan"))

    def inside_save(self, step: int) -> None:
        if self._due(("save",), step):
            os.kill(os.getpid(), signal.SIGKILL)
