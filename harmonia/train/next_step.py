"""The next step prepared, and agreed on, during the step before.

Where a step's preparation runs in the training thread (on the CPU, `SchedulePrefetcher` with
``background=False``) and the job has more than one rank, a step prepares the next one between its
backward and its optimizer step instead of after it, once its actions have run and while its last
gradient reductions are in flight (`MLLMExecutor.loss_share`'s ``beside_reduction``: the host
works while gloo's threads reduce, where it waited for them):

- on a step whose figures are gathered (a logged one), the next step's agreement stays at its own
  start;
- on any other step, and where the loss and norm collective is the data group's (gloo), the next
  step's agreement (`IterationBuilder.settle`: failures, stop signals) carries this step's loss and
  norm shares as its ``extra``: one collective per step instead of two. Measured on 2 CPU processes
  with gloo (`benchmarks/peer.py`'s job), one such collective took 1.6-2 ms of a 15-20 ms step.

A stop signal that arrives after that agreement is heard at the next one, a step later than at the
step's start. An error of the preparation is raised at the next step's start, where it was raised
before; a rank whose preparation failed still joins the agreement it owes (with no failures of its
own), so no rank waits on it there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from harmonia.train.iteration import IterationBuilder, PreparedIteration
from harmonia.train.rank_data import StepAgreement


class NextStep:
    """Step ``step``, prepared (`prepare`) and possibly agreed on (`agree`) during the step before.

    Args:
        get: the prefetcher's ``get`` (prepares a step in this thread).
        step: the step to prepare.
    """

    def __init__(self, get: Callable[[int], PreparedIteration], step: int) -> None:
        self.get, self.step = get, step
        self.it: PreparedIteration | None = None
        self.error: Exception | None = None
        self.settled = False
        self.prepare_s = self.prepare_cpu_s = 0.0  # wall and CPU seconds `prepare` took

    def prepare(self) -> None:
        """Prepare the step now (an error is kept for `take`). Its CPU seconds are this thread's: the
        gradient reductions' threads working beside it stay in the step's."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            self.it = self.get(self.step)
        except Exception as err:  # noqa: BLE001 -- raised at its own step, where every rank meets it
            self.error = err
        self.prepare_s, self.prepare_cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0

    def agree(self, builder: IterationBuilder, agree: Callable[..., StepAgreement], stop: int,
              extra: torch.Tensor) -> torch.Tensor:
        """Settle the prepared step with every rank (collective), ``extra`` summed over the ranks in
        the same collective; returns the sum. Without a prepared step (its preparation failed), this
        rank's part of the agreement alone: no failures, its stop signal."""
        if self.it is None:
            return agree([], stop, None, extra).summed
        self.it = builder.settle(self.it, stop, None, extra)
        self.settled = True
        return self.it.summed

    def take(self) -> PreparedIteration:
        """The prepared step, at its start (raises its preparation's error)."""
        if self.error is not None:
            raise self.error
        return self.it
