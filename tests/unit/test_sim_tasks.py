"""Stage work and task dependencies of a multi-module pipeline."""

import pytest

from harmonia.model.presets import mllm_preset
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import plan_iteration_work, stage_layer_range
from harmonia.sim.engine import replay
from harmonia.sim.tasks import build_tasks
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.traces import synthesize_trace


@pytest.fixture(scope="module")
def setup():
    mllm = mllm_preset("internvl-8b", training={"vision": "frozen"})
    cost = CostModel(mllm, device_preset("h100"))
    plan = Plan("internvl-8b", {"vision": Layout(dp=2), "llm": Layout(pp=2, dp=2, rank_offset=2)},
                "disjoint", global_batch=16, n_microbatches=4)
    samples = synthesize_trace(16, {"image": 1.0}, seed=0)
    mbs = {d: [list(range(d * 8 + 2 * i, d * 8 + 2 * i + 2)) for i in range(4)] for d in range(2)}
    iw = plan_iteration_work(samples, plan, cost, mbs)
    orders = {}
    for d in range(2):
        for c in range(2):
            rank = plan.layouts["llm"].rank_at(pp=c, dp=d)
            orders[rank] = [("llm", d, c, "F", (d, m)) for m in range(4)] + \
                [("llm", d, c, k, (d, m)) for m in range(4) for k in ("B", "W")]
        # frozen encoder: forward, then only the projector's weight gradient
        orders[d] = [("vision", d, 0, "F", (d, m)) for m in range(4)] + \
            [("vision", d, 0, "W", (d, m)) for m in range(4)]
    return plan, cost, iw, orders


def test_stage_layer_ranges_cover_the_module(setup) -> None:
    plan, cost, _, _ = setup
    a, b = stage_layer_range(cost, plan, "llm", 0), stage_layer_range(cost, plan, "llm", 1)
    assert a[0] == 0 and a[1] == b[0] and b[1] == len(cost.layers["llm"])


def test_dependencies_follow_the_data_flow(setup) -> None:
    plan, cost, iw, orders = setup
    tasks, queue, comm = build_tasks(plan, cost, iw, orders, cluster_from_string("h100x8"))
    tl = replay(tasks, queue, comm)
    by_name = {t.name: i for i, t in enumerate(tasks)}
    for d in range(2):
        for m in range(4):
            llm_f = by_name[f"llm.r{d}.s0.F{d}.{m}"]
            vision_f = by_name[f"vision.r{d}.s0.F{d}.{m}"]
            assert tl.start[llm_f] >= tl.end[vision_f]
            proj_w = by_name[f"vision.r{d}.s0.W{d}.{m}"]
            assert tl.start[proj_w] >= tl.end[by_name[f"llm.r{d}.s0.B{d}.{m}"]]
            assert tl.start[by_name[f"llm.r{d}.s0.B{d}.{m}"]] >= tl.end[by_name[f"llm.r{d}.s1.B{d}.{m}"]]
    reductions = [t for t in tasks if t.kind == "C"]
    assert {t.rank for t in reductions} == set(range(6))  # every trainable stage has dp = 2
    for t in reductions:
        (dep, _), = t.deps
        assert tasks[dep].kind in ("W", "BW")
    assert tl.iteration_s >= max(tl.busy_s.values())
    assert 0 < tl.bubble_frac < 1 and 0 < tl.mfu(989e12) < 1


def test_frozen_encoder_keeps_no_activations(setup) -> None:
    plan, cost, iw, orders = setup
    tasks, queue, comm = build_tasks(plan, cost, iw, orders, cluster_from_string("h100x8"))
    peak = replay(tasks, queue, comm).peak_mem
    assert peak[0] < 0.05 * peak[2]


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "interleaved", "zb"])
def test_generated_orders_expand_to_every_rank_and_replay(family) -> None:
    from harmonia.sim.orders import fuse_encoders_into_first_stage, plan_orders

    mllm = mllm_preset("omni-8b", training={"vision": "frozen", "audio": "frozen"})
    cost = CostModel(mllm, device_preset("h100"))
    plan = Plan("omni-8b", {"vision": Layout(dp=2), "audio": Layout(rank_offset=2),
                            "llm": Layout(tp=2, pp=2, dp=2, rank_offset=3)},
                "disjoint", global_batch=32, n_microbatches=4)
    samples = synthesize_trace(32, seed=0)
    mbs = {d: [list(range(d * 16 + 4 * i, d * 16 + 4 * i + 4)) for i in range(4)] for d in range(2)}
    iw = plan_iteration_work(samples, plan, cost, mbs)
    orders = plan_orders(plan, cost, iw, family)
    assert set(orders) == set(range(11))
    # TP peers run identical orders; the audio replica serves both LLM replicas
    assert orders[3] == orders[4]
    assert {k[4][0] for k in orders[2]} == {0, 1}
    llm_keys = [k for k in orders[3] if k[3] != "F"]
    assert len(llm_keys) == 4 * (2 if family == "zb" else 1)  # B + W split only under zero bubble
    tasks, queue, comm = build_tasks(plan, cost, iw, orders, cluster_from_string("h100:2x8"))
    tl = replay(tasks, queue, comm)
    assert 0 < tl.mfu(989e12) < 0.6 and 0 < tl.bubble_frac < 1
    fused = fuse_encoders_into_first_stage(orders)
    assert sorted(fused[0]) == sorted(orders[0])


@pytest.mark.parametrize("vision", ["full", "frozen"])
@pytest.mark.parametrize("family", ["1f1b", "zb"])
def test_every_rank_frees_the_activations_it_keeps(vision, family) -> None:
    # a trainable first encoder stage has no input gradient: its W is its whole backward and frees
    # everything its forward kept, so every rank ends the iteration holding no activations
    from harmonia.sim.orders import plan_orders

    mllm = mllm_preset("internvl-8b", training={"vision": vision})
    cost = CostModel(mllm, device_preset("h100"))
    plan = Plan("internvl-8b", {"vision": Layout(dp=1), "llm": Layout(pp=2, dp=2, rank_offset=1)},
                "disjoint", schedule=family, global_batch=16, n_microbatches=4)
    samples = synthesize_trace(16, {"image": 1.0}, seed=0)
    mbs = {d: [list(range(d * 8 + 2 * i, d * 8 + 2 * i + 2)) for i in range(4)] for d in range(2)}
    iw = plan_iteration_work(samples, plan, cost, mbs)
    tasks, queue, comm = build_tasks(plan, cost, iw, plan_orders(plan, cost, iw), cluster_from_string("h100x8"))
    held: dict[int, float] = {}
    for t in tasks:
        held[t.rank] = held.get(t.rank, 0.0) + t.mem_delta
    assert all(abs(v) < 1e-6 * max(t.mem_delta for t in tasks) for v in held.values())
    peak = replay(tasks, queue, comm).peak_mem
    kept = max(iw.work[(key, mb)].act_bytes for key, mb in iw.work if key.module == "vision")
    if vision == "full":  # the encoder serves both LLM replicas: at most each one's warm-up depth
        depth = 1 + plan.layouts["llm"].pp
        assert 0 < peak[0] <= 2 * depth * kept * (2 if family == "zb" else 1)
