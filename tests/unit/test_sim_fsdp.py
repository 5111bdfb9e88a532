"""FSDP as harmonia's runtime runs it, in the cost model, simulator and bounds: every FSDP chunk of
a rank is gathered once per step, beside its first forward, weights and fp32 gradients stay whole
through the step, the LLM's last backward reduce-scatters as it goes; and as ZeRO-3
(``fsdp_per_microbatch``) for published runs."""

from dataclasses import replace

import pytest

from harmonia.plan.bounds import work_bound, work_bound_busy
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.sim.collectives import (chunk_blocks, fsdp_gather_s, grad_reduce_s, rank_gathers_s, reduce_exposed_s,
                                      ring_reduce_scatter_s, stage_group)
from harmonia.sim.engine import replay
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from tests.unit.test_sim_recompute import _tasks, _work

BATCH = 16


@pytest.fixture(scope="module")
def setup(equal_image_samples):
    return equal_image_samples


def _plan(fsdp: bool) -> Plan:
    return Plan("internvl-8b", {"vision": Layout(dp=2), "llm": Layout(pp=2, dp=2, tp=2, rank_offset=2, fsdp=fsdp)},
                "disjoint", "1f1b", n_microbatches=4, global_batch=BATCH)


def _zero3(cost: CostModel) -> CostModel:
    return CostModel(cost.mllm, cost.device, fsdp_per_microbatch=True)


def test_fsdp_states_keep_weights_and_fp32_gradients_whole_and_shard_the_optimizer(setup) -> None:
    cost, _, _ = setup
    whole, trained = cost.param_count("llm", 0, 10)
    repl, trained_repl = cost.replicated_count("llm", 0, 10)  # norms: whole on every TP rank
    assert 0 < repl < whole / 100
    for tp, shards in ((1, 8), (2, 4), (4, 64)):
        total, trainable = (whole - repl) / tp + repl, (trained - trained_repl) / tp + trained_repl
        runtime = cost.state_bytes("llm", 0, 10, tp, shards)
        assert runtime == pytest.approx(2 * total + 4 * trainable + (4 * total + 12 * trainable) / shards)
        zero3 = _zero3(cost).state_bytes("llm", 0, 10, tp, shards)
        assert zero3 == pytest.approx(cost.state_bytes("llm", 0, 10, tp) / shards)
        assert zero3 < runtime < cost.state_bytes("llm", 0, 10, tp)


