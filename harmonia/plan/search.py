"""`harmonia plan`: one static layout from batch-level profiling, scored by the simulator.

Candidates are harmonia's own (disjoint rank sets sized by work share and colocated encoders,
every LLM factorisation that fits memory, frozen-aware stage splits, 1F1B or zero-bubble); each
is scored by simulating the profiled batches with harmonia's balancing and per-batch search, in
order of its lower bound, skipping those whose bound cannot beat the best found.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from harmonia.errors import HarmoniaError, LayoutError
from harmonia.plan.candidates import lower_bound_s
from harmonia.plan.plan import Plan
from harmonia.sim.recipes import Candidate, candidates, search_order_of
from harmonia.sim.scenario import Scenario, ScenarioRun
from harmonia.workload.shapes import SampleShape


@dataclass
class PlanReport:
    """The chosen plan, the ranked candidates and why others were dropped."""

    best: Plan
    ranked: list[tuple[float, float, Candidate]]  # (iteration s, samples/s, candidate)
    rejected: Counter = field(default_factory=Counter)
    simulated: int = 0
    pruned: int = 0
    seconds: float = 0.0


def search_plan(scenario: Scenario, top: int = 10, max_simulated: int = 64,
                accept: Callable[[Plan], str | None] | None = None,
                samples: list[SampleShape] | None = None) -> PlanReport:
    """Search harmonia's candidates for a scenario.

    Args:
        accept: optional filter: returns None for a plan the caller can run, else the reason it
            cannot (counted in ``rejected``), e.g. a runtime that supports only some layouts.
        samples: sample shapes to profile instead of the scenario's trace (a dataset's own).

    Raises:
        LayoutError: when no candidate fits, naming what to change.
    """
    t0 = time.perf_counter()
    run = ScenarioRun(scenario, samples)
    rejected: Counter = Counter()
    cands = list(candidates("harmonia", run.cost, run.cluster, run.profile, scenario.global_batch,
                            scenario.model, rejected))
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
        need = _smallest_fitting_world(scenario)
        raise LayoutError(
            f"no layout of {scenario.model} fits {scenario.cluster} ({dict(rejected) or 'no factorisation'}); "
            + (f"use at least {need} devices" if need else "use devices with more memory or a smaller model")
        )
    batches = list(range(scenario.iterations, scenario.iterations + scenario.search_batches))
    bounds = [lower_bound_s(run.profile, c.plan.layouts, batches) for c in cands]
    scored: list[tuple[float, float, Candidate]] = []
    pruned = 0
    for i in search_order_of(cands, bounds):
        best = min((s for s, _, _ in scored), default=float("inf"))
        if bounds[i] >= best or len(scored) >= max_simulated:
            pruned += 1
            continue
        try:
            secs = float(np.mean([run._timeline(cands[i], k, 0.0).iteration_s for k in batches]))
        except HarmoniaError as err:
            rejected[f"schedule: {err}"[:80]] += 1
            continue
        scored.append((secs, scenario.global_batch / secs, cands[i]))
    scored.sort(key=lambda x: x[0])
    return PlanReport(scored[0][2].plan, scored[:top], rejected, len(scored), pruned, time.perf_counter() - t0)


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
