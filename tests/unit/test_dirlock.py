"""The checkpoint directory's lock when its holder died but a process it forked still holds the file."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harmonia.runtime.dirlock import DirectoryLock, DirectoryLocked

HOLDER = """
import os, sys, time
from harmonia.runtime.dirlock import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
child = os.fork()  # shares the locked file, as a rank's forked decode workers do
if child == 0:
    time.sleep(60)
    os._exit(0)
open(sys.argv[2], "w").write(str(child))
os._exit(0)  # the holder dies without releasing
"""


@pytest.mark.skipif(not Path("/proc/locks").is_file(), reason="needs /proc/locks (Linux)")
def test_a_lock_kept_by_what_a_dead_holder_forked_is_taken_over(tmp_path) -> None:
    pid_file = tmp_path / "forked.pid"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "ck"), str(pid_file)],
                              stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
    assert holder.wait(timeout=60) == 0
    forked = int(pid_file.read_text())
    try:
        with pytest.raises(BlockingIOError):  # the lock is still held, by the forked process
            fd = os.open(tmp_path / "ck" / "harmonia.lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        with DirectoryLock(tmp_path / "ck") as lock:
            assert lock.took_over is not None and lock.took_over["pid"] == holder.pid
            with pytest.raises(DirectoryLocked, match=rf"in use by another harmonia job \(pid {os.getpid()} "):
                DirectoryLock(tmp_path / "ck").acquire()  # a live holder is never taken over
    finally:
        os.kill(forked, signal.SIGKILL)
