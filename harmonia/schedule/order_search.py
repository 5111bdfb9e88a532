"""Per-batch schedule search: the pipeline order, family and encoder sub-microbatches that finish this
batch soonest.

For each LLM replica the balancer has already fixed which samples form which microbatch; what is
left is the order the microbatches enter the pipeline and the schedule family. The search scores
candidates with the generators' own replay (`harmonia.schedule.makespan`, free communication), which
costs a few milliseconds, so it fits a budget of ~100 ms per batch:

1. seeds: the given order, light-heavy-light ("light ones at both ends" shortens warm-up and
   cool-down), heavy-first and light-first, each under every allowed family;
2. local search from the best seed: swap two microbatches, keep the swap if the makespan drops;
   random pairs until the budget is spent (deterministic for a seed). A schedule is only scored
   when one more, timed like the mean one so far, still fits the budget.

The result is never worse than the starting order under its family, because that order is a seed.
`search_submicrobatches` then picks each encoder's sub-microbatch count the same way (by replay).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from harmonia.schedule.costs import CostTable
from harmonia.schedule.families import build_schedule
from harmonia.schedule.graph import IterationSchedule, StageGraph
from harmonia.schedule.plan import Plan
from harmonia.schedule.replay import makespan
from harmonia.schedule.stagework import IterationWork, cost_table, with_submicrobatches
from harmonia.workload.cost import CostModel


@dataclass(frozen=True)
class SearchResult:
    """The best order and family found, and what the starting point scored."""

    order: list[int]
    family: str
    makespan_s: float
    start_makespan_s: float
    evaluated: int
    seconds: float


def light_ends_order(weights: list[float]) -> list[int]:
    """Heaviest in the middle, lightest at both ends: alternate sorted items to the two ends."""
    ranked = sorted(range(len(weights)), key=lambda i: weights[i])
    left, right = [], []
    for k, i in enumerate(ranked):
        (left if k % 2 == 0 else right).append(i)
    return left + right[::-1]


def search_order(graph: StageGraph, costs: CostTable, n_microbatches: int, families: tuple[str, ...] = ("1f1b",),
                 start: list[int] | None = None, budget_s: float = 0.1, seed: int = 0,
                 max_evaluations: int | None = None) -> SearchResult:
    """Search the microbatch order (and family) minimising the replayed makespan.

    Args:
        graph: one LLM replica's stage graph.
        costs: per-microbatch stage durations (from the cost model).
        n_microbatches: microbatches of the replica.
        families: schedule families allowed; the first is the starting point's.
        start: starting order (default 0..n-1).
        budget_s: wall-clock budget.
        seed: seed of the random swaps.
        max_evaluations: stop after this many schedules (makes the result independent of speed).
    """
    t0 = time.perf_counter()
    limit = max_evaluations or 1 << 30

    def spent() -> bool:
        """True when the next schedule, timed like the mean one so far, would overrun the budget."""
        elapsed = time.perf_counter() - t0
        return elapsed * (1 + 1 / max(evaluated, 1)) > budget_s or evaluated >= limit

    start = list(range(n_microbatches)) if start is None else list(start)
    weights = [sum(costs.phase("llm", s, m).F + costs.phase("llm", s, m).B + costs.phase("llm", s, m).W
                   for s in range(graph.llm.n_stages)) for m in range(n_microbatches)]
    evaluated = 0

    def score(order: list[int], family: str) -> float:
        nonlocal evaluated
        evaluated += 1
        return makespan(build_schedule(graph, n_microbatches, family, order=order, costs=costs), costs)

    start_s = score(start, families[0])
    best = (start_s, start, families[0])
    seeds = [start, light_ends_order(weights), sorted(range(n_microbatches), key=lambda m: -weights[m]),
             sorted(range(n_microbatches), key=lambda m: weights[m])]
    for family in families:
        for order in seeds:
            if spent():
                break
            s = score(order, family)
            if s < best[0] - 1e-12:
                best = (s, order, family)
    rng = np.random.default_rng(seed)
    best_s, order, family = best
    while n_microbatches > 2 and not spent():
        i, j = rng.choice(n_microbatches, size=2, replace=False)
        trial = list(order)
        trial[i], trial[j] = trial[j], trial[i]
        s = score(trial, family)
        if s < best_s - 1e-12:
            best_s, order = s, trial
    return SearchResult(order, family, best_s, start_s, evaluated, time.perf_counter() - t0)


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
