"""Start N local processes as `torchrun --standalone` would, and never leave one behind.

The launcher plays torchrun's agent: it hosts the rendezvous store (each process gets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and connects to it) and watches
the processes, which run ``target(*args)``:

- a rank that raises sends its traceback back; one that dies without a word (killed, out of
  memory) is named with its signal. Either way the others are stopped (terminated, then killed
  after a grace period) and `LaunchError` names the root cause, not the peers that lost their
  connections to it;
- SIGTERM, SIGINT and SIGHUP to the launcher are forwarded to every rank, which stops at a step
  boundary (`JobStopped` carries its message); a second signal kills the ranks at once;
- the ranks exit when the launcher dies (`harmonia.runtime.watchdog.exit_with_parent`);
- with ``hang_timeout``, a rank whose heartbeat stops (stopped, frozen) is named and the job ends.

Under torchrun (``RANK`` already set) nothing is spawned: the target runs in this process. A job of
one process (``in_process``) runs there too, as rank 0 of the launcher's own store: a second
interpreter would import torch and transformers again (3-5 s of a 1-process job's start-up, and its
memory beside the launcher's). Its stop signals are the rank's own (it stops at a step boundary; a
second one kills the job without saving, as the launcher does), the time limit sends it SIGTERM,
and a watch thread ends the process with the hang's one line when its heartbeat stops. What only a
second process can name, the rank's own death by a signal, is the command's death.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harmonia.errors import HarmoniaError
from harmonia.runtime.watchdog import (STOP_SIGNALS, HangDetector, StopRequested, StopSignals, beat_interval,
                                       exit_with_parent, signal_name)

LAUNCHER_ENV = "HARMONIA_LAUNCHER_PID"
"""Set in every rank the local launcher starts: the launcher's pid (absent under torchrun)."""

PEER_ERRORS = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|remote worker|"
                         r"NCCL communicator was aborted|Socket Timeout|Connection refused|Timed out waiting")
"""Errors a rank sees because another rank is gone: consequences, never the root cause."""


class LaunchError(HarmoniaError):
    """A rank failed or hung; the message names it and carries its error."""

    exit_code = 1


class JobStopped(StopRequested):
    """The job stopped on request (a signal, the time limit); ``exit_code`` is what the CLI returns."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _rank_env(rank: int, world: int, port: int, launcher: int) -> dict[str, str]:
    """What torchrun's agent gives a rank, the launcher hosting the store."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), LAUNCHER_ENV: str(launcher),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


PRELOAD = ("torch", "torch.distributed", "harmonia.train.worker")
"""What the ranks' fork server imports once, before it forks any rank (`rank_context`)."""


def rank_context():
    """Where ranks start from: a fork server that has imported `PRELOAD` (torch and the trainer, 3-5 s
    a rank would otherwise spend again). It runs nothing else, so a rank forked from it is as fresh as
    a spawned one; it starts with this process's first rank (or `warm_ranks`), serves every later
    launch from this process, and exits with it. A rank takes this process's environment, standard
    output and standard error as they are at its launch (`_entry`)."""
    import torch.multiprocessing as mp

    return mp.get_context("forkserver")


HF_PRELOAD = ("transformers", "transformers.processing_utils")
"""What a job from HF checkpoints also has its fork server import: its ranks load processors and
tokenizers (1-2 s of imports each)."""


GC_PAUSED, FROZEN = "harmonia.train.gc_paused", "harmonia.train.frozen_imports"
"""Imported first and last: the imports run without the garbage collector, and what they made is
frozen (`harmonia.train.frozen_imports`)."""


def warm_ranks(hf: bool = False) -> None:
    """Start the ranks' fork server now: it imports `PRELOAD` (and `HF_PRELOAD` for a job from HF
    checkpoints; `GC_PAUSED` before them and `FROZEN` after) while this process goes on (reading the
    data, planning) instead of after it. The first call in a process decides what its fork server
    holds."""
    from multiprocessing import forkserver

    rank_context().set_forkserver_preload([GC_PAUSED, *PRELOAD, *(HF_PRELOAD if hf else ()), FROZEN])
    forkserver.ensure_running()


