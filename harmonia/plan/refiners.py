"""Where the search's costly refinements run: in the searching process, then in worker processes.

Almost all of a large search is spent on two refinements of a candidate's bound on one batch: the
bound of the batch's actual stage work and the simulations of its parts (`_Scorer.work`,
`_Scorer.simulate_part` in `harmonia.plan.search`): 87% of the 4,096-GPU omni-72b search, sampled
with py-spy. Each depends only on the candidate, the batch and what the scorer keeps, so several
candidates can be refined at once, each in a process of its own, while the searching process keeps
the heap of bounds and does the cheap refinements itself.

`Refiners` runs them in this process until they have taken ``after_s`` seconds (a small search,
e.g. a CPU job's, never pays for starting processes), then forks ``workers`` processes that
inherit the scorer as it stands and take one refinement each at a time. A batch's simulation goes
on in parts (the busiest column, the busiest part, the others), and what the parts already found
lives in the process that found it, so every refinement of a (candidate, batch) after a worker's
first goes to that worker (`can_take`). Workers return what the searching process needs of the
scorer's state (`Outcome`); the search merges it. What one worker computed that others would compute
again (the recipe's assignments of a batch, shared by every candidate with the same assignment key:
a quarter of a 1,024-GPU search) comes back in ``Outcome.shared`` and goes to every other worker with
its next refinement, which ``absorb`` puts in its scorer.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from harmonia.errors import HarmoniaError

PARALLEL_AFTER_S = 2.0
"""Seconds of costly refinements the search runs in its own process before it starts workers."""


@dataclass
class Outcome:
    """A refinement of candidate ``i`` on batch ``j``.

    Attributes:
        state: the batch's new ``[level, value]`` (None where ``error`` is set).
        error: why the candidate cannot run (a schedule error's message), or None.
        peak: the scorer's peak bytes on one rank of the candidate after the refinement.
        work_bound: ``((family key, j), (recompute shares, bound))`` where the refinement found a
            work bound (for twins' bounds), else None.
        timelines: single-batch simulations it started.
        shared: what the refinement computed that other processes can use instead of computing it
            (key -> value, for ``absorb``).
        remote: whether a worker refined it (its scorer state is then the worker's to merge).
    """

    i: int
    j: int
    state: list | None = None
    error: str | None = None
    peak: float = 0.0
    work_bound: tuple | None = None
    timelines: int = 0
    shared: dict | None = None
    remote: bool = False


Refine = Callable[[int, int, int, float], Outcome]
"""``refine(i, j, level, value)``: candidate ``i``'s batch ``j``, now at ``[level, value]``, one level up."""


class Refiners:
    """Costly refinements, one at a time in this process, then up to ``workers`` at once in forked
    processes (see the module docstring). Use as a context manager: the workers end with it."""

    def __init__(self, refine: Refine, workers: int = 1, after_s: float | None = None,
                 absorb: Callable[[dict], None] | None = None) -> None:
        """``after_s``: seconds of refinements run here before the workers start (default
        `PARALLEL_AFTER_S`); ``absorb``: takes, in a worker, what the others shared
        (`Outcome.shared`)."""
        self.refine, self.workers, self.absorb = refine, max(1, workers), absorb
        self._shared: list[tuple] = []  # (worker, key, value) workers shared, in order
        self._sent: list[int] = []  # per worker: how many of them it has been sent
        self.after_s = PARALLEL_AFTER_S if after_s is None else after_s
        self.inline_s = 0.0
        self._done: deque[Outcome] = deque()  # inline outcomes not yet waited for
        self._conns: list[Connection] = []
        self._procs: list = []
        self._busy: dict[int, tuple[int, int]] = {}  # worker -> (i, j) it refines
        self._owner: dict[tuple[int, int], int] = {}  # (i, j) -> the worker holding its parts
        self._order: dict[tuple[int, int], tuple] = {}  # (i, j) in flight -> its place in the search

    def __enter__(self) -> Refiners:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def started(self) -> bool:
        """Whether worker processes run the refinements."""
        return bool(self._procs)

    def in_flight(self) -> int:
        """Refinements submitted and not yet waited for."""
        return len(self._done) + len(self._busy)

    def idle(self) -> bool:
        """Whether another refinement can be submitted now."""
        return len(self._busy) < len(self._procs) if self._procs else not self._done

    def can_take(self, i: int, j: int) -> bool:
        """Whether candidate ``i``'s batch ``j`` can be refined now: some worker is idle, and the one
        holding its parts is, where one does."""
        if not self.idle():
            return False
        owner = self._owner.get((i, j))
        return owner is None or owner not in self._busy

    def in_flight_before(self, place: tuple) -> bool:
        """Whether a refinement in flight was submitted at a place in the search before ``place``."""
        return any(p < place for p in self._order.values())

    def submit(self, i: int, j: int, level: int, value: float, place: tuple = ()) -> None:
        """Refine candidate ``i``'s batch ``j`` from ``[level, value]`` (call only where `can_take`);
        ``place``: its order in the search (`in_flight_before`)."""
        self._order[(i, j)] = place
        if not self._procs and self.workers > 1 and self.inline_s >= self.after_s:
            self._start()
        if not self._procs:
            t0 = time.perf_counter()
            self._done.append(self.refine(i, j, level, value))
            self.inline_s += time.perf_counter() - t0
            return
        worker = self._owner.get((i, j))
        if worker is None:
            worker = next(w for w in range(len(self._procs)) if w not in self._busy)
            self._owner[(i, j)] = worker
        shared = [(key, value) for w, key, value in self._shared[self._sent[worker]:] if w != worker]
        self._conns[worker].send(((i, j, level, value), shared))
        self._sent[worker] = len(self._shared)
        self._busy[worker] = (i, j)

    def wait(self) -> Outcome:
        """The next finished refinement (blocks until one is)."""
        if self._done:
            done = self._done.popleft()
            del self._order[(done.i, done.j)]
            return done
        conns = {self._conns[w]: w for w in self._busy}
        conn = wait(list(conns))[0]
        worker = conns[conn]
        del self._order[self._busy.pop(worker)]
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            self._procs[worker].join(1)
            raise HarmoniaError(f"a planner worker (pid {self._procs[worker].pid}) ended without its result "
                                f"(exit code {self._procs[worker].exitcode}); out of memory? run the search with "
                                "fewer workers") from None
        if kind == "crash":
            raise RuntimeError(f"a planner worker failed:\n{payload}")
        payload.remote = True
        if payload.shared:
            self._shared += [(worker, key, value) for key, value in payload.shared.items()]
        return payload

    def _start(self) -> None:
        """Fork the workers: each inherits the scorer as the search has built it so far."""
        ctx = multiprocessing.get_context("fork")
        for _ in range(self.workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(self.refine, self.absorb, theirs, mine), daemon=True,
                               name="harmonia-plan-worker")
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)
            self._sent.append(0)

    def close(self) -> None:
        """End the workers: an idle one when told, a busy one at once (what it refines is no longer
        needed: the search has ranked its plans, or stops); none is left behind."""
        for worker, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            if worker in self._busy:
                proc.terminate()
            else:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            conn.close()
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(1)
        self._conns, self._procs, self._busy, self._order, self._sent = [], [], {}, {}, []


def _serve(refine: Refine, absorb: Callable[[dict], None] | None, conn: Connection, parents: Connection) -> None:
    """A worker: refine what the searching process sends (with what other workers shared since its
    last refinement) until it sends None or goes away. A signal for the search (Ctrl-C) is the
    searching process's to report; the worker ends when it does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parents.close()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            break
        if job is None:
            break
        job, shared = job
        try:
            if shared and absorb is not None:
                absorb(dict(shared))
            conn.send(("done", refine(*job)))
        except Exception:  # noqa: BLE001 - reported by the searching process, which stops
            conn.send(("crash", traceback.format_exc()))
    conn.close()