def test_each_rank_gathers_its_fsdp_chunks_once_beside_its_first_forward_and_reduces_in_its_last_backward(setup) -> None:
    cost, samples, _ = setup
    cluster = cluster_from_string("h100:2x8")
    slowdown = cluster.device.overlap_slowdown
    plain, fsdp = _plan(False), _plan(True)
    timelines = {}
    for plan in (plain, fsdp):
        tasks, queue, comm = _tasks(cost, plan, _work(cost, samples, plan), cluster)
        timelines[plan.layouts["llm"].fsdp] = (tasks, queue, comm, replay(tasks, queue, comm))
    tasks, queue, comm, timeline = timelines[True]
    plain_tasks = {t.name: t.duration for t in timelines[False][0] if t.kind in ("F", "B", "W", "BW")}
    gathers = rank_gathers_s(cost, cluster, fsdp)
    llm = fsdp.layouts["llm"]
    assert sorted(gathers) == list(llm.rank_list())
    changed = set()
    for rank in llm.rank_list():
        me = llm.coords(rank)
        chunk = me["pp"]
        g = fsdp_gather_s(cost, cluster, fsdp, "llm", chunk, 0, me["cp"], me["tp"])
        assert gathers[rank] == pytest.approx(g)
        gather = comm[rank][0]  # issued first, on the communication stream, at the start
        assert (tasks[gather].name, tasks[gather].kind, tasks[gather].duration) == (f"fsdp gather llm.s{chunk}", "C", g)
        assert timeline.start[gather] == 0.0
        assert not any(tasks[i].name.startswith("fsdp gather") for i in queue[rank] + comm[rank][1:])
        # the first forward computes beside the gather, slowed, and ends after its last block's share
        first = next(i for i in queue[rank] if tasks[i].kind == "F")
        f = plain_tasks[tasks[first].name]
        blocks = chunk_blocks(cost, llm, "llm", chunk)
        assert tasks[first].duration == pytest.approx(f + min(g, f * (1 + slowdown)) * slowdown / (1 + slowdown))
        assert timeline.end[first] >= timeline.end[gather] + f / (blocks + 1) - 1e-12
        # the last fused backward reduce-scatters its blocks inside: the reduction starts before it ends
        # and runs past it at least the last block's and the root group's share
        reduce = next(i for i in comm[rank] if tasks[i].kind == "C" and tasks[i].action is not None)
        last = max(i for i in queue[rank] if tasks[i].kind == "BW")
        assert tasks[reduce].duration == pytest.approx(grad_reduce_s(cost, cluster, fsdp, "llm", chunk, me["cp"], me["tp"]))
        assert timeline.start[reduce] < timeline.end[last]
        exposed = reduce_exposed_s(cost, cluster, fsdp, "llm", chunk)
        assert 0 < exposed < tasks[reduce].duration
        assert timeline.end[reduce] >= timeline.end[last] + exposed - 1e-12
        assert tasks[last].duration > plain_tasks[tasks[last].name]
        changed |= {tasks[first].name, tasks[last].name}
    # every other compute task costs what it costs without FSDP: the gather is not repeated
    assert all(t.duration == pytest.approx(plain_tasks[t.name]) for t in tasks
               if t.kind in ("F", "B", "W", "BW") and t.name not in changed)
    assert not any(t.name.startswith("fsdp gather") for t in tasks if t.rank in fsdp.layouts["vision"].rank_list())
    # the reduction is a reduce-scatter of fp32 gradients
    for chunk in range(llm.pp):
        trainable = cost.param_count("llm", *_range(cost, fsdp, chunk))[1]
        group = stage_group(llm, chunk, "dp")
        assert grad_reduce_s(cost, cluster, fsdp, "llm", chunk) == pytest.approx(
            ring_reduce_scatter_s(trainable * 4 / llm.tp, group, cluster))


def _range(cost, plan, chunk):
    from harmonia.schedule.stagework import stage_layer_range

    return stage_layer_range(cost, plan, "llm", chunk)


def test_zero3_pricing_gathers_before_every_forward_and_backward(setup) -> None:
    cost, samples, _ = setup
    cost3 = _zero3(cost)
    cluster = cluster_from_string("h100:2x8")
    fsdp = _plan(True)
    assert rank_gathers_s(cost3, cluster, fsdp) == {}
    plain = {t.name: t.duration for t in _tasks(cost3, _plan(False), _work(cost3, samples, _plan(False)), cluster)[0]}
    tasks = _tasks(cost3, fsdp, _work(cost3, samples, fsdp), cluster)[0]
    assert not any(t.name.startswith("fsdp gather") for t in tasks)
    gather = fsdp_gather_s(cost3, cluster, fsdp, "llm", 0)
    phases = [t for t in tasks if t.module == "llm" and t.kind in ("F", "B", "BW") and ".s0." in t.name]
    assert len(phases) == 2 * fsdp.n_microbatches * fsdp.layouts["llm"].dp * fsdp.layouts["llm"].tp
    # each phase lasts at least its gather, which hides behind its compute only as far as it is shorter
    assert all(t.duration >= max(gather, plain[t.name]) * (1 - 1e-12) for t in phases)
    assert sum(t.duration for t in phases) > sum(plain[t.name] for t in phases)


def test_the_work_bound_counts_the_gathers_and_stays_below_the_simulation(setup) -> None:
    cost, samples, _ = setup
    cluster = cluster_from_string("h100:2x8")
    for c in (cost, _zero3(cost)):
        for plan in (_plan(True), replace(_plan(True), n_microbatches=2)):
            iw = _work(c, samples, plan)
            tasks, queue, comm = _tasks(c, plan, iw, cluster)
            simulated = replay(tasks, queue, comm).iteration_s
            bound = work_bound(plan, c, cluster, iw)
            assert bound <= simulated * (1 + 1e-9)
            if not c.fsdp_per_microbatch:  # the gathers run beside compute: no rank's busy time counts them
                unfsdp = replace(plan, layouts={**plan.layouts, "llm": replace(plan.layouts["llm"], fsdp=False)})
                busy = work_bound_busy(plan, c, cluster, iw)[1]
                plain = work_bound_busy(unfsdp, c, cluster, _work(c, samples, unfsdp))[1]
                assert rank_gathers_s(c, cluster, plan) and all(busy[r] == pytest.approx(plain[r]) for r in busy)


