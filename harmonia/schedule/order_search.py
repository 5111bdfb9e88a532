"""Per-batch schedule search: the pipeline order, family and encoder sub-microbatches that finish this
batch soonest.

For each LLM replica the balancer has already fixed which samples form which microbatch; what is
left is the order the microbatches enter the pipeline and the schedule family. The search scores
candidates with the generators' own replay (`harmonia.schedule.makespan`, free communication), which
costs milliseconds, so it fits a budget of ~100 ms per batch:

1. seeds: the given order, light-heavy-light ("light ones at both ends" shortens warm-up and
   cool-down), heavy-first and light-first, each under every allowed family;
2. local search from the best seed: swap two microbatches, keep the swap if the makespan drops;
   random pairs until the budget is spent (deterministic for a seed).

The budget holds at every scale: a schedule is only scored when one more, timed like the slowest
so far, still fits; the first one (the starting order) only when a `ReplayRate` (kept by the caller
across batches, else timed on a few microbatches) expects it and one more to fit, else the
starting order is kept unscored; nothing is scored
where every order finishes alike (one rank holds every stage, or every microbatch costs the same
everywhere); and the garbage collector is paused meanwhile.

The result is never worse than the starting order under the replay, because that order is scored
first and only a strictly shorter makespan replaces it. The replay is not the simulator (it sees no
messages and one schedule's slowest-replica costs), so a caller that times the step with the
simulator passes it as ``step``: the search's pick then replaces the starting order only if it is
strictly faster there too, and the step reported can never be worse than the default order's.
`search_submicrobatches` then picks each encoder's sub-microbatch count the same way (by replay, or
by the simulated step).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from harmonia.schedule.costs import CostTable
from harmonia.schedule.families import build_schedule
from harmonia.schedule.graph import IterationSchedule, StageGraph
from harmonia.schedule.plan import Plan
from harmonia.schedule.replay import makespan
from harmonia.schedule.stagework import IterationWork, cost_table, plan_graph, with_submicrobatches
from harmonia.workload.cost import CostModel


@dataclass(frozen=True)
class SearchResult:
    """The best order and family found, and what the starting point scored.

    Attributes:
        order: microbatch order to run.
        family: schedule family to run it under.
        makespan_s: the replayed makespan of ``order`` (NaN when no schedule was replayed).
        start_makespan_s: the replayed makespan of the starting order (NaN when not replayed).
        evaluated: schedules replayed.
        seconds: wall-clock seconds of the search.
        step_s: ``step`` of the pick the replay found, when it differed from the start (else NaN).
        start_step_s: ``step`` of the starting order, when the pick was checked against it (else NaN).
    """

    order: list[int]
    family: str
    makespan_s: float
    start_makespan_s: float
    evaluated: int
    seconds: float
    step_s: float = math.nan
    start_step_s: float = math.nan


@dataclass
class ReplayRate:
    """Seconds one schedule evaluation (build and replay) takes per stage-microbatch unit (a stage's
    holder times a microbatch): what a search expects its first schedule to cost before building
    it. The caller keeps one across batches; every search that replays updates it."""

    seconds_per_unit: float = 0.0
    """0: not measured yet (the next search times a small schedule first)."""

    def expect(self, units: int) -> float:
        """Expected seconds of one evaluation of ``units`` stage-microbatch units (0 when unknown)."""
        return self.seconds_per_unit * units

    def observe(self, seconds: float, units: int) -> None:
        """Record one evaluation's seconds."""
        self.seconds_per_unit = seconds / max(units, 1)

    def calibrate(self, graph: StageGraph, costs: CostTable, n_microbatches: int, family: str) -> None:
        """Time a schedule of the graph's first few microbatches (a few per cent of a full one):
        what the first search expects before any batch has measured the rate."""
        n = min(n_microbatches, 4)
        t = time.perf_counter()
        makespan(build_schedule(graph, n, family, order=list(range(n)), costs=costs), costs)
        self.observe(time.perf_counter() - t, n * sum(len(graph.holders_of(s)) for s in graph.stages()))

    def skipped(self) -> None:
        """A search kept its start unscored: expect a little less next time, so that one slow
        measurement (a busy machine) does not stop every later search."""
        self.seconds_per_unit *= 0.75


def light_ends_order(weights: list[float]) -> list[int]:
    """Heaviest in the middle, lightest at both ends: alternate sorted items to the two ends."""
    ranked = sorted(range(len(weights)), key=lambda i: weights[i])
    left, right = [], []
    for k, i in enumerate(ranked):
        (left if k % 2 == 0 else right).append(i)
    return left + right[::-1]


