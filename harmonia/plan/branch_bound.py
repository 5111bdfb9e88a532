"""The search's best-first branch and bound over (candidate, batch) refinements (the levels and the
argument that it finds the best plans: `harmonia.plan.search`), its costly refinements run by
`harmonia.plan.refiners`."""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Protocol

from harmonia.errors import HarmoniaError
from harmonia.plan.recipes import Candidate
from harmonia.plan.refiners import Outcome, Refiners
from harmonia.plan.search_keys import family_key, simulation_key


class Scorer(Protocol):
    """What the branch and bound asks of the search's scorer (`harmonia.plan.search._Scorer`)."""

    run: object
    peak_bytes: dict
    work_bounds: dict
    assignments: dict
    timelines: int

    def compute_bound(self, cand: Candidate) -> list[float]: ...
    def analytic(self, cand: Candidate, j: int) -> float: ...
    def twin_bound(self, cand: Candidate, j: int) -> float: ...
    def work(self, cand: Candidate, key: tuple, j: int) -> float: ...
    def simulate_part(self, cand: Candidate, key: tuple, j: int) -> tuple[float, bool]: ...
    def heavier_batches_over(self, cand: Candidate, key: tuple) -> str | None: ...
    def over_memory(self, key: tuple) -> str | None: ...
    def _record(self, key: tuple, nbytes: float) -> None: ...
    def assignments_since(self, n: int) -> dict: ...
    def absorb(self, assignments: dict) -> None: ...


LOOK_AHEAD = 64
"""Candidates a round of the parallel search passes over (their parts in a busy worker, or simulated
and waiting to be ranked) for one an idle worker can refine, before it waits for a refinement to end."""

COMPUTE, ANALYTIC, TWIN, WORK, PARTIAL, SIMULATED = 0, 1, 2, 3, 4, 5
"""What a candidate's value on one batch is: the compute-only bound, the analytic bound, the bound of
the batch's stage work of a twin recomputing less (`_Scorer.twin_bound`), the bound of its own stage
work, the longest of the independent parts simulated so far (`harmonia.sim.parts`), or the simulated
time (each at least the one before)."""


def branch_and_bound(scorer: Scorer, cands: list[Candidate], batches: list[int], top: int,
                     rejected: Counter, workers: int = 1) -> tuple[list[tuple[float, float, Candidate]], int, int]:
    """The ``top`` best candidates by mean simulated time over ``batches`` (`harmonia.plan.search` says why),
    the costly refinements in up to ``workers`` processes once they have taken
    `harmonia.plan.refiners.PARALLEL_AFTER_S` here.

    With workers, the candidates with the smallest bounds are refined at once; a candidate whose
    batches are all simulated is ranked only when no candidate popped before it is waiting or in
    flight (it may end below it: its bound only rises), so the ranking is the one-process search's;
    while it waits, the candidates after it are refined where further plans are to be ranked (the
    search would refine them next). The number simulated may differ.

    Returns:
        (ranked candidates, candidates simulated at least once, processes that refined them).
    """
    search = _BranchAndBound(scorer, cands, len(batches), top, rejected)
    with Refiners(search.refine, workers, absorb=scorer.absorb) as refiners:
        while len(search.ranked) < top and (search.heap or refiners.in_flight()):
            search.round(refiners)
            if refiners.in_flight() and len(search.ranked) < top:
                search.settle(refiners.wait())
        used = refiners.workers if refiners.started else 1
    return search.ranked, len(search.touched), used