def test_fitting_adds_fsdp_everywhere_where_it_needs_less_recompute() -> None:
    """A 6B trainable encoder replicated over 4 ranks: on a device where its unsharded optimizer states
    leave no room, FSDP on it fits without recompute, and comes beside the recomputing plan; on a
    device with room, only the plan as found comes."""
    from harmonia.plan.memory import plan_peak_bytes
    from harmonia.plan.recipes import MEMORY_HEADROOM, Candidate, fitting, sharded_everywhere
    from harmonia.plan.scenario import Scenario, ScenarioRun

    run = ScenarioRun(Scenario("s", "omni-38b", "h100:3x8", "synthetic:image=0.5,audio=0.5", 32, iterations=1,
                               search_batches=1))
    plan = Plan("omni-38b", {"vision": Layout(dp=4), "audio": Layout(dp=4, rank_offset=4),
                             "llm": Layout(tp=8, pp=2, rank_offset=8)}, "disjoint", "1f1b", 4, 32)
    sharded = sharded_everywhere(run.cost, plan)
    assert sharded.layouts["vision"].fsdp and not sharded.layouts["llm"].fsdp  # llm dp1: nothing to shard
    peak = {p.layouts["vision"].fsdp: max(plan_peak_bytes(run.cost, p, run.profile).values()) for p in (plan, sharded)}
    assert peak[True] < peak[False]

    def fitted(capacity: float) -> list[tuple[bool, list[str]]]:
        device = replace(run.cluster.device, mem_bytes=capacity / MEMORY_HEADROOM)
        cands = fitting(iter([Candidate("harmonia", plan)]), run.cost, replace(run.cluster, device=device), run.profile)
        return [(c.plan.layouts["vision"].fsdp, c.plan.recompute_text()) for c in cands]

    tight = fitted((peak[True] + peak[False]) / 2)
    assert (True, []) in tight and all(recompute for fsdp, recompute in tight if not fsdp)
    roomy = fitted(peak[False] * 1.01)  # with the whole-module recompute options after the least
    assert roomy[0] == (False, []) and not any(fsdp for fsdp, _ in roomy)


def test_fsdp_where_it_saves_memory() -> None:
    """A trained LLM is sharded over any dp > 1 (6 + 16/dp bytes per weight instead of 16). A frozen
    one held in fp32 (the CPU) only over dp > 2 (2 + 4/dp instead of 4): over 2 replicas it would
    only pay the gather; held in bf16 (a GPU's mixed precision) never (2 + 2/dp instead of 2), but
    resharding per microbatch pays over any dp > 1 (2/dp)."""
    from harmonia.model.presets import mllm_preset
    from harmonia.model.training_mode import ModuleTraining
    from harmonia.plan.candidates import llm_layouts

    mllm = mllm_preset("internvl-8b")
    frozen = replace(mllm, training={"llm": ModuleTraining("frozen")})
    for device, spec, least in (("h100", mllm, 2), ("h100", frozen, 17), ("cpu", frozen, 17)):
        cluster = cluster_from_string(f"{device}:2x8")
        cost = CostModel(spec, cluster.device)
        layouts = list(llm_layouts(cost, cluster, 16, 0, 64))
        assert {lay.dp for lay in layouts} >= {1, 2, 4}
        assert all(lay.fsdp == (lay.dp >= least) for lay in layouts), (device, least)
        for dp in (2, 3, 4):
            assert (cost.state_bytes("llm", 0, 10, 1, dp) < cost.state_bytes("llm", 0, 10)) == (dp >= least)
            assert cost.fsdp_pays("llm", dp) == (dp >= least)
            assert cost.fsdp_pays("llm", dp, reshard=True)
        assert not cost.fsdp_pays("llm", 1, reshard=True)


