"""One job per directory: a lock file that names its holder.

`DirectoryLock` takes an exclusive ``flock`` on ``<dir>/harmonia.lock`` and writes the holder's pid,
host and start time into it. The kernel drops the lock when the holder dies, so a lock left by a
dead job is taken over (and said so); a live holder is named in the refusal. A process the dead
holder forked keeps its lock alive (the lock belongs to the open file, which a fork shares): where
``/proc/locks`` says that every process that placed the lock is gone, the lock file is replaced and
taken over too (a torchrun restart finds its killed rank 0's lock so while that rank's workers
exit). Where the file system has no ``flock``, the pid and host in the file decide instead (a dead
pid on this host is stale).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from harmonia.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = "harmonia.lock"


class DirectoryLocked(ConfigError):
    """Another live job holds the directory's lock."""


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lock_owners(path: Path) -> set[int] | None:
    """The pids that placed the ``flock`` locks on ``path``'s file, from ``/proc/locks`` (None where it
    cannot be read). A lock stays listed under the pid that placed it, also once that process is dead
    and a process it forked holds the lock."""
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    owners = set()
    for line in table.splitlines():  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; "->" marks a waiter
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            owners.add(int(fields[4]))
    return owners


class DirectoryLock:
    """An exclusive lock on a directory for the lifetime of a job; a context manager.

    Args:
        directory: the directory (created if missing).
        what: how messages name it, e.g. ``checkpoint.dir``.
    """

    def __init__(self, directory: str | Path, what: str = "directory") -> None:
        self.directory, self.what = Path(directory), what
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self.took_over: dict | None = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _refuse(self, holder: dict) -> None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
        raise DirectoryLocked(
            f"{self.what} {self.directory} is in use by another harmonia job (pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')}, since {since}); wait for it to end, or give this job another {self.what}")

    def acquire(self) -> None:
        """Take the lock or raise `DirectoryLocked` naming the holder."""
        self.directory.mkdir(parents=True, exist_ok=True)
        stale: dict | None = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                owners = _lock_owners(self.path)
                if not owners or any(pid_alive(pid) for pid in owners):
                    self._refuse(self._holder())
                stale = stale or self._holder()  # its holder is dead; what it forked holds the old file
                self.path.unlink(missing_ok=True)
                continue
            except OSError as err:  # no flock on this file system: the pid in the file decides
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                holder = self._holder()
                if holder.get("host") == socket.gethostname() and pid_alive(int(holder.get("pid", 0))) \
                        and holder.get("pid") != os.getpid():
                    os.close(fd)
                    self._refuse(holder)
            try:  # the file we locked may have been removed by a holder that just released it
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        previous = self._holder() or stale or {}
        if previous.get("pid") and previous.get("pid") != os.getpid():
            self.took_over = previous
            log.warning("%s %s: took over the lock of pid %s on host %s, which is no longer running", self.what,
                        self.directory, previous.get("pid"), previous.get("host"))
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        os.fsync(fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None
