"""Every recipe on one scenario: its best plan by the planner's search, then its averages.

Each recipe's best plan is the one with the smallest mean simulated time on a few profiled batches
among every candidate its rules allow, found by the planner's branch and bound
(`harmonia.plan.search`): its bounds hold for every recipe, so the search is exact for baselines
and harmonia alike, and no recipe is judged on a truncated candidate list. The winner then runs
the scenario's ``iterations`` sampled batches and its averages are reported (`harmonia simulate`).
A given plan is scored the same way without a search (`score_plan`, `harmonia simulate --layout`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from harmonia.errors import ConfigError, LayoutError
from harmonia.plan.candidates import state_bytes_per_rank
from harmonia.plan.recipes import Candidate, RECIPES, simulate_work
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import search_plan
from harmonia.schedule.plan import Plan
from harmonia.sim.engine import Timeline
from harmonia.sim.memory import input_bytes

MFU_NOTE = ("MFU: useful FLOPs per second (forward, input and weight gradients of every module, attention over "
            "the (query, key) pairs its mask keeps, as executed; recomputation not counted) over the devices' "
            "peak (dense bf16 on the GPUs).")
"""How the comparison tables count MFU."""


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
    tokens_per_s: float = float("nan")  # LLM tokens per second, whole cluster
    peak_bytes: float = float("nan")  # the most one rank holds: its states plus its activation peak

    def as_dict(self) -> dict:
        out = {"iteration_s": self.iteration_s, "bubble_frac": self.bubble_frac, "mfu": self.mfu,
               "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
               "peak_bytes": self.peak_bytes, "candidates_simulated": self.tried, "search_s": self.search_s}
        if self.candidate:
            out["plan"] = {m: {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp, "ranks": lay.size,
                               "virtual_stages": lay.virtual_stages, "fsdp": lay.fsdp,
                               "reshard": lay.reshard}
                           for m, lay in self.candidate.plan.layouts.items()}
            out["placement"] = self.candidate.plan.placement.value
            out["schedule"] = self.candidate.plan.schedule
            out["n_microbatches"] = self.candidate.plan.n_microbatches
            out["recompute"] = self.candidate.plan.recompute_text()
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
    return replace(averages(run, best), tried=tried, search_s=search_s)


def score_plan(run: ScenarioRun, plan: Plan, recipe: str = "harmonia") -> RecipeResult:
    """A given plan, unsearched, on a loaded scenario's ``iterations`` batches, its batches assigned
    and ordered by ``recipe``'s rules (harmonia's balancing and per-batch order search by default)."""
    if recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {recipe!r}; recipes are {RECIPES}")
    plan.validate(run.mllm)
    if plan.world_size != run.cluster.world_size:
        raise LayoutError(f"the plan uses {plan.world_size} ranks but cluster {run.scenario.cluster} has "
                          f"{run.cluster.world_size}; give a cluster of the plan's size")
    return replace(averages(run, Candidate(recipe, plan)), tried=1)


def averages(run: ScenarioRun, cand: Candidate) -> RecipeResult:
    """A candidate simulated on the scenario's ``iterations`` batches: mean iteration time, bubble,
    MFU (FLOPs under the attention mask, as executed), samples and LLM tokens per second, and the
    peak bytes of the busiest rank (states of its stages, its activation peak and the encoder inputs
    it holds, as the planner counts them: `harmonia.sim.memory.input_bytes`). Only the first
    iteration's timeline is kept (for its chart); the others leave their numbers."""
    states = state_bytes_per_rank(run.cost, cand.plan)
    flops = run.cluster.device.peak_flops
    first, seconds, bubbles, mfus, peak = None, [], [], [], 0.0
    for k in range(run.scenario.iterations):
        iw = run.iteration_work(cand, k)  # what `run.timeline` simulates, kept for the inputs it holds
        t = simulate_work(cand, iw, run.cost, run.cluster)
        inputs = input_bytes(run.cost.mllm, iw)
        if first is None:
            first = t
        seconds.append(t.iteration_s)
        bubbles.append(t.bubble_frac)
        mfus.append(t.mfu(flops, run.cluster.units_of(t.ranks)))
        peak = max(peak, max((states.get(r, 0.0) + t.peak_mem.get(r, 0.0) + inputs.get(r, 0.0) for r in states),
                             default=0.0))
    iteration = float(np.mean(seconds))
    tokens = float(np.mean([run.tokens[run.profile.batches[k]].sum() for k in range(run.scenario.iterations)]))
    return RecipeResult(
        cand.recipe, cand, iteration, float(np.mean(bubbles)), float(np.mean(mfus)),
        run.scenario.global_batch / iteration,
        timeline=first, tokens_per_s=tokens / iteration, peak_bytes=peak,
    )


def run_scenario(scenario: Scenario, recipes: tuple[str, ...] = RECIPES) -> dict[str, RecipeResult]:
    """Every recipe's result on a scenario."""
    unknown = set(recipes) - set(RECIPES)
    if unknown:
        raise ConfigError(f"unknown recipes {sorted(unknown)}; recipes are {RECIPES}")
    run = ScenarioRun(scenario)
    return {r: run_recipe(run, r) for r in recipes}