def test_frozen_weights_cost_two_bytes_under_mixed_precision_four_in_fp32() -> None:
    from harmonia.model.presets import mllm_preset
    from harmonia.model.training_mode import ModuleTraining

    frozen = replace(mllm_preset("internvl-8b"), training={"llm": ModuleTraining("frozen")})
    n = CostModel(frozen, device_preset("h100")).param_count("llm")[0]
    assert CostModel(frozen, device_preset("h100")).state_bytes("llm") == 2 * n
    assert CostModel(frozen, device_preset("cpu")).state_bytes("llm") == 4 * n
    assert CostModel(frozen, device_preset("h100")).state_bytes("llm", fsdp_shards=4) == 2 * n + 2 * n / 4
    assert CostModel(frozen, device_preset("h100")).state_bytes("llm", fsdp_shards=4, reshard=True) == 2 * n / 4


def _resharded(plan: Plan) -> Plan:
    return replace(plan, layouts={**plan.layouts, "llm": replace(plan.layouts["llm"], reshard=True)})


def test_an_llm_laid_out_fsdp_reshard_is_priced_as_zero3_on_its_own(setup) -> None:
    """``fsdp reshard`` on the LLM costs under the runtime's cost model exactly what ZeRO-3 pricing
    of every FSDP layout costs the same plan (the LLM is its only FSDP module): gathers in every
    forward and backward, reduce-scatters in every backward, only the last block's after the last
    backward, every state sharded plus one block gathered whole."""
    from harmonia.plan.candidates import state_bytes_per_rank
    from harmonia.sim.collectives import backward_reduce_s, chunk_blocks

    cost, samples, _ = setup
    cluster = cluster_from_string("h100:2x8")
    plan, zero3 = _resharded(_plan(True)), _zero3(cost)
    assert rank_gathers_s(cost, cluster, plan) == {} and rank_gathers_s(cost, cluster, _plan(True))
    mine = replay(*_tasks(cost, plan, _work(cost, samples, plan), cluster)).iteration_s
    theirs = replay(*_tasks(zero3, _plan(True), _work(zero3, samples, _plan(True)), cluster)).iteration_s
    assert mine == pytest.approx(theirs)
    llm = plan.layouts["llm"]
    for chunk in range(llm.pp):
        whole = backward_reduce_s(cost, cluster, plan, "llm", chunk)
        assert whole > 0 and backward_reduce_s(cost, cluster, _plan(True), "llm", chunk) == 0.0
        assert grad_reduce_s(cost, cluster, plan, "llm", chunk) == pytest.approx(
            whole / chunk_blocks(cost, llm, "llm", chunk))
    held, kept = state_bytes_per_rank(cost, plan), state_bytes_per_rank(cost, _plan(True))
    for rank in llm.rank_list():
        start, stop = _range(cost, plan, llm.coords(rank)["pp"])
        sharded = cost.state_bytes("llm", start, stop, llm.tp) / llm.dp
        assert held[rank] == pytest.approx(sharded + cost.reshard_transient_bytes("llm", start, stop, llm.tp))
        assert held[rank] < kept[rank]
    # its backwards last at least their gather plus reduce-scatter
    tasks = _tasks(cost, plan, _work(cost, samples, plan), cluster)[0]
    floor = fsdp_gather_s(cost, cluster, plan, "llm", 0) + backward_reduce_s(cost, cluster, plan, "llm", 0)
    assert all(t.duration >= floor * (1 - 1e-12) for t in tasks if t.kind == "BW" and t.name.startswith("llm.s0."))
    iw = _work(cost, samples, plan)
    assert work_bound(plan, cost, cluster, iw) <= mine * (1 + 1e-9)