class _BranchAndBound:
    """The state of `branch_and_bound`: every candidate's ``[level, value]`` per batch, the heap of
    their bounds, the plans ranked and the candidates that failed."""

    def __init__(self, scorer: Scorer, cands: list[Candidate], n_batches: int, top: int, rejected: Counter) -> None:
        self.scorer, self.cands, self.n_batches, self.top, self.rejected = scorer, cands, n_batches, top, rejected
        cost = scorer.run.cost
        self.keys = [simulation_key(c, cost) for c in cands]
        self.states: dict[tuple, list[list]] = {}
        for cand, key in zip(cands, self.keys):
            if key not in self.states:
                self.states[key] = [[COMPUTE, b] for b in scorer.compute_bound(cand)]
        self.failed: dict[tuple, str] = {}
        self.touched: set[int] = set()
        self.ranked: list[tuple[float, float, Candidate]] = []
        self.heap = [(self.bound_of(i), i) for i in range(len(cands))]
        heapq.heapify(self.heap)

    def bound_of(self, i: int) -> float:
        return sum(v for _, v in self.states[self.keys[i]]) / self.n_batches

    def fail(self, i: int, why: str) -> None:
        self.failed[self.keys[i]] = why
        self.rejected[why] += 1

    def round(self, refiners: Refiners) -> None:
        """Pop candidates in bound order while a refinement can be submitted: refine the cheap levels
        here, submit the costly ones, rank a simulated candidate nothing before it may end below."""
        waiting = []  # popped, not refinable now: back on the heap once the round ends
        while self.heap and refiners.idle() and len(waiting) < LOOK_AHEAD:
            value, i = heapq.heappop(self.heap)
            key = self.keys[i]
            if key in self.failed:
                self.rejected[self.failed[key]] += 1
                continue
            current = self.bound_of(i)
            if current > value:  # a shared refinement raised it since it was pushed
                heapq.heappush(self.heap, (current, i))
                continue
            state = self.states[key]
            j = min(range(self.n_batches), key=lambda j: state[j][0])
            level = state[j][0]
            if level == SIMULATED and (waiting or refiners.in_flight_before((value, i))):
                waiting.append((value, i))  # one popped or in flight before it may end below it
                if len(self.ranked) + 1 >= self.top:  # nothing after it counts until it is ranked
                    break
            elif level == SIMULATED:
                self._rank(i, current)
                if len(self.ranked) == self.top:
                    break
            elif level == COMPUTE:
                self._refine_here(i, j)
            elif level == ANALYTIC and (twin := self.scorer.twin_bound(self.cands[i], j)) > state[j][1]:
                state[j] = [TWIN, twin]  # cheap: here
                heapq.heappush(self.heap, (self.bound_of(i), i))
            elif refiners.can_take(i, j):
                if level >= WORK:
                    self.touched.add(i)
                refiners.submit(i, j, level, state[j][1], (value, i))
            else:  # its parts are in a busy worker
                waiting.append((value, i))
        for entry in waiting:
            heapq.heappush(self.heap, entry)

    def _rank(self, i: int, seconds: float) -> None:
        """Rank a simulated candidate, unless it would run out of memory on a batch heavier than
        those it was timed on."""
        try:
            over = self.scorer.heavier_batches_over(self.cands[i], self.keys[i])
        except HarmoniaError as err:
            over = f"schedule: {err}"[:80]
        if over:
            self.fail(i, over)
        else:
            self.ranked.append((seconds, self.scorer.run.scenario.global_batch / seconds, self.cands[i]))

    def _refine_here(self, i: int, j: int) -> None:
        """The cheap level after the compute-only bound: the analytic bound, here."""
        state = self.states[self.keys[i]]
        try:
            state[j] = [ANALYTIC, max(state[j][1], self.scorer.analytic(self.cands[i], j))]
        except HarmoniaError as err:
            return self.fail(i, f"schedule: {err}"[:80])
        heapq.heappush(self.heap, (self.bound_of(i), i))

    def refine(self, i: int, j: int, level: int, value: float) -> Outcome:
        """The costly levels (the work bound, a part's simulation) of candidate ``i``'s batch ``j``, in
        a worker or here, with what the searching process needs of the scorer's state."""
        scorer, cand, key = self.scorer, self.cands[i], self.keys[i]
        family, timelines = (family_key(cand, scorer.run.cost), j), scorer.timelines
        found, assigned = len(scorer.work_bounds.get(family, ())), len(scorer.assignments)
        try:
            if level in (ANALYTIC, TWIN):
                state = [WORK, max(value, scorer.work(cand, key, j))]
            else:
                seconds, whole = scorer.simulate_part(cand, key, j)
                state = [SIMULATED, seconds] if whole else [PARTIAL, max(value, seconds)]
        except HarmoniaError as err:
            return Outcome(i, j, error=f"schedule: {err}"[:80])
        bounds = scorer.work_bounds.get(family, ())
        return Outcome(i, j, state, peak=scorer.peak_bytes.get(key, 0.0),
                       work_bound=(family, bounds[-1]) if len(bounds) > found else None,
                       timelines=scorer.timelines - timelines, shared=scorer.assignments_since(assigned))

    def settle(self, done: Outcome) -> None:
        """A costly refinement's outcome into the search (from a worker: its scorer's findings too)."""
        i, key, scorer = done.i, self.keys[done.i], self.scorer
        if done.error is not None:
            return self.fail(i, done.error)
        self.states[key][done.j] = done.state
        scorer._record(key, done.peak)
        if done.remote:  # the worker's scorer found them; this one's twins' bounds use them
            scorer.timelines += done.timelines
            if done.work_bound is not None:
                scorer.work_bounds.setdefault(done.work_bound[0], []).append(done.work_bound[1])
            if done.shared:
                scorer.absorb(done.shared)
        over = scorer.over_memory(key)
        if over:  # a plan that cannot run on the devices is no plan, whatever its time
            return self.fail(i, over)
        heapq.heappush(self.heap, (self.bound_of(i), i))