class _LauncherFd:
    """One of the launcher's file descriptors, which a rank takes as its own (its output goes where the
    launcher's goes now, not where the fork server's went when it started): pickled as the rank
    starts, when multiprocessing hands the fork server a duplicate to pass on."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _received_fd, (DupFd(self.fd),)


def _received_fd(dup) -> int:
    return dup.detach()


def _entry(rank: int, world: int, port: int, launcher: int, payload: bytes, reports, environ: dict[str, str],
           stdout: int, stderr: int) -> None:
    """One rank: the launcher's standard output and error and environment taken (not the fork
    server's, from when it started), stop signals handled, then the target and its arguments
    unpickled and run; what happened goes to ``reports``."""
    for received, own in ((stdout, 1), (stderr, 2)):
        os.dup2(received, own)
        os.close(received)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(_rank_env(rank, world, port, launcher))
    code = 0
    try:
        StopSignals.install(raise_now=True)
        exit_with_parent(launcher)
        _threads_from_environment()
        target, args = pickle.loads(payload)
        value = target(*args)
        if value is not None:
            reports.put(("result", rank, value))
    except StopRequested as stop:
        reports.put(("stopped", rank, str(stop), stop.signum))
        code = 128 + stop.signum
    except BaseException as err:  # noqa: BLE001 -- every failure goes to the parent
        reports.put(("error", rank, f"{type(err).__name__}: {err}", traceback.format_exc()))
        code = 1
    if code:
        raise SystemExit(code)


def _threads_from_environment() -> None:
    """``OMP_NUM_THREADS`` as the launcher's environment sets it: torch read the fork server's when it
    was imported there."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        import torch

        torch.set_num_threads(int(given))


@dataclass
class _Job:
    """The launcher's view of its ranks while they run."""

    procs: list
    reports: Any
    errors: list[tuple[int, str, str]] = field(default_factory=list)
    stops: dict[int, tuple[str, int]] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)
    signals: list[int] = field(default_factory=list)
    sent: set[int] = field(default_factory=set)
    terminated: set[int] = field(default_factory=set)
    hung: str | None = None
    timed_out: float | None = None

    def drain(self, wait_s: float = 0.0) -> None:
        try:
            self._take(self.reports.get(timeout=wait_s) if wait_s else self.reports.get_nowait())
            while True:
                self._take(self.reports.get_nowait())
        except queue.Empty:
            pass

    def _take(self, report: tuple) -> None:
        kind, rank, *rest = report
        if kind == "result":
            self.results[rank] = rest[0]
        elif kind == "stopped":
            self.stops[rank] = (rest[0], rest[1])
        else:
            self.errors.append((rank, rest[0], rest[1]))

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.is_alive()]

    def failed(self) -> bool:
        """A rank raised, or ended badly without reporting a requested stop."""
        stopping = {0, *(128 + s for s in STOP_SIGNALS), *(-s for s in self.sent)}
        dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None and p.exitcode not in stopping
                and r not in self.stops]
        return bool(self.errors or dead)

    def send(self, signum: int, only_running: bool = False) -> None:
        """``signum`` to every live rank (``only_running``: those that have not reported a stop)."""
        self.sent.add(signum)
        for r, p in enumerate(self.procs):
            if p.pid is not None and p.exitcode is None and not (only_running and r in self.stops):
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass


def launch(target: Callable, world_size: int, args: tuple = (), timeout: float | None = None,
           grace_s: float = 5.0, settle_s: float = 0.5, hang_timeout: float | None = None,
           stop_grace_s: float = 120.0, in_process: bool = False) -> Any:
    """Run ``target(*args)`` on ``world_size`` local processes; returns rank 0's return value.

    Args:
        target: a picklable function (module level).
        world_size: processes to start.
        args: arguments of ``target``.
        timeout: seconds after which every rank is asked to stop, as by SIGTERM (None = no limit).
        grace_s: seconds between terminate and kill when stopping ranks after a failure.
        settle_s: after the first failure, how long to collect the others' before naming the root cause.
        hang_timeout: seconds without a heartbeat after which a rank is named as hung and the job
            ends (None = no heartbeat watch; the target must run `harmonia.runtime.watchdog.Heartbeat`).
        stop_grace_s: seconds the ranks have to stop after a forwarded signal before being killed.
        in_process: run a 1-process job in this process (module docstring).

    Raises:
        LaunchError: a rank failed, died or hung (the root cause is named).
        JobStopped: a signal or the time limit stopped the job.
    """
    if under_torchrun():
        return target(*args)
    if in_process and world_size == 1:
        return _in_this_process(target, args, timeout, hang_timeout, stop_grace_s)
    from multiprocessing.reduction import ForkingPickler  # with torch's reductions, as Process args have

    import torch.distributed as dist

    warm_ranks()  # no-op when the job already started its fork server
    ctx = rank_context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    reports = ctx.Queue()
    payload = bytes(ForkingPickler.dumps((target, args)))
    environ = dict(os.environ)
    job = _Job([ctx.Process(target=_entry, args=(r, world_size, store.port, os.getpid(), payload, reports, environ,
                                                 _LauncherFd(1), _LauncherFd(2)), daemon=False)
                for r in range(world_size)], reports)
    with _forwarded_signals(job):
        with _sigint_ignored():  # a Ctrl-C in a rank's first moments is the launcher's to forward
            for p in job.procs:
                p.start()
        detector = (HangDetector(store, world_size, hang_timeout, pids={r: p.pid for r, p in enumerate(job.procs)})
                    if hang_timeout else None)
        try:
            _supervise(job, detector, timeout, settle_s, stop_grace_s)
        finally:
            job.terminated |= set(job.alive())
            _stop(job, grace_s)
    return _outcome(job)


