"""When each compute action of an iteration ran, on the host's ``time.perf_counter`` clock.

On the CPU an action's work is done when its call returns, so the host clock around the call times it
(`ActionTimer` with no event class: exactly that). On a GPU the call returns once its kernels are
queued; the host clock would time the launches. There each action gets a pair of CUDA events on the
current stream, and one reference event recorded at the iteration's start is paired with a
``perf_counter`` stamp. Nothing is read while the actions run (no host sync per action); `resolve`
waits once, for the last event, and puts every pair on the host clock::

    start = ref_stamp + ref_event.elapsed_time(start_event) / 1000     (elapsed_time: milliseconds)
    end   = ref_stamp + ref_event.elapsed_time(end_event) / 1000

The pairing assumes the device reaches the reference event when the host records it: the device is
idle at an iteration's start (the step before ended with host reads of its loss and norm), so the
stamp and the event mark the same instant to within a launch. The CPU seconds of an action are the
host thread's (``time.thread_time``) on both: what launching it cost.

The results are ``(action, start, end, cpu_seconds)`` tuples appended to a list (the executor's
``action_times``), which the training loop reads after the step: its per-module times and bubble
(`harmonia.train.step_figures.step_times`), the calibration and the measured timeline.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class TimingEvent(Protocol):
    """What `ActionTimer` needs of an event (``torch.cuda.Event(enable_timing=True)``)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


class ActionTimer:
    """Times compute actions into ``out`` as ``(action, start, end, cpu_seconds)``.

    Args:
        out: the list the times are appended to (the executor's ``action_times``); None = time nothing.
        event: an event class (``enable_timing`` is passed) to time device work with; None = host clock
            (what `for_device` picks on anything but CUDA).
    """

    def __init__(self, out: list | None, event: type | None = None) -> None:
        self.out, self.event = out, event
        self._pending: list[tuple[Any, TimingEvent, TimingEvent, float]] = []
        self._ref: TimingEvent | None = None
        self._ref_stamp = 0.0
        if out is not None and event is not None:
            self._ref = event(enable_timing=True)
            self._ref.record()
            self._ref_stamp = time.perf_counter()

    @classmethod
    def for_device(cls, out: list | None, device: torch.device | str) -> ActionTimer:
        """CUDA events on a CUDA device, the host clock elsewhere."""
        return cls(out, torch.cuda.Event if torch.device(device).type == "cuda" else None)

    def start(self) -> tuple:
        """Mark an action's start; give what this returns to `stop`."""
        if self.event is None:
            return time.perf_counter(), time.thread_time()
        begin = self.event(enable_timing=True)
        begin.record()
        return begin, time.thread_time()

    def stop(self, action: Any, mark: tuple) -> None:
        """Mark the end of the action `start` returned ``mark`` for."""
        if self.event is None:
            start, cpu = mark
            self.out.append((action, start, time.perf_counter(), time.thread_time() - cpu))
            return
        end = self.event(enable_timing=True)
        end.record()
        begin, cpu = mark
        self._pending.append((action, begin, end, time.thread_time() - cpu))

    def resolve(self) -> None:
        """Put the device-timed actions on the host clock and append them to ``out`` (one wait, for
        the last event; nothing to do on the host clock, whose actions are appended as they end)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        ref, stamp = self._ref, self._ref_stamp
        for action, begin, end, cpu in self._pending:
            self.out.append((action, stamp + ref.elapsed_time(begin) / 1000, stamp + ref.elapsed_time(end) / 1000, cpu))
        self._pending.clear()
