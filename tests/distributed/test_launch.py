"""The local launcher: success, a rank that raises, a rank that is killed, a time limit, a hang, signals."""

import os
import signal
import threading
import time

import pytest

from harmonia.launch import JobStopped, LaunchError, launch


def _ok(path: str) -> str:
    import gc

    with open(f"{path}.{os.environ['RANK']}", "w") as f:  # the fork server's imports frozen, the collector on
        f.write(f"{os.environ['WORLD_SIZE']} {gc.isenabled()} {gc.get_freeze_count() > 100_000}")
    return f"rank {os.environ['RANK']} done"


def _raises_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("sample 17 has a corrupt image")
    time.sleep(60)  # the others would wait forever in a collective


def _killed_on_rank_2() -> None:
    if os.environ["RANK"] == "2":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _hangs() -> None:
    time.sleep(60)


def _stops_rank_1() -> None:
    from harmonia.runtime.watchdog import Heartbeat, connect_store

    store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    with Heartbeat(store, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), hang_timeout=3) as beat:
        beat.progress(1)
        time.sleep(1.5)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)


@pytest.mark.distributed
def test_launcher(tmp_path) -> None:
    assert launch(_ok, 3, (str(tmp_path / "rank"),), timeout=60) == "rank 0 done"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.0", "rank.1", "rank.2"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"3 True True"}

    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: sample 17 has a corrupt image"):
        launch(_raises_on_rank_1, 3, timeout=60)
    with pytest.raises(LaunchError, match=r"rank 2 was killed by SIGKILL"):
        launch(_killed_on_rank_2, 3, timeout=60)
    with pytest.raises(JobStopped, match=r"ran past its time limit \(parallel.timeout_s=2\)") as stopped:
        launch(_hangs, 2, timeout=2)
    assert stopped.value.exit_code == 124
    assert time.monotonic() - t0 < 45  # every failure ends all ranks quickly


@pytest.mark.distributed
def test_launcher_names_a_stopped_rank_and_forwards_signals() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 stopped responding: no heartbeat for \d+ s \(its process is "
                                          r"stopped \(SIGSTOP\?\)"):
        launch(_stops_rank_1, 2, timeout=60, hang_timeout=3)
    assert time.monotonic() - t0 < 40

    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(JobStopped, match=r"stopped by SIGTERM") as stopped:
            launch(_hangs, 2, timeout=60)
    finally:
        timer.cancel()
    assert stopped.value.exit_code == 128 + signal.SIGTERM
