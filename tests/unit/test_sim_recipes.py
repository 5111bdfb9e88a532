"""Recipes: their candidates follow their rules, their plans validate, and the search is monotone."""

from dataclasses import replace

import numpy as np
import pytest

from harmonia.plan.compare import run_recipe
from harmonia.plan.recipes import candidates
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.schedule import StageGraph, build_schedule, validate
from harmonia.schedule.assign import assign_reordered, assign_sequential
from harmonia.schedule.layout import Placement
from harmonia.schedule.stagework import stage_trainable

BASELINES = ("megatron", "cornstarch", "disttrain")


@pytest.fixture(scope="module")
def run(shared_traces) -> ScenarioRun:
    return ScenarioRun(Scenario("small", "internvl-8b", "h100:1x8", str(shared_traces / "ai2d.csv"), 64,
                                training={"vision": "frozen"}, iterations=2, search_batches=1))


def test_assignments_place_every_sample_once() -> None:
    batch = np.arange(100, 137)
    costs = np.random.default_rng(0).uniform(size=(37, 3))
    for out in (assign_sequential(batch, 2, 4), assign_reordered(batch, costs, 2, 4)):
        placed = sorted(i for mbs in out.values() for mb in mbs for i in mb)
        assert placed == list(batch) and all(len(mbs) == 4 for mbs in out.values())
    sizes = [len(mb) for mbs in assign_reordered(batch, costs, 2, 4).values() for mb in mbs]
    assert max(sizes) - min(sizes) <= 1


def test_candidates_follow_each_recipes_rules(run) -> None:
    for recipe in BASELINES:
        cands = list(candidates(recipe, run.cost, run.cluster, run.profile, 64, "internvl-8b"))
        assert cands, recipe
        for c in cands:
            c.plan.validate(run.mllm)
            llm, vision = c.plan.layouts["llm"], c.plan.layouts["vision"]
            if recipe == "megatron":
                assert c.fused and c.plan.placement is Placement.COLOCATED and llm.stage_layers is None
                assert set(vision.rank_list()) == {llm.rank_at(pp=0, dp=d, tp=t) for d in range(llm.dp)
                                                   for t in range(llm.tp)}
            else:
                assert c.plan.placement is Placement.DISJOINT
            if recipe == "cornstarch":
                assert (vision.tp, vision.dp) == (llm.tp, llm.dp)


def test_each_baseline_runs_and_its_schedule_validates(run) -> None:
    for recipe in BASELINES:
        result = run_recipe(run, recipe)
        assert result.candidate is not None and result.tried >= 1
        assert 0 < result.bubble_frac < 1 and 0 < result.mfu < 0.6
        plan = result.candidate.plan
        graph = StageGraph.from_layouts(plan.layouts, stage_trainable(plan, run.cost))
        validate(build_schedule(graph, plan.n_microbatches, plan.schedule))
        d = result.as_dict()
        assert set(d) >= {"iteration_s", "bubble_frac", "mfu", "plan", "schedule"}


@pytest.mark.parametrize("scenario", [
    Scenario("vlm-8", "internvl-8b", "h100:1x8", "chartqa.csv", 64, iterations=2, search_batches=1),
    Scenario("omni-16", "omni-8b", "h100:2x8", "synthetic", 128, iterations=2, search_batches=1),
])
def test_harmonia_never_loses_to_a_baseline(scenario, shared_traces) -> None:
    """harmonia's rules contain every baseline's placements, and each recipe's search is exact, so
    its chosen plan is at least as fast as every baseline's on the same sampled batches."""
    if scenario.trace.endswith(".csv"):
        scenario = replace(scenario, trace=str(shared_traces / scenario.trace))
    run = ScenarioRun(scenario)
    results = {r: run_recipe(run, r) for r in (*BASELINES, "harmonia")}
    best_baseline = min(results[r].iteration_s for r in BASELINES)
    assert results["harmonia"].iteration_s <= best_baseline, {r: v.iteration_s for r, v in results.items()}


def test_harmonia_candidates_contain_each_baselines_layouts(run) -> None:
    """Every layout a baseline may pick is one harmonia may pick (placement and per-module degrees)."""
    def shape(c):
        return c.plan.placement, tuple((m, x.tp, x.dp, x.pp, x.rank_list()) for m, x in sorted(c.plan.layouts.items()))
    ours = {shape(c) for c in candidates("harmonia", run.cost, run.cluster, run.profile, 64, "internvl-8b")}
    for recipe in ("cornstarch", "disttrain"):
        theirs = {shape(c) for c in candidates(recipe, run.cost, run.cluster, run.profile, 64, "internvl-8b")}
        assert theirs <= ours, recipe
    megatron = {(m, x.tp, x.dp, x.rank_list()) for c in candidates("megatron", run.cost, run.cluster, run.profile,
                                                                  64, "internvl-8b")
                for m, x in c.plan.layouts.items() if m != "llm"}
    fused = {(m, x.tp, x.dp, x.rank_list()) for c in candidates("harmonia", run.cost, run.cluster, run.profile,
                                                               64, "internvl-8b")
             for m, x in c.plan.layouts.items() if m != "llm"}
    assert megatron <= fused


def test_no_recipe_splits_an_encoder_across_more_ranks_than_its_heads(shared_traces) -> None:
    """A LLaVA whose CLIP has 2 heads: encoders beside a tp4 LLM get tp2 (or are left out by
    Megatron-LM's rule), never tp4, which the runtime cannot run."""
    run = ScenarioRun(Scenario("small", "internvl-8b", "h100:1x8", str(shared_traces / "ai2d.csv"), 64,
                               training={"vision": "frozen"}, iterations=1, search_batches=1))
    vision = run.cost.mllm.encoders["vision"]
    two_heads = replace(vision, body=replace(vision.body, n_heads=2, n_kv_heads=2))
    run.cost.mllm = replace(run.cost.mllm, encoders={"vision": two_heads})
    seen = 0
    for recipe in (*BASELINES, "harmonia"):
        for c in candidates(recipe, run.cost, run.cluster, run.profile, 64, "internvl-8b"):
            c.plan.validate(run.cost.mllm)
            assert c.plan.layouts["vision"].tp <= 2, (recipe, c.plan.layouts)
            seen += c.plan.layouts["llm"].tp == 4
    assert seen, "no tp4 LLM among the candidates: the case is not exercised"