def test_a_resharded_chunks_dp_group_runs_each_gathered_phase_in_lockstep(setup) -> None:
    """Each block's gather completes once every replica of the DP group has issued it: with one
    replica's microbatches heavier than the other's, the two replicas' phases of a microbatch start
    together and what follows either starts after both end; the light replica waits (idle, not
    busy). Without resharding, and within a column simulated alone, nothing couples the replicas."""
    from harmonia.schedule.rank_actions import plan_rank_actions
    from harmonia.schedule.stagework import iteration_schedule
    from harmonia.sim.tasks import build_tasks
    from harmonia.workload.traces import synthesize_trace

    cost, _, _ = setup
    mixed = synthesize_trace(64, {"image": 1.0}, seed=3)
    heavy = sorted(mixed, key=lambda x: -x.text_tokens)
    samples = heavy[:8] + heavy[-8:]  # replica 0 the longest texts, replica 1 the shortest
    cluster = cluster_from_string("h100:2x8")
    plan = _resharded(_plan(True))
    tasks, queue, comm = _tasks(cost, plan, _work(cost, samples, plan), cluster)
    timeline = replay(tasks, queue, comm)
    llm = plan.layouts["llm"]
    members: dict[tuple, list[int]] = {}
    for rank in llm.rank_list():
        me = llm.coords(rank)
        for at, i in enumerate(queue[rank]):
            a = tasks[i].action
            if a is not None and a.module == "llm" and a.kind.value in ("F", "BW"):
                members.setdefault((a.stage, a.microbatch, a.kind, me["cp"], me["tp"]), []).append((rank, at, i))
    assert members and all(len(group) == llm.dp for group in members.values())
    waited = 0
    for group in members.values():
        starts = {timeline.start[i] for _, _, i in group}
        assert max(starts) - min(starts) < 1e-12  # together
        last = max(timeline.end[i] for _, _, i in group)
        for rank, at, i in group:
            if at + 1 < len(queue[rank]):
                assert timeline.start[queue[rank][at + 1]] >= last - 1e-12
        waited += last > min(timeline.end[i] for _, _, i in group) + 1e-6
    assert waited  # the replicas' work differs, so one of them waits
    assert sum(t.duration for t in tasks if t.kind == "C" and t.name.startswith("dp sync")) == 0.0
    assert timeline.bubble_frac > 0
    plain = _plan(True)  # FSDP gathered once per step: no lockstep
    assert not any(t.name.startswith("dp sync") for t in _tasks(cost, plain, _work(cost, samples, plain), cluster)[0])
    schedule = iteration_schedule(plan, cost, _work(cost, samples, plan))
    column = {r: acts for r, acts in plan_rank_actions(plan.layouts, schedule).items()
              if r in llm.rank_list() and llm.coords(r)["dp"] == 0}
    alone = build_tasks(plan, cost, _work(cost, samples, plan), column, schedule.graph, cluster, closed=False)[0]
    assert not any(t.name.startswith("dp sync") for t in alone)


def test_resharding_is_a_variant_the_planner_tries_where_it_needs_less_recompute() -> None:
    """Qwen2.5-72B's LLM over 64 ranks at tp4 pp1: its whole bf16 weights and fp32 gradients (6 B per
    weight / tp = 108 GB) cannot fit an 80 GB device however much it recomputes; resharding per
    microbatch fits it, and under zero bubble (split backward) it is not offered."""
    from harmonia.plan.recipes import Candidate, fitting, resharded
    from harmonia.plan.scenario import Scenario, ScenarioRun

    run = ScenarioRun(Scenario("b", "omni-72b", "h100:8x8", "synthetic:image=1", 64, iterations=1,
                               search_batches=1))
    llm = Layout(tp=4, dp=16, fsdp=True)
    plan = Plan("omni-72b", {"vision": Layout(dp=64), "audio": Layout(dp=64), "llm": llm}, "colocated",
                "1f1b", 4, 64)
    got = [c.plan for c in fitting(iter([Candidate("harmonia", plan)]), run.cost, run.cluster, run.profile)]
    assert got and all(p.layouts["llm"].resharded and p.layouts["llm"].describe() == "tp4 pp1 dp16 fsdp reshard"
                       for p in got)
    assert resharded(run.cost, replace(plan, schedule="zb")) is None
    assert resharded(run.cost, got[0]) is None  # already resharded


