"""Discrete-event replay of per-rank task lists.

Every rank executes its tasks in list order on one compute stream. A task starts when the rank is
free and every task it depends on has finished, plus the transfer delay of that edge (a P2P send
between stages, a boundary transfer between modules). Transfers overlap compute (asynchronous
P2P); their delay is ``latency + bytes / bandwidth``. Gradient reductions run on a separate
communication stream per rank after the task that finishes a module stage's weight gradients.

The replay is a topological sweep: a task becomes ready when it heads its rank's queue and all its
dependencies are done, so the cost is O(tasks + edges). If no task is ready while some remain, the
schedule deadlocks; the error lists what each rank waits for.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action


@dataclass(slots=True)
class Task:
    """One step on one rank.

    Attributes:
        name: text form for reports (``llm.s1.F3``).
        rank: the rank that runs it.
        duration: seconds on the compute stream.
        deps: (task index, transfer delay in seconds) pairs that must finish first.
        module: module name (for colouring and per-module time).
        kind: ``F``, ``B``, ``W``, ``BW``, a send or receive (``SEND_F`` ...: no time of its own; a
            receive waits for its message) or ``C`` (a collective on the communication stream).
        mem_delta: activation bytes allocated (+) or freed (-) when the task ends.
        flops: useful FLOPs of the task (for MFU).
        transient: bytes held only while the task runs (a recomputed block's activations in B).
        action: the rank's action the task times (None for tasks built otherwise, e.g. measured).
    """

    name: str
    rank: int
    duration: float
    deps: list[tuple[int, float]] = field(default_factory=list)
    module: str = ""
    kind: str = "F"
    mem_delta: float = 0.0
    flops: float = 0.0
    transient: float = 0.0
    action: Action | None = None


@dataclass
class Timeline:
    """Result of a replay.

    Attributes:
        tasks: the replayed tasks.
        start, end: per-task times (seconds), arrays aligned with ``tasks``.
        ranks: rank ids in row order.
        iteration_s: time from 0 until the last task (compute or communication) ends.
        busy_s: per-rank compute-busy seconds.
        peak_mem: per-rank peak of activation bytes.
    """

    tasks: list[Task]
    start: np.ndarray
    end: np.ndarray
    ranks: list[int]
    iteration_s: float
    busy_s: dict[int, float]
    peak_mem: dict[int, float]

    @property
    def bubble_frac(self) -> float:
        """Idle share of compute over all ranks: ``1 - busy / (ranks * iteration)``."""
        if self.iteration_s <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s.values()) / (len(self.ranks) * self.iteration_s)

    def utilisation(self) -> dict[int, float]:
        return {r: (b / self.iteration_s if self.iteration_s else 0.0) for r, b in self.busy_s.items()}

    def mfu(self, peak_flops: float, devices: int | None = None) -> float:
        """Useful FLOPs per second over the peak of ``devices`` (default: a device per rank; where
        ranks share cores, the cores: `ClusterSpec.compute_units`)."""
        flops = sum(t.flops for t in self.tasks)
        n = devices if devices is not None else len(self.ranks)
        return flops / (self.iteration_s * peak_flops * n) if self.iteration_s else 0.0

    def module_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.tasks:
            if t.kind != "C":
                out[t.module] = out.get(t.module, 0.0) + t.duration
        return out


def replay(tasks: list[Task], order: dict[int, list[int]],
           comm_order: Mapping[Hashable, list[int]] | None = None) -> Timeline:
    """Replay tasks in the given per-rank order.

    Args:
        tasks: all tasks.
        order: rank -> indices of its compute tasks, in execution order.
        comm_order: rank -> indices of its communication-stream tasks (collectives), in order; any
            other key: a queue of its own (a barrier that couples ranks, `harmonia.sim.tasks`).

    Raises:
        ScheduleError: on a deadlock (naming each rank's blocked task) or a task in no queue.
    """
    n = len(tasks)
    queues = queues_of(tasks, order, comm_order)
    # plain lists: the sweep touches one element at a time, where numpy scalars cost several times more
    remaining = [len(t.deps) for t in tasks]
    ready_at = [0.0] * n
    duration = [t.duration for t in tasks]
    children: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d, delay in t.deps:
            children[d].append((i, delay))
    start, end = [math.nan] * n, [math.nan] * n
    head = {key: 0 for key in queues}
    free = {key: 0.0 for key in queues}
    owner: list = [None] * n
    for key, q in queues.items():
        for i in q:
            owner[i] = key
    stack = [key for key, q in queues.items() if q and remaining[q[0]] == 0]
    done = 0
    while stack:
        key = stack.pop()
        q = queues[key]
        at, now = head[key], free[key]
        while at < len(q):
            i = q[at]
            if remaining[i]:
                break
            s = now if now > ready_at[i] else ready_at[i]
            now = s + duration[i]
            start[i], end[i] = s, now
            at += 1
            done += 1
            for c, delay in children[i]:
                remaining[c] -= 1
                if now + delay > ready_at[c]:
                    ready_at[c] = now + delay
                if remaining[c] == 0:
                    ck = owner[c]
                    if ck != key and queues[ck][head[ck]] == c:
                        stack.append(ck)
        head[key], free[key] = at, now
    if done < n:
        raise deadlock(tasks, queues, head, end)
    start, end = np.asarray(start), np.asarray(end)
    ranks = sorted({t.rank for t in tasks} | set(order))
    busy = {r: 0.0 for r in ranks}
    for t in tasks:
        if t.kind != "C":
            busy[t.rank] += t.duration
    return Timeline(tasks, start, end, ranks, float(end.max()) if n else 0.0, busy, peak_memory(tasks, end, ranks))


def queues_of(tasks: list[Task], order: dict[int, list[int]],
              comm_order: Mapping[Hashable, list[int]] | None) -> dict[tuple, list[int]]:
    """Every queue a replay runs: ``("c", rank)`` compute, ``("m", key)`` communication and barriers.

    Raises:
        ScheduleError: when a task is on no queue or on several.
    """
    queues = {("c", r): list(q) for r, q in order.items()}
    for r, q in (comm_order or {}).items():
        queues[("m", r)] = list(q)
    queued = sum(len(q) for q in queues.values())
    if queued != len(tasks):
        raise ScheduleError(f"{len(tasks)} tasks but {queued} are queued on ranks; every task must be on exactly "
                            "one queue")
    return queues


def deadlock(tasks: list[Task], queues: dict[tuple, list[int]], head: dict[tuple, int],
             end: list[float]) -> ScheduleError:
    """The error naming what each queue's blocked task waits for."""
    blocked = []
    for key, q in queues.items():
        if head[key] < len(q):
            i = q[head[key]]
            waits = [tasks[d].name for d, _ in tasks[i].deps if math.isnan(end[d])]
            blocked.append(f"rank {key[1]} at {tasks[i].name} waits for {', '.join(waits[:3])}")
    return ScheduleError("schedule deadlocks: " + "; ".join(blocked))


def peak_memory(tasks: list[Task], end: np.ndarray, ranks: list[int]) -> dict[int, float]:
    """Peak over time of the running sum of ``mem_delta`` per rank (allocations before frees at ties),
    each task's ``transient`` counted on top of the level it runs at (before its own delta)."""
    peak = {r: 0.0 for r in ranks}
    by_rank: dict[int, list[tuple[float, float, float]]] = {}
    for t, e in zip(tasks, end):
        if t.mem_delta or t.transient:
            by_rank.setdefault(t.rank, []).append((e, -t.mem_delta, t.transient))
    for r, events in by_rank.items():
        peak[r] = running_peak((-neg, transient) for _, neg, transient in sorted(events))
    return peak


def running_peak(events: Iterable[tuple[float, float]]) -> float:
    """Peak of a running sum of ``(delta, transient)`` events in order, each ``transient`` counted
    on top of the level its task runs at (before its own delta)."""
    level = peak = 0.0
    for delta, transient in events:
        peak = max(peak, level + transient)
        level += delta
        peak = max(peak, level)
    return peak
