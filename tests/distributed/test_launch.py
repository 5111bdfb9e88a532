"""The local launcher: success, a rank that raises, a rank that is killed, a hang."""

import os
import signal
import time

import pytest

from harmonia.launch import LaunchError, launch


def _ok(path: str) -> None:
    with open(f"{path}.{os.environ['RANK']}", "w") as f:
        f.write(os.environ["WORLD_SIZE"])


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


@pytest.mark.distributed
def test_launcher(tmp_path) -> None:
    launch(_ok, 3, (str(tmp_path / "rank"),), timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.0", "rank.1", "rank.2"]

    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: sample 17 has a corrupt image"):
        launch(_raises_on_rank_1, 3, timeout=60)
    with pytest.raises(LaunchError, match=r"rank 2 failed: process ended with signal SIGKILL"):
        launch(_killed_on_rank_2, 3, timeout=60)
    with pytest.raises(LaunchError, match=r"still running after 2 s"):
        launch(_hangs, 2, timeout=2)
    assert time.monotonic() - t0 < 45  # every failure ends all ranks quickly
