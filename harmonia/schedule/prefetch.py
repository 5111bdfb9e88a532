"""Prepare the next iterations' schedules in the background, one (or more) steps ahead.

The trainer asks for step ``k``'s schedule while step ``k - 1`` runs. A worker thread computes
``prepare(k)`` (balancing, per-batch schedule search) as soon as ``k`` is within ``depth`` of the
step being consumed, so by the time the trainer asks, the result is usually waiting. The prefetcher
records how long each preparation took and how long the trainer actually waited, so the run can
log how much of the scheduling time was hidden. An exception in ``prepare`` is raised to the caller
of `get` for that step, never swallowed.

The work is numpy- and Python-bound and releases the GIL only partly; it overlaps well with a
training step that spends its time waiting on an accelerator or communication. A CPU step is
itself a stream of small GIL-holding calls on the same cores: measured on 2 cores with the tiny
LLaVA (`benchmarks/peer.py`'s job, 8 samples per step), the preparation in the background made the
training's own compute 1.6x slower (LLM forward and backward 42 ms vs 26 ms per step) and hid less
than that (the step with preparation inline: 33 + 19 ms, in the background: 56 ms), so there
``background=False`` prepares each step in the consumer's thread when it asks for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class PrefetchStats:
    """Seconds spent preparing schedules and seconds the consumer waited for them."""

    prepared_s: float = 0.0
    waited_s: float = 0.0
    steps: int = 0
    per_step: list[tuple[int, float, float]] = field(default_factory=list)  # (step, prepare s, wait s)

    @property
    def hidden_frac(self) -> float:
        """Share of the preparation time that overlapped other work."""
        return 1.0 - self.waited_s / self.prepared_s if self.prepared_s > 0 else 1.0


class SchedulePrefetcher(Generic[T]):
    """Runs ``prepare(step)`` in a background thread, up to ``depth`` steps ahead.

    Args:
        prepare: builds the schedule (or any per-step plan) of a step.
        first_step: the first step that will be requested.
        last_step: the last step (exclusive); None = unbounded.
        depth: how many steps ahead of the consumer to prepare.
        background: prepare in a worker thread; False = in the consumer's thread, in `get`
            (nothing hidden).
    """

    def __init__(self, prepare: Callable[[int], T], first_step: int = 0, last_step: int | None = None,
                 depth: int = 1, background: bool = True) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        self.background = background
        self._prepare = prepare
        self._next = first_step
        self._last = last_step
        self._depth = depth
        self._consumed = first_step
        self._results: dict[int, tuple[T | None, BaseException | None, float]] = {}
        self._cond = threading.Condition()
        self._stop = False
        self.stats = PrefetchStats()
        self._thread = threading.Thread(target=self._run, name="harmonia-schedule-prefetch", daemon=True)
        if background:
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._next >= self._consumed + self._depth + 1
                                          or (self._last is not None and self._next >= self._last)):
                    self._cond.wait()
                if self._stop:
                    return
                step = self._next
                self._next += 1
            t0 = time.perf_counter()
            try:
                result, error = self._prepare(step), None
            except BaseException as err:  # handed to the consumer of this step
                result, error = None, err
            with self._cond:
                self._results[step] = (result, error, time.perf_counter() - t0)
                self._cond.notify_all()

    def get(self, step: int) -> T:
        """The prepared result of ``step`` (waits if it is not ready; re-raises its error)."""
        t0 = time.perf_counter()
        if not self.background:
            return self._inline(step, t0)
        with self._cond:
            if step != self._consumed:
                raise ValueError(f"steps are consumed in order: expected {self._consumed}, got {step}")
            while step not in self._results:
                self._cond.wait()
            result, error, took = self._results.pop(step)
            self._consumed = step + 1
            self._cond.notify_all()
        self._record(step, took, time.perf_counter() - t0)
        if error is not None:
            raise error
        return result

    def _inline(self, step: int, t0: float) -> T:
        if step != self._consumed:
            raise ValueError(f"steps are consumed in order: expected {self._consumed}, got {step}")
        self._consumed = step + 1
        try:
            return self._prepare(step)
        finally:
            took = time.perf_counter() - t0
            self._record(step, took, took)

    def _record(self, step: int, took: float, waited: float) -> None:
        self.stats.prepared_s += took
        self.stats.waited_s += min(waited, took)
        self.stats.steps += 1
        self.stats.per_step.append((step, took, waited))

    def close(self) -> None:
        """Stop the worker (pending preparations are dropped)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self.background:
            self._thread.join(timeout=5.0)

    def __enter__(self) -> SchedulePrefetcher[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
