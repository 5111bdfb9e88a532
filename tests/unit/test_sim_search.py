"""Per-batch schedule search: never worse than its start, within budget, deterministic."""

import numpy as np

from harmonia.schedule import CostTable, ModuleStages, PhaseCost, StageGraph
from harmonia.schedule.order_search import light_ends_order, search_order


def graph_and_costs(n: int, seed: int):
    graph = StageGraph((ModuleStages("vision", (0,), (False,)), ModuleStages("llm", (1, 2, 3), (True,) * 3)))
    rng = np.random.default_rng(seed)
    entries = {}
    for m in range(n):
        w = float(rng.lognormal(0, 0.7))
        entries[("vision", 0, m, None)] = PhaseCost(0.4 * w, 0.0, 0.0)
        for s in range(3):
            entries[("llm", s, m, None)] = PhaseCost(w, w, w)
    return graph, CostTable(entries)


def test_light_ends_order() -> None:
    order = light_ends_order([5.0, 1.0, 3.0, 2.0, 4.0])
    assert sorted(order) == [0, 1, 2, 3, 4]
    assert order[0] == 1 and order[-1] == 3 and order[len(order) // 2] == 0  # lightest ends, heaviest middle


def test_search_never_worse_and_deterministic() -> None:
    for seed in range(3):
        graph, costs = graph_and_costs(8, seed)
        a = search_order(graph, costs, 8, ("1f1b", "zb"), budget_s=0.3, seed=seed)
        assert a.makespan_s <= a.start_makespan_s
        assert sorted(a.order) == list(range(8))
        x = search_order(graph, costs, 8, ("1f1b",), budget_s=10.0, seed=seed, max_evaluations=12)
        y = search_order(graph, costs, 8, ("1f1b",), budget_s=10.0, seed=seed, max_evaluations=12)
        assert x.order == y.order and x.evaluated == 12


def test_search_of_one_iteration_fits_its_budget(shared_traces) -> None:
    """The per-batch search orders the microbatches every LLM replica runs, within its budget."""
    import time

    from harmonia.plan.recipes import candidates, search_microbatch_order
    from harmonia.plan.scenario import Scenario, ScenarioRun

    run = ScenarioRun(Scenario("s", "internvl-8b", "h100:1x8", str(shared_traces / "ai2d.csv"), 256,
                               iterations=1, search_batches=1))
    cand = next(c for c in candidates("harmonia", run.cost, run.cluster, run.profile, 256, "internvl-8b")
                if c.plan.layouts["llm"].dp == 4 and c.plan.layouts["llm"].pp == 2 and c.plan.n_microbatches == 8)
    iw = run.iteration_work(cand, 0)
    for budget in (0.0, 0.03):
        t0 = time.perf_counter()
        found = search_microbatch_order(cand.plan, run.cost, iw, budget)
        assert time.perf_counter() - t0 <= budget + 0.02
        assert sorted(found.order) == list(range(8))
    assert found.evaluated >= 1 and found.makespan_s <= found.start_makespan_s
