"""Replay where a node's ranks share fewer compute units than they are: processor sharing.

A CPU job's processes on one machine share its cores (`ClusterSpec.cores`): while ``k`` of a node's
ranks compute at once on ``c`` cores, each advances at ``min(1, c / k)`` of its own rate (the
kernel's fair scheduler, Kleinrock's processor sharing), so a task's ``duration`` is its work (the
seconds it takes alone on a core) and its wall time stretches with the compute beside it. A rank's
process also spends CPU outside its compute (preparing the next step, the optimizer, the
collectives' threads: `Calibration.host_cpu_s`, measured): that work runs from the step's start on
the cores the node's compute leaves free, shared evenly by the ranks with some left, and what is
left when the tasks are done runs on after them (measured on the demo job, a rank's compute actions
last about as long beside it as without it: it mostly fills the gaps between them).
Communication, transfers and barriers take no core. With at least as many cores as ranks and no
other work this is `harmonia.sim.engine.replay`'s result; the cost is O(events x queues) instead of its O(tasks + edges),
for the few ranks one machine holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping

import numpy as np

from harmonia.sim.engine import Task, Timeline, deadlock, peak_memory, queues_of

_TIE = 1e-12
"""Relative tolerance under which two events happen at once."""


def replay_shared(tasks: list[Task], order: dict[int, list[int]], comm_order: Mapping[Hashable, list[int]] | None,
                  node_of: Callable[[int], int], cores: int, host_s: Mapping[int, float] | None = None) -> Timeline:
    """`harmonia.sim.engine.replay` with each node's compute shared by ``cores`` (module docstring).

    Args:
        tasks, order, comm_order: as `harmonia.sim.engine.replay` takes them.
        node_of: rank -> its node.
        cores: compute units per node.
        host_s: rank -> CPU seconds its process spends beside its compute in the step.

    Returns:
        The timeline; ``busy_s`` is each rank's wall time inside its compute tasks; the step lasts
        until its last task or the last rank's other work ends, whichever is later.
    """
    run = _SharedRun(tasks, queues_of(tasks, order, comm_order), node_of, cores,
                     {r: s for r, s in (host_s or {}).items() if r in order and s > 0})
    run.until_done()
    start, end = np.asarray(run.start), np.asarray(run.end)
    ranks = sorted({t.rank for t in tasks} | set(order))
    busy = {r: 0.0 for r in ranks}
    for t, s, e in zip(tasks, run.start, run.end):
        if t.kind != "C":
            busy[t.rank] += e - s
    return Timeline(tasks, start, end, ranks, max(float(end.max()) if tasks else 0.0, run.host_end), busy,
                    peak_memory(tasks, end, ranks))


class _SharedRun:
    """The event loop: start what can start now, advance to the next end or arrival, repeat."""

    def __init__(self, tasks: list[Task], queues: dict[tuple, list[int]], node_of: Callable[[int], int],
                 cores: int, host_s: dict[int, float]) -> None:
        self.tasks, self.queues, self.node_of, self.cores = tasks, queues, node_of, cores
        self.host = dict(host_s)  # rank -> CPU seconds of its process's other work still to run
        n = len(tasks)
        self.remaining = [len(t.deps) for t in tasks]
        self.ready_at = [0.0] * n
        self.children: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        for i, t in enumerate(tasks):
            for d, delay in t.deps:
                self.children[d].append((i, delay))
        self.start, self.end = [math.nan] * n, [math.nan] * n
        self.head = {key: 0 for key in queues}
        self.running: dict[tuple, int] = {}  # queue -> its task now running
        self.left: dict[int, float] = {}  # running compute task -> work seconds left
        self.now = 0.0
        self.host_end = 0.0  # when the last rank's other work ended
        self.done = 0

    def until_done(self) -> None:
        while True:
            self._start_ready()
            rates, host = self._rates(), self._host_rates()  # fixed until the next event
            step = self._next_event(rates, host)
            if step is None:
                break
            self._advance(step, rates, host)
        if self.done < len(self.tasks):
            raise deadlock(self.tasks, self.queues, self.head, self.end)

    def _start_ready(self) -> None:
        """Start every queue's head that is free to run now; tasks of no time end at once."""
        started = True
        while started:
            started = False
            for key, q in self.queues.items():
                if key in self.running or self.head[key] >= len(q):
                    continue
                i = q[self.head[key]]
                if self.remaining[i] or self.ready_at[i] > self.now:
                    continue
                self.start[i] = self.now
                started = True
                if self.tasks[i].duration <= 0:
                    self._finish(key, i)
                else:
                    self.running[key] = i
                    self.left[i] = self.tasks[i].duration

    def _computing(self) -> dict[int, int]:
        """Node -> compute tasks running on it now."""
        out: dict[int, int] = {}
        for key, i in self.running.items():
            if key[0] == "c":
                node = self.node_of(self.tasks[i].rank)
                out[node] = out.get(node, 0) + 1
        return out

    def _rates(self) -> dict[int, float]:
        """Each running task's rate: 1 for communication, the node's share of its cores for compute."""
        computing = self._computing()
        return {i: min(1.0, self.cores / computing[self.node_of(self.tasks[i].rank)]) if key[0] == "c" else 1.0
                for key, i in self.running.items()}

    def _host_rates(self) -> dict[int, float]:
        """Each rank's other work's rate: its share of the cores its node's compute leaves free."""
        computing, waiting = self._computing(), {}
        for r in self.host:
            waiting[self.node_of(r)] = waiting.get(self.node_of(r), 0) + 1
        return {r: min(1.0, max(0.0, self.cores - computing.get(self.node_of(r), 0)) / waiting[self.node_of(r)])
                for r in self.host}

    def _next_event(self, rates: dict[int, float], host: dict[int, float]) -> float | None:
        """Seconds to the next task end or arrival at these rates; None when nothing runs or waits."""
        times = [self.left[i] / rates[i] for i in self.running.values()]
        times += [left / host[r] for r, left in self.host.items() if host[r] > 0]
        for key, q in self.queues.items():
            if key not in self.running and self.head[key] < len(q):
                i = q[self.head[key]]
                if not self.remaining[i] and self.ready_at[i] > self.now:
                    times.append(self.ready_at[i] - self.now)
        return min(times) if times else None

    def _advance(self, step: float, rates: dict[int, float], host: dict[int, float]) -> None:
        """Move time on by ``step``: work done at each running task's rate, the tasks it ends finished."""
        self.now += step
        for r in list(self.host):
            self.host[r] -= step * host[r]
            if self.host[r] <= _TIE * max(step, 1e-9):
                del self.host[r]
                self.host_end = self.now
        for key, i in list(self.running.items()):
            self.left[i] -= step * rates[i]
            if self.left[i] <= _TIE * max(self.tasks[i].duration, step):
                del self.running[key], self.left[i]
                self._finish(key, i)

    def _finish(self, key: tuple, i: int) -> None:
        self.end[i] = self.now
        self.head[key] += 1
        self.done += 1
        for c, delay in self.children[i]:
            self.remaining[c] -= 1
            self.ready_at[c] = max(self.ready_at[c], self.now + delay)