def _supervise(job: _Job, detector: HangDetector | None, timeout: float | None, settle_s: float,
               stop_grace_s: float) -> None:
    """Wait for the ranks; return at the first failure, hang, or when a requested stop is overdue."""
    start = time.monotonic()
    next_poll, next_resend, deadline, handled, stopping = start, start, None, 0, None
    while job.alive():
        job.drain(wait_s=0.2)
        if len(job.signals) > handled:
            handled = len(job.signals)
            if handled > 1:  # a second signal: no more waiting for a graceful stop
                job.terminated |= set(job.alive())
                job.send(signal.SIGKILL)
            stopping = job.signals[0] if handled == 1 else None
            deadline = deadline or time.monotonic() + stop_grace_s
        if job.failed():
            time.sleep(settle_s)  # the other ranks' reports, and the root cause's own, arrive
            job.drain()
            return
        now = time.monotonic()
        if detector is not None and now >= next_poll:
            next_poll = now + beat_interval(detector.hang_timeout)
            hung = detector.poll()
            if hung is not None:
                job.hung = hung[1]
                return
        if timeout is not None and job.timed_out is None and now - start > timeout:
            job.timed_out, stopping = timeout, signal.SIGTERM
            job.send(signal.SIGTERM)
            deadline = now + stop_grace_s
        if stopping is not None and now >= next_resend:  # a rank still starting up may have missed it
            next_resend = now + 1.0
            job.send(stopping, only_running=True)
        if deadline is not None and now > deadline:
            return
    job.drain()


