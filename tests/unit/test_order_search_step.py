"""Per-batch order search: never slower than the default order under the simulator, nothing scored
where every order finishes alike, and a budget that holds from the rate of earlier batches."""

import math
import time

import numpy as np
import pytest

from harmonia.schedule import CostTable, ModuleStages, PhaseCost, StageGraph
from harmonia.schedule.families import build_schedule
from harmonia.schedule.order_search import ReplayRate, order_free, search_order
from harmonia.schedule.replay import makespan


@pytest.fixture(scope="module")
def interleaved_case(shared_traces):
    """LLaVA (frozen SigLIP on all 8 ranks, the LLM interleaved over 2 x 4 chunks, 4 replicas) on
    the first ai2d batch: the replay's best order is slower than the default one when simulated
    (messages between the chunks' ranks, which the replay does not see) at an isolated matmul's rate
    (0.70 of peak), the rate this case was found at."""
    from harmonia.plan.recipes import Candidate
    from harmonia.plan.scenario import Scenario, ScenarioRun
    from harmonia.schedule.layout import Layout
    from harmonia.schedule.plan import Plan
    from harmonia.schedule.stagework import cost_table, iteration_schedule, stage_trainable
    from harmonia.sim.tasks import SimulatedOrders

    training = {"vision": "frozen"}
    run = ScenarioRun(Scenario("s", "llava-siglip-8b", "h100:1x8", str(shared_traces / "ai2d.csv"), 64,
                               training=training, iterations=1, search_batches=1,
                               device={"flops_efficiency": 0.70}))
    plan = Plan("llava-siglip-8b", {"vision": Layout(dp=8), "llm": Layout(pp=2, virtual_stages=4, dp=4)},
                "colocated", "interleaved", 8, 64, training)
    cand = Candidate("harmonia", plan)
    iw = run.iteration_work(cand, 0)
    graph = StageGraph.from_layouts(plan.layouts, stage_trainable(plan, run.cost))
    steps = SimulatedOrders(plan, run.cost, run.cluster, iw, lambda o: iteration_schedule(plan, run.cost, iw, order=o))
    return run, cand, iw, graph, cost_table(plan, iw), steps


def test_pick_slower_when_simulated_keeps_the_default_order(interleaved_case) -> None:
    run, cand, iw, graph, table, steps = interleaved_case
    default = list(range(8))
    picked = search_order(graph, table, 8, ("interleaved",), budget_s=math.inf, max_evaluations=64)
    assert picked.order != default and picked.makespan_s < picked.start_makespan_s
    assert steps(picked.order, "interleaved") > steps(default, "interleaved")  # the replay's pick loses here
    checked = search_order(graph, table, 8, ("interleaved",), budget_s=math.inf, max_evaluations=64, step=steps)
    assert checked.order == default and checked.family == "interleaved"
    assert checked.step_s == checked.start_step_s == steps(default, "interleaved")
    assert checked.makespan_s == checked.start_makespan_s  # the default's own replay


def test_simulated_harmonia_step_is_never_slower_than_the_default_order(interleaved_case) -> None:
    from harmonia.plan.recipes import simulate_work

    run, cand, iw, *_ = interleaved_case
    default = simulate_work(cand, iw, run.cost, run.cluster, 0.0).iteration_s  # no search: the balancer's order
    for budget in (0.05, 0.3):
        assert simulate_work(cand, iw, run.cost, run.cluster, budget, sub_options=(1,)).iteration_s <= default


def one_rank_graph() -> StageGraph:
    return StageGraph((ModuleStages("vision", (0,), (False,)), ModuleStages("llm", (0, 0), (True, True))))


def pipeline_graph() -> StageGraph:
    return StageGraph((ModuleStages("vision", (0,), (False,)), ModuleStages("llm", (1, 2, 3), (True,) * 3)))


def random_costs(n: int, stages: dict[str, int], seed: int, same: bool = False) -> CostTable:
    rng = np.random.default_rng(seed)
    entries = {}
    for m in range(n):
        for module, count in stages.items():
            for s in range(count):
                f, b, w = (1.0, 2.0, 0.5) if same else rng.lognormal(0, 0.7, size=3)
                entries[(module, s, m, None)] = PhaseCost(float(f), 0.0 if module == "vision" else float(b),
                                                          0.0 if module == "vision" else float(w))
    return CostTable(entries)


@pytest.mark.parametrize("family", ["1f1b", "zb"])
def test_order_free_graphs_replay_alike_and_are_not_scored(family: str) -> None:
    """One rank holding every stage, or microbatches that all cost the same: every order replays to
    the same makespan, so the search keeps the start without scoring any."""
    rng = np.random.default_rng(0)
    cases = [(one_rank_graph(), random_costs(6, {"vision": 1, "llm": 2}, 1)),
             (pipeline_graph(), random_costs(6, {"vision": 1, "llm": 3}, 2, same=True))]
    for graph, costs in cases:
        assert order_free(graph, costs, 6, (family,))
        orders = [[int(m) for m in rng.permutation(6)] for _ in range(5)]
        spans = {round(makespan(build_schedule(graph, 6, family, order=o, costs=costs), costs), 9) for o in orders}
        assert len(spans) == 1
        found = search_order(graph, costs, 6, (family,), start=[5, 4, 3, 2, 1, 0])
        assert found.order == [5, 4, 3, 2, 1, 0] and found.evaluated == 0 and math.isnan(found.makespan_s)
    varied = random_costs(6, {"vision": 1, "llm": 3}, 3)
    assert not order_free(pipeline_graph(), varied, 6, (family,))
    assert not order_free(pipeline_graph(), random_costs(6, {"vision": 1, "llm": 3}, 2, same=True), 6, ("1f1b", "zb"))


def test_rate_of_earlier_batches_keeps_the_search_within_budget() -> None:
    """A search records what one schedule cost; the next one keeps its start unscored when even
    that schedule would overrun the budget, and expects a little less afterwards."""
    graph, costs = pipeline_graph(), random_costs(8, {"vision": 1, "llm": 3}, 4)
    rate = ReplayRate()
    first = search_order(graph, costs, 8, ("1f1b",), budget_s=0.5, rate=rate)
    assert first.evaluated >= 1 and rate.seconds_per_unit > 0
    units = 8 * 4  # microbatches x stage holders
    slow = ReplayRate(seconds_per_unit=1.0 / units)  # one schedule: a second
    t0 = time.perf_counter()
    kept = search_order(graph, costs, 8, ("1f1b",), budget_s=0.05, start=[7, 6, 5, 4, 3, 2, 1, 0], rate=slow)
    assert time.perf_counter() - t0 < 0.05
    assert kept.order == [7, 6, 5, 4, 3, 2, 1, 0] and kept.evaluated == 0
    assert slow.seconds_per_unit == pytest.approx(0.75 / units)
