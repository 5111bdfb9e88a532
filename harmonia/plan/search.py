"""`harmonia plan`: one static layout from batch-level profiling, scored by the simulator.

Candidates are harmonia's own (disjoint rank sets sized by work share and colocated encoders,
every LLM factorisation that fits memory, frozen-aware stage splits, 1F1B or zero-bubble). A
candidate's score is its simulated iteration time averaged over the ``K`` profiled search batches.

The search is best-first branch and bound over (candidate, batch) simulations, and finds the same
best plan as simulating every candidate on every batch:

- every candidate has, per batch ``k``, a lower bound ``b_k`` on its simulated time
  (`harmonia.plan.bounds.plan_bound`: compute, TP/CP collectives, FSDP gathers and the DP
  gradient reduction of the busiest rank; and the compute-only `lower_bound_s`), computed
  without simulating;
- a candidate's bound on its score is ``mean_k (t_k if batch k is simulated else b_k)``; it only
  rises as batches are simulated, and equals the score once all are;
- the candidate with the smallest bound is refined next: its next batch is simulated. When the
  candidate popped has every batch simulated, its score is at most every other candidate's bound,
  hence at most every other score: it is the best. Popping on gives the next best, up to ``top``.

So a layout whose first simulated batch already exceeds the best score is never simulated again,
and one whose bound exceeds it is never simulated at all. Plans the simulator cannot tell apart
(zero-bubble where no stage has both an input and a weight gradient: it runs as 1F1B) share one
simulation.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from harmonia.errors import HarmoniaError, LayoutError
from harmonia.plan.bounds import plan_bound
from harmonia.plan.candidates import lower_bound_s
from harmonia.plan.plan import Plan
from harmonia.schedule import StageGraph
from harmonia.sim.orders import stage_trainable
from harmonia.sim.recipes import Candidate, candidates, homogeneous_candidates
from harmonia.sim.scenario import Scenario, ScenarioRun
from harmonia.workload.cost import CostModel
from harmonia.workload.shapes import SampleShape


@dataclass
class PlanReport:
    """The chosen plan, the ranked candidates and why others were dropped.

    Attributes:
        best: the plan with the smallest mean simulated iteration time.
        ranked: the ``top`` best candidates, best first, as (iteration s, samples/s, candidate).
        rejected: reasons candidates were dropped (memory, an ``accept`` filter, a schedule error).
        simulated: candidates simulated on at least one batch.
        pruned: candidates never simulated (their lower bound exceeded the scores ranked).
        timelines: single-batch simulations run (``simulated * batches`` at most).
        seconds: wall-clock time of the search.
    """

    best: Plan
    ranked: list[tuple[float, float, Candidate]]
    rejected: Counter = field(default_factory=Counter)
    simulated: int = 0
    pruned: int = 0
    timelines: int = 0
    seconds: float = 0.0


def search_plan(scenario: Scenario, top: int = 10, accept: Callable[[Plan], str | None] | None = None,
                samples: list[SampleShape] | None = None, homogeneous: bool = False) -> PlanReport:
    """Search harmonia's candidates for a scenario.

    Args:
        top: candidates ranked exactly (each one further costs the simulations of the candidates
            whose bound is below its score).
        accept: optional filter: returns None for a plan the caller can run, else the reason it
            cannot (counted in ``rejected``), e.g. a runtime that supports only some layouts.
        samples: sample shapes to profile instead of the scenario's trace (a dataset's own).
        homogeneous: search only plans with one layout for all modules (each encoder on the LLM's
            first pipeline stage with the LLM's tp and dp), the baseline per-module layouts beat.

    Raises:
        LayoutError: when no candidate fits, naming what to change.
    """
    t0 = time.perf_counter()
    run = ScenarioRun(scenario, samples)
    rejected: Counter = Counter()
    enumerate_ = homogeneous_candidates if homogeneous else _harmonia_candidates
    cands = list(enumerate_(run.cost, run.cluster, run.profile, scenario.global_batch, scenario.model, rejected))
    if accept is not None:
        kept = []
        for c in cands:
            reason = accept(c.plan)
            if reason is None:
                kept.append(c)
            else:
                rejected[reason] += 1
        cands = kept
    if not cands:
        raise _no_layout_error(scenario, rejected, homogeneous)
    batches = list(range(scenario.iterations, scenario.iterations + scenario.search_batches))
    ranked, simulated, timelines = _branch_and_bound(run, cands, batches, top, rejected)
    if not ranked:
        raise LayoutError(f"no candidate layout of {scenario.model} on {scenario.cluster} could be scheduled "
                          f"({dict(rejected)}); change the global batch or the cluster")
    return PlanReport(ranked[0][2].plan, ranked, rejected, simulated, len(cands) - simulated, timelines,
                      time.perf_counter() - t0)


def _harmonia_candidates(cost, cluster, profile, global_batch, model, rejected):
    return candidates("harmonia", cost, cluster, profile, global_batch, model, rejected)


def _branch_and_bound(run: ScenarioRun, cands: list[Candidate], batches: list[int], top: int,
                      rejected: Counter) -> tuple[list[tuple[float, float, Candidate]], int, int]:
    """The ``top`` best candidates by mean simulated time over ``batches`` (see the module docstring).

    Returns:
        (ranked candidates, candidates simulated at least once, single-batch simulations run).
    """
    n_batches = len(batches)
    keys = [simulation_key(c, run.cost) for c in cands]
    bounds = _batch_bounds(run, cands, keys, batches)  # (candidate, batch) -> lower bound
    times: dict[tuple, list[float | None]] = {k: [None] * n_batches for k in keys}
    failed: dict[tuple, str] = {}
    touched: set[int] = set()
    timelines = 0

    def bound_of(i: int) -> float:
        t = times[keys[i]]
        return sum(bounds[i][j] if t[j] is None else t[j] for j in range(n_batches)) / n_batches

    heap = [(bound_of(i), i) for i in range(len(cands))]
    heapq.heapify(heap)
    ranked: list[tuple[float, float, Candidate]] = []
    while heap and len(ranked) < top:
        value, i = heapq.heappop(heap)
        key = keys[i]
        if key in failed:
            rejected[failed[key]] += 1
            continue
        current = bound_of(i)
        if current > value:  # a shared simulation raised it since it was pushed
            heapq.heappush(heap, (current, i))
            continue
        t = times[key]
        if None not in t:
            ranked.append((current, run.scenario.global_batch / current, cands[i]))
            continue
        j = t.index(None)
        touched.add(i)
        try:
            t[j] = float(run._timeline(cands[i], batches[j], 0.0).iteration_s)
            timelines += 1
        except HarmoniaError as err:
            failed[key] = f"schedule: {err}"[:80]
            rejected[failed[key]] += 1
            continue
        heapq.heappush(heap, (bound_of(i), i))
    return ranked, len(touched), timelines


def simulation_key(cand: Candidate, cost: CostModel) -> tuple:
    """What the simulator's result depends on: two candidates with equal keys simulate alike.

    Zero-bubble differs from 1F1B only on stages that split a backward into B and W (both an
    input gradient and trainable weights); where none does, a ``zb`` plan runs as ``1f1b``.
    """
    plan = cand.plan
    schedule = plan.schedule
    if schedule == "zb":
        graph = StageGraph.from_layouts(plan.layouts, stage_trainable(plan, cost))
        if not any(graph.needs_b(ref) and graph.needs_w(ref) for ref in graph.stages()):
            schedule = "1f1b"
    return (cand.recipe, cand.fused, plan.placement.value, schedule, plan.n_microbatches,
            tuple(sorted(plan.layouts.items())))


def _batch_bounds(run: ScenarioRun, cands: list[Candidate], keys: list[tuple],
                  batches: list[int]) -> list[list[float]]:
    """Per candidate and search batch, the larger of the communication-aware and compute-only
    lower bounds (computed once per distinct simulation)."""
    cache: dict[tuple, list[float]] = {}
    out = []
    for cand, key in zip(cands, keys):
        if key not in cache:
            cache[key] = [max(plan_bound(cand.plan, run.cost, run.cluster, run.profile, [k]).lower_s,
                              lower_bound_s(run.profile, cand.plan.layouts, [k])) for k in batches]
        out.append(cache[key])
    return out


def _no_layout_error(scenario: Scenario, rejected: Counter, homogeneous: bool) -> LayoutError:
    kind = "homogeneous layout" if homogeneous else "layout"
    need = _smallest_fitting_world(scenario)
    return LayoutError(
        f"no {kind} of {scenario.model} fits {scenario.cluster} ({dict(rejected) or 'no factorisation'}); "
        + (f"use at least {need} devices" if need else "use devices with more memory or a smaller model")
    )


def _smallest_fitting_world(scenario: Scenario) -> int | None:
    """The smallest power-of-two multiple of the node size on which some layout fits."""
    from dataclasses import replace

    from harmonia.workload.devices import cluster_from_string

    cluster = cluster_from_string(scenario.cluster)
    for nodes in (1, 2, 4, 8, 16, 32, 64, 128):
        if nodes * cluster.gpus_per_node <= cluster.world_size:
            continue
        bigger = replace(scenario, cluster=f"{cluster.device.name}:{nodes}x{cluster.gpus_per_node}")
        run = ScenarioRun(bigger)
        if next(candidates("harmonia", run.cost, run.cluster, run.profile, bigger.global_batch, bigger.model), None):
            return nodes * cluster.gpus_per_node
    return None
