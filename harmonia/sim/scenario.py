"""Scenarios: a model, a cluster, a trace and a batch size, run under every recipe.

Each recipe's best plan is the one with the smallest mean simulated time on a few profiled batches
among every candidate its rules allow, found by the planner's branch and bound
(`harmonia.plan.search`): its bounds hold for every recipe, so the search is exact for baselines
and harmonia alike, and no recipe is judged on a truncated candidate list. The winner then runs
``iterations`` sampled batches and its averages are reported.
"""

from __future__ import annotations

import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harmonia.errors import ConfigError, LayoutError
from harmonia.model.resolve import resolve_mllm
from harmonia.plan.profiling import profile_batches
from harmonia.sim.engine import Timeline
from harmonia.sim.recipes import RECIPES, Candidate, simulate
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec, cluster_from_string
from harmonia.workload.shapes import SampleShape
from harmonia.workload.traces import load_trace
from harmonia.workload.work import load_arrays

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Scenario:
    """What to simulate.

    Attributes:
        name: scenario name.
        model: MLLM preset name, HF checkpoint directory, or composition (`harmonia.model.resolve`).
        training: module -> full / frozen / lora.
        cluster: ``DEVICE:NODESxGPUS``.
        trace: CSV path (relative paths resolve against the project root) or ``synthetic:...``.
        global_batch: samples per iteration.
        iterations: batches averaged in the report.
        search_batches: batches each candidate is scored on during the search.
        seed: sampling seed.
    """

    name: str
    model: str | dict
    cluster: str
    trace: str
    global_batch: int
    training: dict[str, str] = field(default_factory=dict)
    iterations: int = 20
    search_batches: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.iterations < 1 or self.search_batches < 1:
            raise ConfigError(f"scenario {self.name!r}: global_batch, iterations and search_batches must be >= 1")

    @staticmethod
    def load(path: str | Path) -> Scenario:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
            return Scenario(**raw["scenario"])
        except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as err:
            raise ConfigError(f"scenario file {path}: {err}; expected a [scenario] table with name, model, "
                              "cluster, trace and global_batch") from None

    def trace_spec(self) -> str:
        if self.trace.startswith("synthetic"):
            return self.trace
        p = Path(self.trace)
        return str(p if p.is_absolute() else ROOT / p)


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


class ScenarioRun:
    """Loads a scenario's model, cluster and trace once and runs recipes on it."""

    def __init__(self, scenario: Scenario, samples: list[SampleShape] | None = None) -> None:
        """Load the scenario; ``samples`` (e.g. a dataset's shapes) replace its trace when given."""
        self.scenario = scenario
        self.mllm = resolve_mllm(scenario.model, training=scenario.training)
        self.cluster: ClusterSpec = cluster_from_string(scenario.cluster)
        self.cost = CostModel(self.mllm, self.cluster.device)
        self.samples = samples if samples is not None else load_trace(
            scenario.trace_spec(), n_samples=max(4 * scenario.global_batch, 4096), seed=scenario.seed)
        tokens, pairs = load_arrays(self.samples, self.mllm)
        self.costs = self.cost.costs_from_loads(tokens, pairs)
        self.tokens = tokens[:, self.cost.modules.index("llm")]
        n_batches = scenario.iterations + scenario.search_batches
        self.profile = profile_batches(self.samples, self.cost, scenario.global_batch, n_batches, scenario.seed)

    def _timeline(self, cand: Candidate, k: int, search_budget_s: float = 0.1) -> Timeline:
        batch = self.profile.batches[k]
        return simulate(cand, self.samples, batch, self.costs[batch], self.tokens[batch], self.cost, self.cluster,
                        search_budget_s)

    def search(self, recipe: str) -> tuple[Candidate | None, int, float, str]:
        """The recipe's best candidate on the search batches, candidates simulated, seconds spent,
        and why there is none when no candidate of the recipe fits the cluster."""
        from harmonia.plan.search import search_plan  # the planner builds on this module

        t0 = time.perf_counter()
        try:
            report = search_plan(self.scenario, recipe=recipe, samples=self.samples)
        except LayoutError as err:
            return None, 0, time.perf_counter() - t0, str(err)
        return report.ranked[0][2], report.simulated, time.perf_counter() - t0, ""

    def run(self, recipe: str) -> RecipeResult:
        best, tried, search_s, error = self.search(recipe)
        if best is None:
            return RecipeResult(recipe, None, tried=tried, search_s=search_s, error=error)
        timelines = [self._timeline(best, k) for k in range(self.scenario.iterations)]
        iteration = float(np.mean([t.iteration_s for t in timelines]))
        peak = self.cluster.device.peak_flops
        return RecipeResult(
            recipe, best, iteration, float(np.mean([t.bubble_frac for t in timelines])),
            float(np.mean([t.mfu(peak) for t in timelines])), self.scenario.global_batch / iteration,
            tried, search_s, timeline=timelines[0],
        )


def run_scenario(scenario: Scenario, recipes: tuple[str, ...] = RECIPES) -> dict[str, RecipeResult]:
    """Every recipe's result on a scenario."""
    unknown = set(recipes) - set(RECIPES)
    if unknown:
        raise ConfigError(f"unknown recipes {sorted(unknown)}; recipes are {RECIPES}")
    runner = ScenarioRun(scenario)
    return {r: runner.run(r) for r in recipes}
