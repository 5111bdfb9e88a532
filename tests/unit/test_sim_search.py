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
    from harmonia.schedule.stagework import cost_table, stage_trainable

    run = ScenarioRun(Scenario("s", "internvl-8b", "h100:1x8", str(shared_traces / "ai2d.csv"), 256,
                               iterations=1, search_batches=1))
    cand = next(c for c in candidates("harmonia", run.cost, run.cluster, run.profile, 256, "internvl-8b")
                if c.plan.layouts["llm"].dp == 4 and c.plan.layouts["llm"].pp == 2 and c.plan.n_microbatches == 8)
    iw = run.iteration_work(cand, 0)
    graph = StageGraph.from_layouts(cand.plan.layouts, stage_trainable(cand.plan, run.cost))
    table = cost_table(cand.plan, iw)  # the costs are the trainer's anyway; the budget is the search's
    for budget in (0.0, 0.03):
        t0 = time.perf_counter()
        found = search_order(graph, table, 8, (cand.plan.schedule,), budget_s=budget)
        # the start is scored when no earlier batch says it cannot fit; then a schedule only where it fits
        per_schedule = found.seconds / max(found.evaluated, 1)
        assert time.perf_counter() - t0 <= budget + 2 * per_schedule + 0.02
        assert sorted(found.order) == list(range(8))
    found = search_order(graph, table, 8, (cand.plan.schedule,), budget_s=1.0)  # room for several schedules
    assert found.evaluated >= 2 and found.makespan_s <= found.start_makespan_s
    same = search_microbatch_order(cand.plan, run.cost, iw, 0.0)  # no budget: the start, unscored
    assert same.order == list(range(8)) and same.evaluated == 0


def test_sub_microbatch_search_splits_an_encoder_pipeline_and_is_never_worse() -> None:
    """Vision on two pipeline stages of its own: pieces of a microbatch overlap its stages, so the
    search splits it; colocated vision (no stages to overlap) stays whole. Never worse than unsplit."""
    from harmonia.model.presets import mllm_preset
    from harmonia.schedule.layout import Layout
    from harmonia.schedule.order_search import search_submicrobatches
    from harmonia.schedule.plan import Plan
    from harmonia.schedule.stagework import plan_iteration_work, stage_trainable
    from harmonia.workload.cost import CostModel
    from harmonia.workload.devices import device_preset
    from harmonia.workload.traces import synthesize_trace
    from tests.unit.iteration_helpers import assignment

    cost = CostModel(mllm_preset("internvl-8b"), device_preset("h100"))
    shapes = synthesize_trace(32, {"image": 1.0}, seed=1)
    chosen = {}
    for name, vision, llm in (("pipelined", Layout(pp=2), Layout(pp=2, rank_offset=2)),
                              ("colocated", Layout(dp=4), Layout(pp=2, dp=2))):
        plan = Plan("internvl-8b", {"vision": vision, "llm": llm}, "colocated" if name == "colocated" else "disjoint",
                    "1f1b", n_microbatches=4, global_batch=32)
        per = 32 // llm.dp
        replicas = [[list(range(d * per + i * per // 4, d * per + (i + 1) * per // 4)) for i in range(4)]
                    for d in range(llm.dp)]
        iw = plan_iteration_work(shapes, plan, cost, assignment(plan, cost, shapes, replicas))
        graph = StageGraph.from_layouts(plan.layouts, stage_trainable(plan, cost))
        found = search_submicrobatches(graph, plan, cost, iw)
        assert found.makespan_s <= found.start_makespan_s
        again = search_submicrobatches(graph, plan, cost, iw)  # deterministic
        assert (again.n_sub, again.makespan_s) == (found.n_sub, found.makespan_s)
        assert found.work.n_sub.get("vision", (1,))[0] == found.n_sub["vision"]
        chosen[name] = found
    assert chosen["pipelined"].n_sub["vision"] > 1 and chosen["pipelined"].makespan_s < chosen["pipelined"].start_makespan_s
    assert chosen["colocated"].n_sub["vision"] == 1
    runs = chosen["pipelined"].work.sub_runs
    assert runs and all(len(r) == chosen["pipelined"].n_sub["vision"] for r in runs.values())