def order_free(graph: StageGraph, costs: CostTable, n_microbatches: int, families: Sequence[str]) -> bool:
    """Whether every order (and family) replays to the same makespan, so none need be scored.

    One rank holding every stage runs all its work back to back whatever the order (its list is
    in dependency order, so it never waits; a fused BW lasts B + W, so the family does not matter
    either). Microbatches that cost the same on every stage and every holder's share make any
    order a relabelling of the starting one (under a single family).
    """
    if len(graph.ranks()) == 1:
        return True
    if len(families) > 1:
        return False
    stages = graph.stages()
    first = [costs.phase(s.module, s.stage, 0) for s in stages]
    if any([costs.phase(s.module, s.stage, m) for s in stages] != first for m in range(1, n_microbatches)):
        return False
    shares: dict[tuple, set] = {}
    counts: dict[tuple, int] = {}
    for (rank, module, stage, m), share in costs.shares.items():
        if m < n_microbatches:
            shares.setdefault((rank, module, stage), set()).add(share)
            counts[(rank, module, stage)] = counts.get((rank, module, stage), 0) + 1
    return all(len(v) == 1 and counts[k] == n_microbatches for k, v in shares.items())


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (a collection mid-search would cost a sizeable part of
    the budget; the search makes no cycles that must be freed meanwhile)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


OrderStep = Callable[[list[int], str], float]
"""Seconds of the iteration run in an order under a family (the simulator's step)."""


def search_order(graph: StageGraph, costs: CostTable, n_microbatches: int, families: tuple[str, ...] = ("1f1b",),
                 start: list[int] | None = None, budget_s: float = 0.1, seed: int = 0,
                 max_evaluations: int | None = None, rate: ReplayRate | None = None,
                 step: OrderStep | None = None, started: float | None = None) -> SearchResult:
    """Search the microbatch order (and family) minimising the replayed makespan.

    Args:
        graph: one LLM replica's stage graph.
        costs: per-microbatch stage durations (from the cost model).
        n_microbatches: microbatches of the replica.
        families: schedule families allowed; the first is the starting point's.
        start: starting order (default 0..n-1): the default the result is never worse than.
        budget_s: wall-clock budget, counted from ``started`` (default: the call).
        seed: seed of the random swaps.
        max_evaluations: stop after this many schedules (makes the result independent of speed).
        rate: what one evaluation costs, kept by the caller across batches (see `ReplayRate`;
            default: timed on a few microbatches in this call).
        step: the final score (the simulator's step): the pick replaces ``start`` only if strictly
            faster under it too (two calls beyond the budget, only when the pick differs).
        started: `time.perf_counter` value the budget runs from (work the caller did for the search).
    """
    t0 = time.perf_counter() if started is None else started
    start = list(range(n_microbatches)) if start is None else list(start)
    with gc_paused():
        found = _search(graph, costs, n_microbatches, families, start, budget_s, seed,
                        max_evaluations or 1 << 30, rate, t0)
        if step is None or (found.order, found.family) == (start, families[0]):
            return found
        start_step, found_step = step(start, families[0]), step(found.order, found.family)
    if found_step < start_step - 1e-12:
        return SearchResult(found.order, found.family, found.makespan_s, found.start_makespan_s, found.evaluated,
                            time.perf_counter() - t0, found_step, start_step)
    return SearchResult(start, families[0], found.start_makespan_s, found.start_makespan_s, found.evaluated,
                        time.perf_counter() - t0, start_step, start_step)


def _search(graph: StageGraph, costs: CostTable, n_microbatches: int, families: tuple[str, ...], start: list[int],
            budget_s: float, seed: int, limit: int, rate: ReplayRate | None, t0: float) -> SearchResult:
    """`search_order` under the replay alone."""
    if order_free(graph, costs, n_microbatches, families):
        return SearchResult(start, families[0], math.nan, math.nan, 0, time.perf_counter() - t0)
    units = n_microbatches * sum(len(graph.holders_of(s)) for s in graph.stages())
    rate = ReplayRate() if rate is None else rate
    if math.isfinite(budget_s) and rate.seconds_per_unit <= 0 and time.perf_counter() - t0 < budget_s:
        rate.calibrate(graph, costs, n_microbatches, families[0])
    if time.perf_counter() - t0 + 2 * rate.expect(units) > budget_s:  # the start and one more, or nothing
        rate.skipped()
        return SearchResult(start, families[0], math.nan, math.nan, 0, time.perf_counter() - t0)
    evaluated, slowest, spent_s = 0, 0.0, 0.0

    def fits() -> bool:
        """True when one more schedule, timed like the slowest so far, still fits the budget."""
        return time.perf_counter() - t0 + slowest <= budget_s and evaluated < limit

    def score(order: list[int], family: str) -> float:
        nonlocal evaluated, slowest, spent_s
        t = time.perf_counter()
        s = makespan(build_schedule(graph, n_microbatches, family, order=order, costs=costs), costs)
        took = time.perf_counter() - t
        evaluated, slowest, spent_s = evaluated + 1, max(slowest, took), spent_s + took
        return s

    weights = [sum(costs.phase("llm", s, m).F + costs.phase("llm", s, m).B + costs.phase("llm", s, m).W
                   for s in range(graph.llm.n_stages)) for m in range(n_microbatches)]
    start_s = score(start, families[0])
    best = (start_s, start, families[0])
    seeds = [start, light_ends_order(weights), sorted(range(n_microbatches), key=lambda m: -weights[m]),
             sorted(range(n_microbatches), key=lambda m: weights[m])]
    for family in families:
        for order in seeds:
            if (order, family) == (start, families[0]):
                continue
            if not fits():
                break
            s = score(order, family)
            if s < best[0] - 1e-12:
                best = (s, order, family)
    rng = np.random.default_rng(seed)
    best_s, order, family = best
    while n_microbatches > 2 and fits():
        i, j = rng.choice(n_microbatches, size=2, replace=False)
        trial = list(order)
        trial[i], trial[j] = trial[j], trial[i]
        s = score(trial, family)
        if s < best_s - 1e-12:
            best_s, order = s, trial
    rate.observe(spent_s / evaluated, units)
    return SearchResult(order, family, best_s, start_s, evaluated, time.perf_counter() - t0)


