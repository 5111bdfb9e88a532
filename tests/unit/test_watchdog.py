"""Heartbeats through a real store: a rank whose beats stop is named; stop signals are recorded."""

import datetime
import os
import signal
import time

import torch.distributed as dist

from harmonia.runtime import watchdog
from harmonia.runtime.watchdog import HangDetector, Heartbeat, StopSignals, process_state


def test_a_rank_whose_heartbeat_stops_is_named() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    beats = [Heartbeat(server, r, 2, hang_timeout=1.0) for r in range(2)]
    for beat in beats:
        beat.interval = 0.1
        beat.__enter__()
    detector = HangDetector(server, 2, hang_timeout=1.0, startup_s=0.0)
    beats[1].progress(3)
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        assert detector.poll() is None
        time.sleep(0.1)
    beats[1].__exit__()  # rank 1 goes silent
    deadline, hung = time.monotonic() + 5, None
    while hung is None and time.monotonic() < deadline:
        hung = detector.poll()
        time.sleep(0.1)
    beats[0].__exit__()
    assert hung is not None and hung[0] == 1
    assert hung[1].startswith("rank 1 stopped responding: no heartbeat for 1 s")
    assert "its last finished step was 3" in hung[1]


def test_quick_steps_reach_the_store_with_the_next_beat(monkeypatch) -> None:
    """Steps finished within `STEP_WRITE_S` of the last write wait for the beat, not a round trip each."""
    monkeypatch.setattr(watchdog, "STEP_WRITE_S", 60.0)  # every step after the first is a quick one
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    beat = Heartbeat(server, 0, 1, hang_timeout=10.0)
    stored = lambda: int(server.add("harmonia/heartbeat/0/step/0", 0))  # noqa: E731
    beat.progress(1)  # the first write goes at once
    assert stored() == 1
    for step in range(2, 50):
        beat.progress(step)
    assert stored() == 1  # the quick ones are held back
    beat.interval = 0.1
    beat.__enter__()
    deadline = time.monotonic() + 5
    while stored() != 49 and time.monotonic() < deadline:
        time.sleep(0.05)
    beat.__exit__()
    assert stored() == 49  # and the newest reaches the store with a beat


def test_a_stall_names_what_each_rank_waits_for(caplog) -> None:
    """Every rank beats but no step ends: the warning says which message each rank waits on."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    waits = {0: "receive llm.s0 -> llm.s1 activation of microbatch 3 from rank 1",
             1: "receive llm.s1 -> llm.s0 gradient of microbatch 2 from rank 0"}
    beats = [Heartbeat(server, r, 2, hang_timeout=0.5) for r in range(2)]
    for r, beat in enumerate(beats):
        beat.interval, beat.status = 0.05, (lambda r=r: waits[r])
        beat.progress(1)
        beat.__enter__()
    detector = HangDetector(server, 2, hang_timeout=0.5, startup_s=0.0)
    deadline = time.monotonic() + 5
    with caplog.at_level("WARNING", logger=watchdog.__name__):
        while not detector.warned_stall and time.monotonic() < deadline:
            assert detector.poll() is None  # alive: beats go on
            time.sleep(0.05)
    for beat in beats:
        beat.__exit__()
    assert detector.warned_stall
    assert f"rank 0 waits to {waits[0]}" in caplog.text and f"rank 1 waits to {waits[1]}" in caplog.text


def test_stop_signals_are_recorded_not_fatal() -> None:
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        stops = StopSignals.install()
        assert StopSignals.install() is stops
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stops.signum == signal.SIGHUP
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert process_state(os.getpid()) in ("R", "S")
