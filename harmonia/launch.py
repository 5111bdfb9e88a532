"""Start N local processes as `torchrun --standalone` would, and end all of them if one fails.

Each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its
environment and runs ``target(*args)``. The parent watches them: when a process raises, its
traceback comes back through a queue; when one dies without a word (killed, out of memory), its exit
code or signal is reported. Either way the others are terminated (then killed after a grace
period), so no rank waits forever in a collective, and `LaunchError` carries the failing rank's
message. When one failure causes others (its peers lose their connections to it), the root cause
is the one named. Under torchrun (``RANK`` already set) nothing is spawned: the target runs in this process.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import time
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp

from harmonia.errors import HarmoniaError


class LaunchError(HarmoniaError):
    """A rank failed; the message names it and carries its error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _entry(rank: int, world: int, port: int, target: Callable, args: tuple, errors) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        target(*args)
    except BaseException as err:  # noqa: BLE001 -- every failure goes to the parent
        errors.put((rank, f"{type(err).__name__}: {err}", traceback.format_exc()))
        raise SystemExit(1) from None


def launch(target: Callable, world_size: int, args: tuple = (), timeout: float | None = None,
           grace_s: float = 5.0, settle_s: float = 0.5) -> None:
    """Run ``target(*args)`` on ``world_size`` local processes; raise `LaunchError` if any fails.

    Args:
        target: a picklable function (module level).
        world_size: processes to start.
        args: arguments of ``target``.
        timeout: seconds before every rank is stopped (None = no limit).
        grace_s: seconds between terminate and kill when stopping ranks.
        settle_s: after the first failure, how long to collect the others' before naming the root cause.
    """
    if under_torchrun():
        target(*args)
        return
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, target, args, errors), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    start = time.monotonic()
    reports: list[tuple[int, str, str]] = []
    try:
        while any(p.is_alive() for p in procs):
            _drain(errors, reports, wait_s=0.2)
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if reports or dead:
                time.sleep(settle_s)  # the other ranks' reports, and the root cause's own, arrive
                _drain(errors, reports)
                break
            if timeout is not None and time.monotonic() - start > timeout:
                running = [r for r, p in enumerate(procs) if p.is_alive()]
                reports.append((running[0], f"ranks {running} still running after {timeout:.0f} s", ""))
                break
        _drain(errors, reports)
    finally:
        _stop(procs, grace_s)
    exit_codes = {r: p.exitcode for r, p in enumerate(procs)}
    failure = _root_cause(reports, exit_codes)
    if failure is not None:
        rank, message, tb = failure
        others = sorted({r for r, _, _ in reports} - {rank})
        also = f" (ranks {others} failed after it)" if others else ""
        raise LaunchError(f"rank {rank} failed: {message}{also}"
                          + (f"\n--- rank {rank} traceback ---\n{tb}" if tb else ""))
    bad = [(r, code) for r, code in exit_codes.items() if code != 0]
    if bad:
        raise LaunchError(f"ranks {bad} ended with non-zero exit codes")


PEER_ERRORS = re.compile(r"Connection reset by peer|Connection closed by peer|Broken pipe|remote worker|"
                         r"NCCL communicator was aborted|Socket Timeout|Connection refused")
"""Errors a rank sees because another rank is gone: consequences, never the root cause."""


def _drain(errors, reports: list, wait_s: float = 0.0) -> None:
    try:
        reports.append(errors.get(timeout=wait_s) if wait_s else errors.get_nowait())
        while True:
            reports.append(errors.get_nowait())
    except queue.Empty:
        pass


def _root_cause(reports: list[tuple[int, str, str]], exit_codes: dict[int, int | None]):
    """The failure to report: a rank's own error first, then a rank that died without a word (killed,
    out of memory), then an error that only says a peer went away."""
    own = [f for f in reports if not PEER_ERRORS.search(f[1])]
    if own:
        return own[0]
    reported = {r for r, _, _ in reports}
    for r, code in exit_codes.items():
        if code not in (None, 0) and r not in reported and not (code < 0 and -code == signal.SIGTERM):
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return (r, f"process ended with {how} and no Python error (killed or out of memory?)", "")
    return reports[0] if reports else None


def _stop(procs, grace_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