def test_compute_beside_a_collective_runs_slower_by_the_devices_overlap_slowdown(setup) -> None:
    """A resharding unit's gathers and reduce-scatters hide behind its compute, which runs
    ``1 + overlap_slowdown`` times slower while they do: the unit lasts its communication when the
    slowed compute ends within it, else its compute plus ``comm x s / (1 + s)``; a device without
    the slowdown hides them entirely behind longer compute."""
    from harmonia.sim.tasks import overlapped_extra
    from harmonia.workload.devices import ClusterSpec

    assert overlapped_extra(1.0, 3.0, 0.0) == 0.0 and overlapped_extra(3.0, 1.0, 0.0) == 2.0
    assert overlapped_extra(0.0, 3.0, 0.5) == 0.0
    assert overlapped_extra(1.0, 3.0, 0.5) == pytest.approx(1.0 / 3.0)  # 2/3 of the compute done by then
    assert overlapped_extra(2.0, 1.0, 0.5) == pytest.approx(1.0)  # 1 x 1.5 <= 2: the collectives' 2 s
    cost, samples, _ = setup
    plan = _resharded(_plan(True))
    h100 = cluster_from_string("h100:2x8")
    assert h100.device.overlap_slowdown == pytest.approx(0.189)
    free = ClusterSpec(replace(h100.device, overlap_slowdown=0.0), h100.n_nodes)
    iw = _work(cost, samples, plan)
    slowed = {t.name: t.duration for t in _tasks(cost, plan, iw, h100)[0] if t.module == "llm"}
    alone = {t.name: t.duration for t in _tasks(cost, plan, iw, free)[0] if t.module == "llm"}
    assert all(slowed[n] >= alone[n] for n in alone) and sum(slowed.values()) > sum(alone.values())


def test_a_jobs_precision_sets_what_a_frozen_weight_costs_the_plan() -> None:
    """``train.precision`` reaches the planner: fp32 on a GPU holds frozen weights in fp32, bf16 on
    the CPU in bf16, ``auto`` as the device kind runs (`harmonia.train.planning.PRECISION_MIXED`)."""
    from harmonia.plan.scenario import Scenario, ScenarioRun
    from harmonia.train.planning import PRECISION_MIXED

    def frozen_bytes(cluster: str, precision: str) -> int:
        scenario = Scenario("p", "internvl-8b", cluster, "text:64", 8, {"llm": "frozen"}, iterations=1,
                            memory_batches=0, mixed_precision=PRECISION_MIXED[precision])
        return ScenarioRun(scenario).cost.frozen_bytes

    assert [frozen_bytes("h100:1x8", p) for p in ("auto", "bf16", "fp32")] == [2, 2, 4]
    assert [frozen_bytes("cpu:1x4", p) for p in ("auto", "bf16", "fp32")] == [4, 2, 4]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2])
def test_fsdp_units_priced_are_the_runtimes(tied: bool, pp: int) -> None:
    """Each FSDP2 unit the runtime wraps (`fsdp_units`, then the root with the rest) holds the
    parameters the cost model prices for it, a last stage's copy of a tied embedding in its head's."""
    from harmonia.model.presets import mllm_preset
    from harmonia.runtime.parallelize import build_stage_modules, fsdp_units
    from harmonia.schedule.stagework import stage_layer_range

    spec = mllm_preset("tiny-vlm")
    spec = replace(spec, llm=replace(spec.llm, tie_embeddings=tied))
    cost = CostModel(spec, device_preset("h100"))
    plan = Plan("tiny-vlm", {"vision": Layout(), "llm": Layout(pp=pp)})
    for chunk in range(pp):
        (module,) = build_stage_modules(spec, "llm", plan.layouts["llm"], chunk).values()
        units = [sum(p.numel() for u in (unit if isinstance(unit, list) else [unit]) for p in u.parameters())
                 for unit in fsdp_units(module)]
        root = sum(p.numel() for p in module.parameters()) - sum(units)
        priced = [n for n, _ in cost.fsdp_unit_counts("llm", *stage_layer_range(cost, plan, "llm", chunk))]
        assert [root, *units] == priced, f"chunk {chunk}"