def search_batch_order(plan: Plan, cost: CostModel, iw: IterationWork, budget_s: float,
                       rate: ReplayRate | None = None, step: OrderStep | None = None) -> SearchResult:
    """The per-batch search's microbatch order for one iteration's stage work under a plan (its
    schedule family), within ``budget_s`` counted from the call (building the stage graph and the
    cost table included): every LLM replica runs it, one schedule serving all of them. ``rate`` and
    ``step`` as in `search_order`."""
    t0 = time.perf_counter()
    with gc_paused():
        graph = plan_graph(plan, cost)
        table = cost_table(plan, iw)
    return search_order(graph, table, iw.n_microbatches, (plan.schedule,), budget_s=budget_s, rate=rate,
                        step=step, started=t0)


SUB_OPTIONS = (1, 2, 4)
"""Sub-microbatches per microbatch an encoder may be split into."""


@dataclass(frozen=True)
class SubSearch:
    """Each encoder's sub-microbatch count the search chose, the stage work with it, and the scores.

    Attributes:
        n_sub: encoder -> sub-microbatches of every microbatch (1: not split).
        work: the iteration's stage work under that split (its `IterationWork.sub_runs` are the cuts).
        makespan_s: the replayed step with the split.
        start_makespan_s: the replayed step without splitting.
        evaluated: splits replayed.
    """

    n_sub: dict[str, int]
    work: IterationWork
    makespan_s: float
    start_makespan_s: float
    evaluated: int


StepScore = Callable[[IterationWork, IterationSchedule], float]
"""Seconds of one iteration's stage work under a schedule (the simulator's step, or the replay)."""


def replayed_step(work: IterationWork, schedule: IterationSchedule) -> float:
    """The schedule's replay under its own costs (communication free)."""
    return makespan(schedule, schedule.costs)


def search_submicrobatches(graph: StageGraph, plan: Plan, cost: CostModel, work: IterationWork,
                           order: Sequence[int] | None = None, options: Sequence[int] = SUB_OPTIONS,
                           budget_s: float = float("inf"), max_evaluations: int | None = None,
                           score: StepScore = replayed_step) -> SubSearch:
    """Split each encoder's microbatches into the sub-microbatch count that finishes the batch soonest.

    DIP's idea, chosen by cost: pieces of a microbatch pipeline through an encoder's stages and fit
    into the gaps of the ranks it shares with the LLM, but every piece pays its own messages, which
    the replay does not see: callers that can simulate pass the simulator's step as ``score``
    (`harmonia.sim.tasks.simulate_schedule`). The search scores the schedule (the plan's family,
    ``order``, costs from the stage work of each split of ``work``'s batch, items cut by cost:
    `harmonia.schedule.submicrobatch.item_runs`) with each count of ``options`` for one encoder
    after another, keeping a count only where it shortens the step; so the result is never worse
    than no split under ``score``. Stops when an evaluation, timed like the mean one so far, would
    overrun ``budget_s`` or after ``max_evaluations`` evaluations.
    """
    t0 = time.perf_counter()
    n = work.n_microbatches
    limit = max_evaluations or 1 << 30

    def evaluate(iw: IterationWork) -> float:
        table = cost_table(plan, iw)
        return score(iw, build_schedule(graph, n, plan.schedule, order=order, costs=table, n_sub=iw.n_sub or None))

    best = {e: max(work.n_sub.get(e, (1,))) for e in plan.encoders}
    best_iw = work
    start_s = best_s = evaluate(work)
    evaluated = 1
    for e in plan.encoders:
        for k in options:
            elapsed = time.perf_counter() - t0
            if k == best[e] or evaluated >= limit or elapsed * (1 + 1 / evaluated) > budget_s:
                continue
            iw = with_submicrobatches(best_iw, plan, cost, e, (k,) * n)
            s = evaluate(iw)
            evaluated += 1
            if s < best_s - 1e-12:
                best, best_s, best_iw = {**best, e: k}, s, iw
    return SubSearch(best, best_iw, best_s, start_s, evaluated)
