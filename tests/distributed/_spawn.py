"""Run a function on N gloo CPU processes; a failing or hung rank fails the caller with its traceback.

``run_workers(fn, world, args)`` starts ``world`` processes, each running
``fn(rank, world, *args)`` inside a gloo process group, and returns every rank's return value (which
must pickle). If a rank raises, the other ranks are terminated and an AssertionError carries the
failing rank's traceback; if the ranks do not finish within ``timeout`` seconds, they are all
terminated and the error says which were still running. Inside a worker, `check_timeout` bounds
one check so a hang surfaces as a TimeoutError naming the check.

The processes are forked from a fork server that imported torch and harmonia's runtime once
(`PRELOAD`), as fresh as spawned ones (the fork server runs no test code, and each rank takes the
caller's environment as it is at the call) but without paying the imports again in every rank of
every test.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp

from harmonia.runtime.comm_record import ENV as RECORD_ENV
from harmonia.runtime.comm_record import install_recorder, uninstall_recorder, write_record
from harmonia.sim.nccl_replay import replay_dir

PRELOAD = ["harmonia.train.gc_paused", "torch", "torch.distributed", "harmonia.runtime.mllm_executor",
           "harmonia.train.rank", "harmonia.train.worker", "harmonia.train.frozen_imports"]
"""Modules the fork server imports before forking ranks (with the garbage collector off, what they
made frozen after, as `harmonia.launch.warm_ranks` has it)."""


def preloaded_forkserver() -> str:
    """The start method of ranks forked from a fork server that has imported `PRELOAD`."""
    mp.set_forkserver_preload(PRELOAD)
    return "forkserver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAYOUT_TIMEOUT_S = 240
"""The most one layout's steps may take in a spawned rank before it counts as hung: a few seconds on
an idle machine, 20x that and more where other jobs share its cores (a hang still ends well within
the whole run's time-out)."""


@contextlib.contextmanager
def check_timeout(seconds: int, what: str) -> Iterator[None]:
    """Raise TimeoutError in this process if the block runs longer than ``seconds``."""

    def expire(signum, frame):
        raise TimeoutError(f"{what} did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, results, pg_timeout: float,
           environ: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's, not the fork server's from when it started
    os.environ.update(environ)

    torch.set_num_threads(1)  # N processes share the machine's cores
    record = os.environ.get(RECORD_ENV)
    recorder = install_recorder() if record else None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        value = fn(rank, world, *args)
        if recorder is not None:
            write_record(os.path.join(record, f"rank{rank}.jsonl"), recorder)
        # Plain pickle copies tensors into bytes: torch's shared-memory handles would die with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 -- report everything, timeouts included, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if recorder is not None:
            uninstall_recorder()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world: int, args: tuple = (), timeout: float = 300.0,
                pg_timeout: float = 60.0, replay: bool = True) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes and return each rank's value.

    With ``replay`` (and more than one rank), every rank records the point-to-point operations and
    collectives it issues (`harmonia.runtime.comm_record`), and once all have finished the records
    are replayed under NCCL's rules (`harmonia.sim.nccl_replay`: tags ignored; one in-order stream per
    pair of ranks, as PyTorch issues unbatched sends and receives on lazily created communicators, and
    one per process group, collectives included, as it issues everything once communicators are
    created eagerly); a deadlock, a size or dtype mismatch or collectives in different orders fail
    the caller."""
    with contextlib.ExitStack() as stack:
        record = stack.enter_context(tempfile.TemporaryDirectory(prefix="comms-")) if replay and world > 1 else None
        values = _run(fn, world, args, timeout, pg_timeout, record)
        if record is not None:
            for streams in ("pair", "group"):
                replay_dir(record, streams=streams)
    return values


def _run(fn: Callable[..., Any], world: int, args: tuple, timeout: float, pg_timeout: float,
         record: str | None) -> list[Any]:
    ctx = mp.get_context(preloaded_forkserver())
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    environ.pop(RECORD_ENV, None)
    if record is not None:
        environ[RECORD_ENV] = record
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results, pg_timeout, environ), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    ok = False
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                running = [r for r in range(world) if r not in values]
                raise AssertionError(f"ranks {running} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise AssertionError(f"ranks {dead} died without reporting "
                                         f"(exit codes {[procs[r].exitcode for r in dead]})") from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} of {world} failed:\n{value}")
            values[rank] = pickle.loads(value)
        ok = True
    finally:
        for p in procs:
            p.join(timeout=10 if ok else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [values[r] for r in range(world)]
