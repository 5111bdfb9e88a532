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
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action


@dataclass(slots=True)
class Task:
    """One step on one rank.

    Attributes:
        label: text form for reports (``llm.s1.F3``); empty where ``action`` gives it (`name`: a
            replay makes hundreds of thousands of message tasks, read by name only where a timeline
            is written or a deadlock reported).
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

    label: str
    rank: int
    duration: float
    deps: list[tuple[int, float]] = field(default_factory=list)
    module: str = ""
    kind: str = "F"
    mem_delta: float = 0.0
    flops: float = 0.0
    transient: float = 0.0
    action: Action | None = None

    @property
    def name(self) -> str:
        """``label``, or where it is empty the action's text form."""
        return self.label if self.label or self.action is None else str(self.action)


@dataclass
class Timeline:
    """Result of a replay.

    A replay may run each group of ranks in lockstep once (`harmonia.sim.lockstep`): ``replayed``
    then holds one representative's tasks per group, ``copies`` the other ranks of its group, and
    ``tasks``, ``start`` and ``end`` list every rank's tasks (the representatives' copied to their
    groups, built on first use). Per-rank results (``busy_s``, ``peak_mem``) cover every rank.

    Attributes:
        replayed: the replayed tasks.
        replayed_start, replayed_end: their times (seconds), arrays aligned with ``replayed``.
        ranks: rank ids in row order (every rank, copies included).
        iteration_s: time from 0 until the last task (compute or communication) ends.
        busy_s: per-rank compute-busy seconds.
        peak_mem: per-rank peak of activation bytes.
        copies: replayed rank -> the other ranks that run its tasks at the same times.
        copy_task: a replayed task as the given rank of its group runs it (default: the same task
            on that rank); its copies keep no dependencies.
    """

    replayed: list[Task]
    replayed_start: np.ndarray
    replayed_end: np.ndarray
    ranks: list[int]
    iteration_s: float
    busy_s: dict[int, float]
    peak_mem: dict[int, float]
    copies: dict[int, tuple[int, ...]] = field(default_factory=dict)
    copy_task: Callable[[Task, int], Task] | None = field(default=None, repr=False, compare=False)
    _every: tuple[list[Task], np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False,
                                                                      compare=False)

    @property
    def tasks(self) -> list[Task]:
        """Every rank's tasks: the replayed ones, then their copies on the other ranks of each group."""
        return self._expanded()[0]

    @property
    def start(self) -> np.ndarray:
        return self._expanded()[1]

    @property
    def end(self) -> np.ndarray:
        return self._expanded()[2]

    def _expanded(self) -> tuple[list[Task], np.ndarray, np.ndarray]:
        if not self.copies:
            return self.replayed, self.replayed_start, self.replayed_end
        if self._every is None:
            copy = self.copy_task or (lambda t, r: replace(t, rank=r, deps=[]))
            tasks, at = list(self.replayed), list(range(len(self.replayed)))
            for i, t in enumerate(self.replayed):
                for r in self.copies.get(t.rank, ()):
                    tasks.append(copy(t, r))
                    at.append(i)
            self._every = tasks, self.replayed_start[at], self.replayed_end[at]
        return self._every

    def weight(self, task: Task) -> int:
        """How many ranks run a replayed task (its rank and the copies)."""
        return 1 + len(self.copies.get(task.rank, ())) if self.copies else 1

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
        flops = sum(t.flops * self.weight(t) for t in self.replayed)
        n = devices if devices is not None else len(self.ranks)
        return flops / (self.iteration_s * peak_flops * n) if self.iteration_s else 0.0

    def module_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.replayed:
            if t.kind != "C":
                out[t.module] = out.get(t.module, 0.0) + t.duration * self.weight(t)
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
