"""What keeps a job from hanging or outliving its launcher: stop signals, parent death, heartbeats.

- `StopSignals`: SIGTERM, SIGINT and SIGHUP ask a rank to stop at the next step boundary instead
  of killing it mid-step (the training loop votes on it, so every rank stops at the same step).
- `exit_with_parent`: a rank gets SIGTERM when the process that started it (or the fork server it
  forked from) dies (Linux ``prctl(PR_SET_PDEATHSIG)``), and a thread polling ``os.getppid()`` does
  the same everywhere, then ends the process if it has not stopped within a grace period.
- `Heartbeat` and `HangDetector`: every rank counts beats (and finished steps) in the job's
  rendezvous store from a thread; a rank whose count stops moving for ``hang_timeout`` seconds is
  stopped, frozen or stuck outside Python, and is named. The local launcher runs the detector; under
  torchrun each rank runs it while it waits, and ends a hung peer on its own host (which would
  otherwise ignore the agent's SIGTERM).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from harmonia.errors import HarmoniaError
from harmonia.runtime.dirlock import pid_alive

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
HEARTBEAT_PREFIX = "harmonia/heartbeat"
STEP_WRITE_S = 0.05  # a rank's finished steps go to the store at most this often; the rest with the next beat


class StopRequested(HarmoniaError):
    """The job stopped because a stop signal arrived; ``signum`` is that signal, ``exit_code`` what the
    command returns (128 + the signal, as a shell reports a process ended by it)."""

    def __init__(self, message: str, signum: int, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum if exit_code is None else exit_code


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """Handlers of SIGTERM / SIGINT / SIGHUP that record the first signal instead of dying.

    ``raise_now`` makes a signal raise `StopRequested` in the main thread at once (for code that
    never looks at ``signum``, such as a rank still starting up).
    """

    def __init__(self, raise_now: bool = False) -> None:
        self.signum = 0
        self.raise_now = raise_now

    def _handle(self, signum: int, frame) -> None:
        self.signum = self.signum or signum
        if self.raise_now:
            self.raise_now = False  # one exception; a repeated signal must not interrupt its handling
            raise StopRequested(f"stopped by {signal_name(signum)} before training started", signum)

    @classmethod
    def install(cls, raise_now: bool = False) -> StopSignals:
        """Handle the stop signals in this process (main thread only); reuses the installed handler."""
        current = signal.getsignal(signal.SIGTERM)
        handler = getattr(current, "__self__", None)
        if isinstance(handler, cls):
            handler.raise_now = raise_now
            return handler
        stops = cls(raise_now)
        for sig in STOP_SIGNALS:
            signal.signal(sig, stops._handle)
        return stops


def exit_with_parent(parent_pid: int, grace_s: float = 60.0, poll_s: float = 1.0) -> None:
    """Make this process stop when ``parent_pid`` (its launcher) dies.

    This process's parent is ``parent_pid`` or a fork server that process started, which exits
    with it (`harmonia.launch`). The kernel sends SIGTERM at that parent's death on Linux; a daemon
    thread polls ``os.getppid()`` everywhere, sends SIGTERM itself if needed, and ends the process
    ``grace_s`` seconds later if the graceful stop (a step boundary, a checkpoint) has not ended it.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the polling thread alone
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("the launcher (pid %d) is gone: stopping this rank", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="harmonia-parent-watch", daemon=True).start()
    if parent != parent_pid and not pid_alive(parent_pid):  # the launcher died before the watch began
        os.kill(os.getpid(), signal.SIGTERM)


def beat_interval(hang_timeout: float) -> float:
    """Seconds between heartbeats: a tenth of the hang timeout, within 0.5..5 s."""
    return min(5.0, max(0.5, hang_timeout / 10))


def _key(attempt: str, what: str, rank: int) -> str:
    return f"{HEARTBEAT_PREFIX}/{attempt}/{what}/{rank}"