class _sigint_ignored:
    """SIGINT ignored while ranks start: they inherit it ignored until their own handler is in place."""

    def __enter__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class _forwarded_signals:
    """While ranks run, SIGTERM / SIGINT / SIGHUP to the launcher go to every rank (main thread only)."""

    def __init__(self, job: _Job) -> None:
        self.job, self.previous = job, {}

    def _handle(self, signum: int, frame) -> None:
        self.job.signals.append(signum)
        if len(self.job.signals) == 1:
            self.job.send(signum)

    def __enter__(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _outcome(job: _Job) -> Any:
    """Rank 0's result, or the error that says what happened."""
    job.drain()
    if job.hung is not None:
        raise LaunchError(f"{job.hung}; every rank was stopped")
    cause = _root_cause(job)
    if cause is not None:
        raise LaunchError(cause)
    if not job.stops and all(p.exitcode == 0 for p in job.procs):
        return job.results.get(0)  # finished before a signal or the time limit could stop it
    if job.stops or job.signals or job.timed_out is not None:
        first = min(job.stops) if job.stops else None
        sig = job.stops[first][1] if first is not None else (job.signals or [signal.SIGTERM])[0]
        message = (job.stops[first][0] if first is not None else
                   f"stopped by {signal_name(sig)} before training started")
        if job.timed_out is not None:
            raise JobStopped(f"the job ran past its time limit (parallel.timeout_s={job.timed_out:g}): {message}",
                             sig, exit_code=124)
        if len(job.signals) > 1:
            message = f"stopped by a second {signal_name(job.signals[1])}: every rank was killed without saving"
        elif job.terminated - set(job.stops) and first is not None:
            message += f" (ranks {sorted(job.terminated - set(job.stops))} did not stop in time and were killed)"
        raise JobStopped(message, sig)
    bad = [(r, p.exitcode) for r, p in enumerate(job.procs) if p.exitcode != 0]
    if bad:
        raise LaunchError(f"ranks {bad} ended with non-zero exit codes")
    return job.results.get(0)


def _root_cause(job: _Job) -> str | None:
    """The failure to report: a rank's own error first, then a rank that died without a word (killed,
    out of memory), then a rank that never reached the collective its peers gave up on, then an error
    that only says a peer went away."""
    own = [e for e in job.errors if not PEER_ERRORS.search(e[1])]
    if own:
        return _with_traceback(job, *own[0])
    reported = {r for r, _, _ in job.errors} | set(job.stops)
    for r, p in enumerate(job.procs):
        code = p.exitcode
        if code in (None, 0) or r in reported or r in job.terminated or -code in job.sent:
            continue
        if code < 0:
            return (f"rank {r} was killed by {signal_name(-code)} (no Python error: out of memory, or killed from "
                    "outside?); every rank was stopped")
        return f"rank {r} exited with code {code} and no Python error; every rank was stopped"
    if job.errors:
        silent = sorted(job.terminated - reported)
        if silent:
            return (f"ranks {silent} stopped answering their peers (who reported: {job.errors[0][1]}); "
                    "every rank was stopped")
        return _with_traceback(job, *job.errors[0])
    return None


def _with_traceback(job: _Job, rank: int, message: str, tb: str) -> str:
    others = sorted({r for r, _, _ in job.errors} - {rank})
    also = f" (ranks {others} failed after it)" if others else ""
    return f"rank {rank} failed: {message}{also}" + (f"\n--- rank {rank} traceback ---\n{tb}" if tb else "")


def _stop(job: _Job, grace_s: float) -> None:
    job.drain()
    for p in job.procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in job.procs:
        while p.is_alive() and time.monotonic() < deadline:
            job.drain(wait_s=0.05)  # a rank flushing its report must not block on a full pipe
            p.join(timeout=0.05)
        if p.is_alive():
            p.kill()
            p.join()


def _in_this_process(target: Callable, args: tuple, timeout: float | None, hang_timeout: float | None,
                     stop_grace_s: float) -> Any:
    """``target(*args)`` as the only rank, in this process (module docstring); the same errors as
    `launch`'s: `LaunchError` naming rank 0's failure, `JobStopped` for a signal or the time limit."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = _rank_env(0, 1, store.port, os.getpid())
    saved_env = {k: os.environ.get(k) for k in env}
    main = threading.current_thread() is threading.main_thread()
    saved_signals = {s: signal.getsignal(s) for s in STOP_SIGNALS} if main else {}
    watch = _Watch(store, hang_timeout, timeout, stop_grace_s)
    os.environ.update(env)
    try:
        if main:
            stops = _SecondSignalKills(raise_now=True)
            for sig in STOP_SIGNALS:
                signal.signal(sig, stops._handle)
        watch.start()
        return target(*args)
    except StopRequested as stop:
        if watch.timed_out:
            raise JobStopped(f"the job ran past its time limit (parallel.timeout_s={timeout:g}): {stop}", stop.signum,
                             exit_code=124) from None
        raise JobStopped(str(stop), stop.signum) from None
    except Exception as err:  # noqa: BLE001 -- said as the launcher says a rank's failure
        raise LaunchError(f"rank 0 failed: {type(err).__name__}: {err}\n--- rank 0 traceback ---\n"
                          f"{traceback.format_exc()}") from None
    finally:
        watch.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)


class _SecondSignalKills(StopSignals):
    """The in-process rank's stop signals: the first asks for a stop at a step boundary, a second ends
    the process at once (as the launcher kills its ranks on a second signal)."""

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            _last_words(f"stopped by a second {signal_name(signum)}: the job was killed without saving")
            os._exit(128 + signum)
        super()._handle(signum, frame)


class _Watch:
    """The in-process rank's watch thread: the time limit (SIGTERM to this process, then the end of it
    ``stop_grace_s`` later) and its heartbeat (a hang ends the process with its one line)."""

    def __init__(self, store, hang_timeout: float | None, timeout: float | None, stop_grace_s: float) -> None:
        self.detector = HangDetector(store, 1, hang_timeout, pids={0: os.getpid()}) if hang_timeout else None
        self.timeout, self.stop_grace_s = timeout, stop_grace_s
        self.timed_out = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harmonia-watch", daemon=True)

    def start(self) -> None:
        if self.detector is not None or self.timeout is not None:
            self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        start = time.monotonic()
        poll_s = beat_interval(self.detector.hang_timeout) if self.detector is not None else 1.0
        deadline = None
        while not self._done.wait(poll_s):
            now = time.monotonic()
            if self.timeout is not None and not self.timed_out and now - start > self.timeout:
                self.timed_out, deadline = True, now + self.stop_grace_s
                os.kill(os.getpid(), signal.SIGTERM)
            hung = self.detector.poll() if self.detector is not None else None
            if hung is not None or (deadline is not None and now > deadline):
                why = f"{hung[1]}; the job was stopped" if hung is not None else (
                    f"the job ran past its time limit (parallel.timeout_s={self.timeout:g}) and did not stop within "
                    f"{self.stop_grace_s:g} s; it was killed")
                _last_words(why)
                os._exit(1)


def _last_words(message: str) -> None:
    """``error: message`` on stderr from a thread that ends the process (nothing else may run)."""
    try:
        os.write(2, f"error: {message}\n".encode())
    except OSError:
        pass
