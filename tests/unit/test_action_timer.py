"""`ActionTimer`: CUDA events put on the host clock with one wait per iteration; the host clock on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from harmonia.runtime import action_timer
from harmonia.runtime.action_timer import ActionTimer


class FakeEvent:
    """A CUDA event on a fake device clock (ms): `record` stamps the clock's current time."""

    clock_ms = 0.0
    waits: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = FakeEvent.clock_ms

    def synchronize(self) -> None:
        FakeEvent.waits.append(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "both events must be recorded"
        return end.at - self.at


@pytest.fixture
def clocks(monkeypatch):
    """Deterministic host clocks: perf_counter 100.0, 100.5, ...; thread_time 1.0, 1.25, ..."""
    perf, cpu = itertools.count(), itertools.count()
    monkeypatch.setattr(action_timer.time, "perf_counter", lambda: 100.0 + 0.5 * next(perf))
    monkeypatch.setattr(action_timer.time, "thread_time", lambda: 1.0 + 0.25 * next(cpu))
    FakeEvent.clock_ms, FakeEvent.waits = 0.0, []


def test_device_events_resolve_onto_the_host_clock_with_one_wait(clocks) -> None:
    out: list = []
    FakeEvent.clock_ms = 7.0  # the reference event, stamped at perf_counter 100.0
    timer = ActionTimer(out, FakeEvent)
    spans = {"F0": (10.0, 35.0), "BW0": (40.0, 90.0), "F1": (90.0, 91.5)}  # device ms of each action
    for name, (a, b) in spans.items():
        FakeEvent.clock_ms = a
        mark = timer.start()
        FakeEvent.clock_ms = b
        timer.stop(name, mark)
    assert out == [] and FakeEvent.waits == []  # nothing read while the actions run
    timer.resolve()
    assert len(FakeEvent.waits) == 1 and FakeEvent.waits[0].at == 91.5  # the last action's end event
    assert [a for a, *_ in out] == list(spans)
    for (_, start, end, cpu), (a, b) in zip(out, spans.values()):
        assert start == pytest.approx(100.0 + (a - 7.0) / 1000) and end == pytest.approx(100.0 + (b - 7.0) / 1000)
        assert cpu == 0.25  # the host thread's seconds between start and stop
    timer.resolve()  # nothing pending: no second wait, nothing appended twice
    assert len(out) == 3 and len(FakeEvent.waits) == 1


def test_the_host_clock_times_as_the_executor_always_did(clocks) -> None:
    out: list = []
    timer = ActionTimer.for_device(out, "cpu")
    assert timer.event is None
    mark = timer.start()  # perf_counter 100.0, thread_time 1.0
    timer.stop("F0", mark)  # perf_counter 100.5, thread_time 1.25
    assert out == [("F0", 100.0, 100.5, 0.25)]
    timer.resolve()
    assert out == [("F0", 100.0, 100.5, 0.25)]


def test_cuda_devices_get_cuda_events_and_an_untimed_iteration_records_none() -> None:
    timer = ActionTimer.for_device(None, torch.device("cuda", 0))  # builds no event: runs without CUDA
    assert timer.event is torch.cuda.Event and timer._ref is None
    timer.resolve()
