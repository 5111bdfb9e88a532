"""Every recipe on one scenario: its best plan by the planner's search, then its averages.

Each recipe's best plan is the one with the smallest mean simulated time on a few profiled batches
among every candidate its rules allow, found by the planner's branch and bound
(`harmonia.plan.search`): its bounds hold for every recipe, so the search is exact for baselines
and harmonia alike, and no recipe is judged on a truncated candidate list. The winner then runs
the scenario's ``iterations`` sampled batches and its averages are reported (`harmonia simulate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from harmonia.errors import ConfigError, LayoutError
from harmonia.plan.recipes import Candidate, RECIPES
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import search_plan
from harmonia.sim.engine import Timeline


@dataclass
class RecipeResult:
    """A recipe's chosen plan and its averages over the scenario's iterations."""

    recipe: str
    candidate: Candidate | None
    iteration_s: float = float("nan")
    bubble_frac: float = float("nan")
    mfu: float = float("nan")
    samples_per_s: float = float("nan")
    tried: int = 0
    search_s: float = 0.0
    error: str = ""
    timeline: Timeline | None = None

    def as_dict(self) -> dict:
        out = {"iteration_s": self.iteration_s, "bubble_frac": self.bubble_frac, "mfu": self.mfu,
               "samples_per_s": self.samples_per_s, "candidates_simulated": self.tried,
               "search_s": self.search_s}
        if self.candidate:
            out["plan"] = {m: {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp, "ranks": lay.size,
                               "virtual_stages": lay.virtual_stages, "fsdp": lay.fsdp}
                           for m, lay in self.candidate.plan.layouts.items()}
            out["placement"] = self.candidate.plan.placement.value
            out["schedule"] = self.candidate.plan.schedule
            out["n_microbatches"] = self.candidate.plan.n_microbatches
        if self.error:
            out["error"] = self.error
        return out


def best_candidate(run: ScenarioRun, recipe: str) -> tuple[Candidate | None, int, float, str]:
    """The recipe's best candidate on the search batches, candidates simulated, seconds spent,
    and why there is none when no candidate of the recipe fits the cluster."""
    t0 = time.perf_counter()
    try:
        report = search_plan(run.scenario, recipe=recipe, samples=run.samples)
    except LayoutError as err:
        return None, 0, time.perf_counter() - t0, str(err)
    return report.ranked[0][2], report.simulated, time.perf_counter() - t0, ""


def run_recipe(run: ScenarioRun, recipe: str) -> RecipeResult:
    """A recipe's best plan on a loaded scenario, simulated on its ``iterations`` batches."""
    best, tried, search_s, error = best_candidate(run, recipe)
    if best is None:
        return RecipeResult(recipe, None, tried=tried, search_s=search_s, error=error)
    timelines = [run.timeline(best, k) for k in range(run.scenario.iterations)]
    iteration = float(np.mean([t.iteration_s for t in timelines]))
    peak = run.cluster.device.peak_flops
    return RecipeResult(
        recipe, best, iteration, float(np.mean([t.bubble_frac for t in timelines])),
        float(np.mean([t.mfu(peak) for t in timelines])), run.scenario.global_batch / iteration,
        tried, search_s, timeline=timelines[0],
    )


def run_scenario(scenario: Scenario, recipes: tuple[str, ...] = RECIPES) -> dict[str, RecipeResult]:
    """Every recipe's result on a scenario."""
    unknown = set(recipes) - set(RECIPES)
    if unknown:
        raise ConfigError(f"unknown recipes {sorted(unknown)}; recipes are {RECIPES}")
    run = ScenarioRun(scenario)
    return {r: run_recipe(run, r) for r in recipes}
