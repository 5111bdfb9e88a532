"""Stage work and the simulator's tasks of every rank's action list in a multi-module pipeline."""

from dataclasses import replace

import pytest

from harmonia.model.presets import mllm_preset
from harmonia.schedule.actions import Kind
from harmonia.schedule.families import fuse_encoders
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.rank_actions import plan_rank_actions
from harmonia.schedule.stagework import iteration_schedule, plan_iteration_work, stage_layer_range
from harmonia.sim.engine import replay
from harmonia.sim.tasks import build_tasks
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.traces import synthesize_trace
from tests.unit.iteration_helpers import assignment


def _tasks(plan, cost, iw, schedule, cluster="h100x8"):
    actions = plan_rank_actions(plan.layouts, schedule)
    return build_tasks(plan, cost, iw, actions, schedule.graph, cluster_from_string(cluster))


@pytest.fixture(scope="module")
def setup():
    mllm = mllm_preset("internvl-8b", training={"vision": "frozen"})
    cost = CostModel(mllm, device_preset("h100"))
    plan = Plan("internvl-8b", {"vision": Layout(dp=2), "llm": Layout(pp=2, dp=2, rank_offset=2)},
                "disjoint", schedule="zb", global_batch=16, n_microbatches=4)
    samples = synthesize_trace(16, {"image": 1.0}, seed=0)
    per_replica = [[list(range(d * 8 + 2 * i, d * 8 + 2 * i + 2)) for i in range(4)] for d in range(2)]
    iw = plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, per_replica))
    return plan, cost, iw, iteration_schedule(plan, cost, iw)


def test_stage_layer_ranges_cover_the_module(setup) -> None:
    plan, cost, _, _ = setup
    a, b = stage_layer_range(cost, plan, "llm", 0), stage_layer_range(cost, plan, "llm", 1)
    assert a[0] == 0 and a[1] == b[0] and b[1] == len(cost.layers["llm"])


def test_dependencies_follow_the_data_flow(setup) -> None:
    plan, cost, iw, schedule = setup
    tasks, queue, comm = _tasks(plan, cost, iw, schedule)
    tl = replay(tasks, queue, comm)
    by_name = {t.name: i for i, t in enumerate(tasks)}
    for d in range(2):  # vision replica d encodes LLM replica d's samples (the frozen encoder: W only)
        for m in range(4):
            llm_f, vision_f = by_name[f"llm.r{d}.s0.F{m}"], by_name[f"vision.r{d}.s0.F{m}"]
            assert tl.start[llm_f] >= tl.end[vision_f]
            assert tl.start[by_name[f"vision.r{d}.s0.W{m}"]] >= tl.end[by_name[f"llm.r{d}.s0.B{m}"]]
            assert tl.start[by_name[f"llm.r{d}.s0.B{m}"]] >= tl.end[by_name[f"llm.r{d}.s1.B{m}"]]
    reductions = [t for t in tasks if t.kind == "C"]
    assert {t.rank for t in reductions} == set(range(6))  # every trainable stage has dp = 2
    for t in reductions:
        (dep, _), = t.deps
        assert tasks[dep].kind in ("W", "BW") and tasks[dep].rank == t.rank
    assert tl.iteration_s >= max(tl.busy_s.values())
    assert 0 < tl.bubble_frac < 1 and 0 < tl.mfu(989e12) < 1


def test_frozen_encoder_keeps_no_activations(setup) -> None:
    plan, cost, iw, schedule = setup
    peak = replay(*_tasks(plan, cost, iw, schedule)).peak_mem
    assert peak[0] < 0.05 * peak[2]


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "interleaved", "zb"])
def test_every_rank_runs_its_list_and_the_lists_replay(family) -> None:
    mllm = mllm_preset("omni-8b", training={"vision": "frozen", "audio": "frozen"})
    cost = CostModel(mllm, device_preset("h100"))
    plan = Plan("omni-8b", {"vision": Layout(dp=2), "audio": Layout(rank_offset=2),
                            "llm": Layout(tp=2, pp=2, dp=2, rank_offset=3)},
                "disjoint", schedule=family, global_batch=32, n_microbatches=4)
    samples = synthesize_trace(32, seed=0)
    per_replica = [[list(range(d * 16 + 4 * i, d * 16 + 4 * i + 4)) for i in range(4)] for d in range(2)]
    iw = plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, per_replica))
    schedule = iteration_schedule(plan, cost, iw)
    actions = plan_rank_actions(plan.layouts, schedule)
    assert set(actions) == set(range(11))
    # TP peers run the same list (their messages go to their own TP peers)
    assert [replace(a, peer_rank=None) for a in actions[3]] == [replace(a, peer_rank=None) for a in actions[4]]
    # the one audio replica encodes each global microbatch once, for both LLM replicas
    assert sorted(a.microbatch for a in actions[2] if a.kind is Kind.F) == [0, 1, 2, 3]
    assert {d for (e, _, d, _) in iw.boundary_bytes if e == "audio"} == {0, 1}
    llm_backward = [a for a in actions[3] if a.kind in (Kind.B, Kind.W, Kind.BW)]
    assert len(llm_backward) == 4 * (2 if family == "zb" else 1)  # B + W split only under zero bubble
    tl = replay(*build_tasks(plan, cost, iw, actions, schedule.graph, cluster_from_string("h100:2x8")))
    assert 0 < tl.mfu(989e12) < 0.6 and 0 < tl.bubble_frac < 1
    fused = fuse_encoders(schedule)
    assert all(sorted(map(str, fused.orders[r])) == sorted(map(str, schedule.orders[r])) for r in schedule.orders)


@pytest.mark.parametrize("vision", ["full", "frozen"])
@pytest.mark.parametrize("family", ["1f1b", "zb"])
def test_every_rank_frees_the_activations_it_keeps(vision, family) -> None:
    # a trainable first encoder stage has no input gradient: its W is its whole backward and frees
    # everything its forward kept, so every rank ends the iteration holding no activations
    mllm = mllm_preset("internvl-8b", training={"vision": vision})
    cost = CostModel(mllm, device_preset("h100"))
    plan = Plan("internvl-8b", {"vision": Layout(dp=1), "llm": Layout(pp=2, dp=2, rank_offset=1)},
                "disjoint", schedule=family, global_batch=16, n_microbatches=4)
    samples = synthesize_trace(16, {"image": 1.0}, seed=0)
    per_replica = [[list(range(d * 8 + 2 * i, d * 8 + 2 * i + 2)) for i in range(4)] for d in range(2)]
    iw = plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, per_replica))
    tasks, queue, comm = _tasks(plan, cost, iw, iteration_schedule(plan, cost, iw))
    held: dict[int, float] = {}
    for t in tasks:
        held[t.rank] = held.get(t.rank, 0.0) + t.mem_delta
    assert all(abs(v) < 1e-6 * max(t.mem_delta for t in tasks) for v in held.values())
    peak = replay(tasks, queue, comm).peak_mem
    kept = max(w.act_bytes for (key, _, _), w in iw.work.items() if key.module == "vision")
    if vision == "full":  # one encoder replica for both LLM replicas: at most the warm-up depth
        depth = 1 + plan.layouts["llm"].pp
        assert 0 < peak[0] <= depth * kept * (2 if family == "zb" else 1)
