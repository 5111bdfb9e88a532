"""Recipes: their candidates follow their rules, their plans validate, and the search is monotone."""

import numpy as np
import pytest

from harmonia.plan.layout import Placement
from harmonia.schedule import StageGraph, build_schedule, validate
from harmonia.sim.assign import assign_reordered, assign_sequential
from harmonia.sim.orders import stage_trainable
from harmonia.sim.recipes import candidates
from harmonia.sim.scenario import Scenario, ScenarioRun

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
        result = run.run(recipe)
        assert result.candidate is not None and result.tried >= 1
        assert 0 < result.bubble_frac < 1 and 0 < result.mfu < 0.6
        plan = result.candidate.plan
        graph = StageGraph.from_layouts(plan.layouts, stage_trainable(plan, run.cost))
        validate(build_schedule(graph, plan.n_microbatches, plan.schedule))
        d = result.as_dict()
        assert set(d) >= {"iteration_s", "bubble_frac", "mfu", "plan", "schedule"}