def connect_store(host: str, port: int, timeout_s: float = 30.0):
    """A client of the job's rendezvous store (its own connection, so beats never wait on others)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class _Seen:
    value: int = -1
    changed: float = field(default_factory=time.monotonic)


class HangDetector:
    """Names the rank whose heartbeat stopped moving, from the rendezvous store.

    Args:
        store: a client of the job's store.
        world: ranks of the job.
        hang_timeout: seconds without a beat after which a rank is hung.
        attempt: the restart attempt whose keys are read.
        startup_s: extra seconds a rank has for its first beat (process start, imports).
    """

    def __init__(self, store, world: int, hang_timeout: float, attempt: str = "0", startup_s: float = 120.0,
                 pids: dict[int, int] | None = None) -> None:
        self.store, self.world, self.hang_timeout, self.attempt = store, world, hang_timeout, attempt
        self.startup_s, self.pids = startup_s, pids or {}
        self.beats = {r: _Seen() for r in range(world)}
        self.steps = {r: _Seen() for r in range(world)}
        self.warned_stall = False

    def _read(self, what: str, rank: int) -> int:
        return int(self.store.add(_key(self.attempt, what, rank), 0))

    def poll(self) -> tuple[int, str] | None:
        """Read every rank's beats; (rank, why) for the first hung rank, else None."""
        now = time.monotonic()
        for r in range(self.world):
            for seen, what in ((self.beats[r], "beat"), (self.steps[r], "step")):
                value = self._read(what, r)
                if value != seen.value:
                    seen.value, seen.changed = value, now
        for r, seen in self.beats.items():
            allowed = self.hang_timeout + (self.startup_s if seen.value <= 0 else 0.0)
            if now - seen.changed > allowed:
                return r, self._describe(r, now - seen.changed, started=seen.value > 0)
        self._warn_stall(now)
        return None

    def local_pid(self, rank: int) -> int | None:
        """The pid of ``rank`` when it runs on this host (its heartbeat published it), else None."""
        if rank in self.pids:
            return self.pids[rank]
        key = _key(self.attempt, "proc", rank)
        try:
            if not self.store.check([key]):
                return None
            host, pid = self.store.get(key).decode().split()
        except Exception:  # noqa: BLE001 -- no pid to offer
            return None
        return int(pid) if host == socket.gethostname() else None

    def _describe(self, rank: int, silent_s: float, started: bool) -> str:
        state = process_state(self.local_pid(rank))
        why = ("its process is stopped (SIGSTOP?)" if state in ("T", "t") else
               "stopped, frozen or stuck outside Python")
        what = "no heartbeat" if started else "no first heartbeat"
        return (f"rank {rank} stopped responding: {what} for {silent_s:.0f} s ({why}; parallel.hang_timeout_s="
                f"{self.hang_timeout:g}); its last finished step was {max(self.steps[rank].value, 0)}")

    def _warn_stall(self, now: float) -> None:
        """Every rank beats but none finished a step for the hang timeout: say so once per stall."""
        if max(s.value for s in self.steps.values()) <= 0:
            return
        stalled = now - max(s.changed for s in self.steps.values())
        if stalled <= self.hang_timeout:
            self.warned_stall = False
            return
        if not self.warned_stall:
            self.warned_stall = True
            at = {r: s.value for r, s in self.steps.items()}
            waits = "".join(f"\n  rank {r} waits to {w}" for r in range(self.world) if (w := self._wait_of(r)))
            log.warning("no rank finished a step for %.0f s although every rank is alive (finished steps by rank: "
                        "%s); waiting; a collective gives up after parallel.collective_timeout_s%s", stalled, at, waits)

    def _wait_of(self, rank: int) -> str:
        """What ``rank`` last said it waits for (`Heartbeat.status`), or ""."""
        key = _key(self.attempt, "wait", rank)
        try:
            return self.store.get(key).decode() if self.store.check([key]) else ""
        except Exception:  # noqa: BLE001 -- a report without it
            return ""


def process_state(pid: int | None) -> str | None:
    """The one-letter state of a local process (``R``, ``S``, ``T`` = stopped, ...), where /proc has it."""
    if pid is None:
        return None
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[0]


class Heartbeat:
    """A rank's beats and finished steps in the store, from a daemon thread; a context manager.

    Args:
        store: a client of the job's store (`connect_store`).
        rank, world: this rank and the job's size.
        hang_timeout: seconds without a beat after which a rank is hung.
        attempt: the restart attempt every rank agreed on (`harmonia.runtime.attempt.agree_attempt`).
        detect: also watch the others while this rank waits (under torchrun, where no launcher does);
            a hung peer is printed and this process exits with code 1, so torchrun ends the job.
    """

    def __init__(self, store, rank: int, world: int, hang_timeout: float, attempt: str = "0",
                 detect: bool = False) -> None:
        self.store, self.rank, self.world, self.attempt = store, rank, world, attempt
        self.hang_timeout, self.detect = hang_timeout, detect
        self.interval = beat_interval(hang_timeout)
        self._stop = threading.Event()
        self._step = 0
        self._step_changed = time.monotonic()
        self._written, self._written_at = 0, -math.inf  # the step last put in the store, and when
        self.status: Callable[[], str | None] | None = None
        """What this rank waits for now (e.g. `MLLMExecutor.waiting_on`), published with each beat so a
        stall's warning names every rank's wait."""
        self._status_written: str | None = ""
        self._thread = threading.Thread(target=self._run, name="harmonia-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        try:
            self.store.set(_key(self.attempt, "proc", self.rank), f"{socket.gethostname()} {os.getpid()}")
        except Exception as err:  # noqa: BLE001 -- beats still help without it
            log.debug("heartbeat store unavailable: %s", err)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def progress(self, step: int) -> None:
        """Record that this rank finished ``step`` steps: in the store at once where it was last
        written `STEP_WRITE_S` ago or more, else with the next beat (steps of a few milliseconds
        need not each wait for a store round trip; what reads them waits for a beat interval)."""
        self._step, self._step_changed = step, time.monotonic()
        if self._step_changed - self._written_at >= STEP_WRITE_S:
            self._write_step()

    def _write_step(self) -> None:
        step = self._step
        try:
            self.store.set(_key(self.attempt, "step", self.rank), str(step))
        except Exception as err:  # noqa: BLE001 -- a store that went away must not stop training
            log.debug("heartbeat store unavailable: %s", err)
            return
        self._written, self._written_at = step, time.monotonic()

    def _write_status(self) -> None:
        status = (self.status() if self.status is not None else None) or ""
        if status != self._status_written:
            self.store.set(_key(self.attempt, "wait", self.rank), status)
            self._status_written = status

    def _run(self) -> None:
        detector = None
        while not self._stop.wait(self.interval):
            if self._step != self._written:
                self._write_step()
            try:
                self.store.add(_key(self.attempt, "beat", self.rank), 1)
                self._write_status()
                waiting = time.monotonic() - self._step_changed > 2 * self.interval
                if not (self.detect and waiting):
                    detector = None
                    continue
                detector = detector or HangDetector(self.store, self.world, self.hang_timeout, self.attempt)
                hung = detector.poll()
            except Exception as err:  # noqa: BLE001 -- the store is gone (launcher dead): beats end
                log.debug("heartbeat store unavailable: %s", err)
                continue
            if hung is not None:
                sys.stderr.write(f"error: {hung[1]} (seen by rank {self.rank}); stopping\n")
                sys.stderr.flush()
                pid = detector.local_pid(hung[0])
                if pid is not None:  # a stopped process ignores the agent's SIGTERM: end it now
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                os._exit(1)
