"""Activation recomputation in the cost model, simulator and planner: B runs the blocks' forward
again, the stage keeps only each block's input, and a plan that fits only with recompute gets it."""

from dataclasses import replace

import pytest

from harmonia.cli import main
from harmonia.plan.candidates import state_bytes_per_rank
from harmonia.plan.memory import plan_peak_bytes
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.rank_actions import plan_rank_actions
from harmonia.schedule.stagework import StageKey, iteration_schedule, plan_iteration_work, stage_layer_range
from harmonia.sim.engine import replay
from harmonia.sim.tasks import build_tasks
from harmonia.sim.memory import activation_bound
from harmonia.workload.devices import cluster_from_string
from harmonia.workload.work import ModuleLoad, sample_loads
from tests.unit.iteration_helpers import assignment

BATCH = 16


@pytest.fixture(scope="module")
def setup(equal_image_samples):
    return equal_image_samples


def _plan(recompute, schedule="1f1b", llm=Layout(pp=4, dp=1, tp=2, rank_offset=2)):
    return Plan("internvl-8b", {"vision": Layout(dp=2), "llm": llm}, "disjoint", schedule, n_microbatches=4,
                global_batch=BATCH, recompute=recompute)


def _work(cost, samples, plan):
    per_replica = [[list(range(d * 8 + 2 * i, d * 8 + 2 * i + 2)) for i in range(plan.n_microbatches)]
                   for d in range(plan.layouts["llm"].dp)]
    return plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, per_replica))


def _tasks(cost, plan, iw, cluster):
    schedule = iteration_schedule(plan, cost, iw)
    return build_tasks(plan, cost, iw, plan_rank_actions(plan.layouts, schedule), schedule.graph, cluster)


def _blocks(cost, module, start, stop):
    """[lo, hi) of the transformer blocks among layers [start, stop)."""
    idx = [i for i in range(start, stop) if cost.layers[module][i].kind == "block"]
    return idx[0], idx[-1] + 1


def test_recomputed_stage_backward_is_plain_backward_plus_its_blocks_forward(setup) -> None:
    cost, samples, _ = setup
    plain, again = _plan(()), _plan(("llm", "vision"))
    iw_plain, iw_again = _work(cost, samples, plain), _work(cost, samples, again)
    checked = 0
    for (key, m, sub), work in iw_plain.work.items():
        redo = iw_again.work[(key, m, sub)]
        start, stop = stage_layer_range(cost, plain, key.module, key.stage)
        lo, hi = _blocks(cost, key.module, start, stop)
        layout = plain.layouts[key.module]
        load = (sum((sample_loads(samples[i], cost.mllm)["llm"] for i in llm_samples(iw_plain, key.replica, m)),
                    ModuleLoad())
                if key.module == "llm" else None)
        if load is not None:
            forward = cost.stage_times("llm", load, lo, hi, layout.tp, layout.cp).F
            assert redo.times.B == pytest.approx(work.times.B + forward, rel=1e-12)
            assert forward > 0.2 * work.times.F  # the blocks are most of the stage
            checked += 1
        assert redo.times.F == work.times.F and redo.times.W == work.times.W
        assert redo.times.B >= work.times.B
    assert checked == 4 * 4
    # the simulator's B tasks add that compute and, at tp 2, the recomputed forward's all-reduces
    cluster = cluster_from_string("h100x8")
    b = {}
    for plan, iw in ((plain, iw_plain), (again, iw_again)):
        tasks, _, _ = _tasks(cost, plan, iw, cluster)
        b[plan.recompute] = {(t.rank, t.action): t.duration for t in tasks if t.kind == "B" and t.module == "llm"}
    for (rank, a), seconds in b[again.recompute].items():
        key = StageKey("llm", 0, a.stage)
        extra = iw_again.work[(key, a.microbatch, None)].times.B - iw_plain.work[(key, a.microbatch, None)].times.B
        assert seconds > b[()][(rank, a)] + extra


def llm_samples(iw, d, m):
    """Batch positions of LLM replica ``d``'s samples of global microbatch ``m``."""
    samples = iw.assignment.microbatches[m]
    return [samples[p] for p in iw.assignment.llm_split[m][d]]


def test_recomputed_stage_keeps_only_each_block_input(setup) -> None:
    cost, samples, _ = setup
    hidden = cost.mllm.llm.body.hidden
    for tp, cp in ((1, 1), (2, 1), (2, 2), (4, 2)):
        for start, stop in ((1, 9), (5, 20)):  # blocks only: no embedding or head
            tokens = 4096
            kept = cost.activation_bytes("llm", tokens, start, stop, tp, cp, recompute=True)
            assert kept == pytest.approx((stop - start) * tokens / cp * hidden * cost.act_bytes, rel=1e-12)
            full = cost.activation_bytes("llm", tokens, start, stop, tp, cp)
            assert kept < full
    plan = _plan(("llm",))
    iw = _work(cost, samples, plan)
    for (key, _, _), work in iw.work.items():
        if key.module == "llm" and 0 < key.stage < 3:  # middle stages hold blocks only
            start, stop = stage_layer_range(cost, plan, "llm", key.stage)
            assert work.act_bytes == pytest.approx((stop - start) * work.tokens * hidden * cost.act_bytes, rel=1e-12)
            assert work.transient > 0


@pytest.mark.parametrize("recompute", [("llm",), ("llm", "vision")])
def test_recompute_lowers_the_simulated_peak_and_the_estimate_bounds_it(setup, recompute) -> None:
    cost, samples, profile = setup
    cluster = cluster_from_string("h100x8")
    peaks = {}
    for modules in ((), recompute):
        plan = _plan(modules, llm=Layout(pp=2, dp=2, rank_offset=2))
        iw = _work(cost, samples, plan)
        acts = replay(*_tasks(cost, plan, iw, cluster)).peak_mem
        bound = activation_bound(iw)  # recomputed blocks' transients included
        assert all(bound.get(r, 0.0) >= v * (1 - 1e-12) for r, v in acts.items())
        states = state_bytes_per_rank(cost, plan)
        simulated = {r: states[r] + acts.get(r, 0.0) for r in states}
        estimate = plan_peak_bytes(cost, plan, profile)
        for rank in simulated:
            assert simulated[rank] <= estimate[rank] * (1 + 1e-9), rank
        peaks[modules] = simulated
    for rank in plan.layouts["llm"].rank_list():
        assert peaks[recompute][rank] < peaks[()][rank]


def test_plan_that_fits_only_with_recompute_gets_it(tmp_path) -> None:
    """internvl-8b, every module trained, with a 64-sample batch on 4 H100s: no layout fits without recompute."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "internvl-8b", "--frozen", "", "--cluster", "h100:1x4", "--trace",
                 "synthetic:image=1", "--global-batch", "64", "--batches", "1", "--top", "3", "--json", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.recompute
    # and without it the same plan is over the device
    from harmonia.plan.scenario import Scenario, ScenarioRun

    run = ScenarioRun(Scenario("s", "internvl-8b", "h100:1x4", "synthetic:image=1", 64, iterations=1,
                               search_batches=1))
    cap = run.cluster.device.mem_bytes * 0.9
    assert max(plan_peak_bytes(run.cost, replace(plan, recompute=(), recompute_fraction={}), run.profile).values()) > cap
    assert max(plan_peak_bytes(run.cost, plan, run.profile).values()) <= cap


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_a_share_recomputes_the_first_blocks_of_each_stage(setup, share) -> None:
    """Partial recompute (Megatron-LM's block method): B adds the F of the first ceil(share x n)
    blocks of each stage, those blocks keep only their inputs, the rest keep everything."""
    import math

    cost, samples, profile = setup
    hidden = cost.mllm.llm.body.hidden
    plain, full = _plan(()), _plan(("llm",))
    part = replace(full, recompute_fraction={"llm": share})
    assert part.recompute_share("llm") == share and part.recompute_text() == [f"llm:{share:g}"]
    works = {p.recompute_key: _work(cost, samples, p) for p in (plain, full, part)}
    for (key, m, sub), work in works[()].work.items():
        if key.module != "llm":
            continue
        start, stop = stage_layer_range(cost, plain, "llm", key.stage)
        lo, hi = _blocks(cost, "llm", start, stop)
        k = math.ceil(share * (hi - lo))
        load = sum((sample_loads(samples[i], cost.mllm)["llm"] for i in llm_samples(works[()], key.replica, m)),
                   ModuleLoad())
        again = cost.stage_times("llm", load, lo, lo + k, plain.layouts["llm"].tp).F
        got = works[part.recompute_key].work[(key, m, sub)]
        assert got.times.B == pytest.approx(work.times.B + again, rel=1e-12)
        assert work.times.B < got.times.B < works[full.recompute_key].work[(key, m, sub)].times.B
        kept_inputs = k * work.tokens * hidden * cost.act_bytes
        rest = cost.activation_bytes("llm", work.tokens, start, stop, 2) - cost.activation_bytes(
            "llm", work.tokens, lo, lo + k, 2)
        assert got.act_bytes == pytest.approx(rest + kept_inputs, rel=1e-9)
    # the estimate still bounds the simulated peak, which falls between none and full recompute
    cluster = cluster_from_string("h100x8")
    peaks = {}
    for plan in (plain, part, full):
        plan = replace(plan, layouts={"vision": Layout(dp=2), "llm": Layout(pp=2, dp=2, rank_offset=2)})
        iw = _work(cost, samples, plan)
        acts = replay(*_tasks(cost, plan, iw, cluster)).peak_mem
        assert all(activation_bound(iw).get(r, 0.0) >= v * (1 - 1e-12) for r, v in acts.items())
        states = state_bytes_per_rank(cost, plan)
        peaks[plan.recompute_key] = {r: states[r] + acts.get(r, 0.0) for r in states}
        estimate = plan_peak_bytes(cost, plan, profile)
        assert all(peaks[plan.recompute_key][r] <= estimate[r] * (1 + 1e-9) for r in estimate)
    rank = 2  # the first LLM stage holds the most microbatches in flight
    assert peaks[full.recompute_key][rank] < peaks[part.recompute_key][rank] < peaks[()][rank]


def _share(option, module: str) -> float:
    modules, shares = option
    return shares.get(module, 1.0) if module in modules else 0.0


def test_recompute_options_cover_every_share_of_each_module_least_work_first(setup) -> None:
    from harmonia.plan.recipes import recompute_options

    cost, _, _ = setup
    options = recompute_options(cost, _plan(()))
    assert options[0] == ((), {}) and options[-1] == (("llm", "vision"), {})
    assert len({(m, tuple(sorted(s.items()))) for m, s in options}) == len(options) == 25  # 5 shares x 5 shares
    for option in ((("vision",), {}), (("llm",), {"llm": 0.25}), (("llm", "vision"), {"llm": 0.5, "vision": 0.75})):
        assert option in options
    weights = {"llm": 10.0, "vision": 1.0}
    weighted = recompute_options(cost, _plan(()), weights)
    extra = [sum(w * _share(o, m) for m, w in weights.items()) for o in weighted]
    assert extra == sorted(extra)
    # the encoder whole costs less than a quarter of the LLM here, so it comes first
    assert weighted.index((("vision",), {})) < weighted.index((("llm",), {"llm": 0.25}))
    # a plan that already recomputes half the LLM is offered no less
    half = replace(_plan(("llm",)), recompute_fraction={"llm": 0.5})
    assert all(_share(o, "llm") >= 0.5 for o in recompute_options(cost, half))
    assert recompute_options(cost, _plan((), schedule="zb")) == [((), {})]


def test_fitting_recomputes_only_the_encoder_when_that_is_the_least_that_fits() -> None:
    """Long videos on 64 H100s: the vision encoder's activations (every frame's 1025 tokens) do not
    fit beside the LLM's (its loss's gradients included), whose own fit; recomputing the whole encoder
    is the least that fits (three quarters of it is not), and whole-module options recomputing more
    follow it (heavier batches than the mean)."""
    from harmonia.plan.recipes import Candidate, fitting, recompute_options
    from harmonia.plan.scenario import Scenario, ScenarioRun

    run = ScenarioRun(Scenario("e", "internvl-8b", "h100:8x8", "synthetic:long_video=0.5,image=0.35,text=0.15",
                               128, iterations=1, search_batches=1, memory_batches=0))
    plan = Plan("internvl-8b", {"vision": Layout(dp=64), "llm": Layout(tp=4, dp=16, fsdp=True)}, "colocated",
                "1f1b", 4, 128)
    got = [c.plan for c in fitting(iter([Candidate("harmonia", plan)]), run.cost, run.cluster, run.profile)]
    assert [p.recompute_text() for p in got[:2]] == [["vision"], ["llm", "vision"]]
    assert not any(p.layouts["llm"].reshard for p in got[:2])
    # the LLM resharding per microbatch frees room for more encoder activations: less recompute
    assert [(p.recompute_text(), p.layouts["llm"].reshard) for p in got[2:]] == [(["vision:0.75"], True)]
    cap = run.cluster.device.mem_bytes * 0.9
    peak = {(m, tuple(s.items())): max(plan_peak_bytes(run.cost, replace(plan, recompute=m, recompute_fraction=s),
                                                       run.profile).values())
            for m, s in recompute_options(run.cost, plan)}
    assert peak[((), ())] > cap and peak[(("vision",), (("vision", 0.75),))] > cap >= peak[(("vision",), ())]
    options = recompute_options(run.cost, plan, run.profile.mean_costs())
    first = options.index((("vision",), {}))
    assert all(peak[(m, tuple(s.items()))] > cap for m, s in options[:first])


def test_plan_json_and_layout_text_carry_the_share(setup, tmp_path) -> None:
    from harmonia.errors import ConfigError
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts

    cost, _, _ = setup
    plan = plan_from_layouts(cost.mllm, "internvl-8b", parse_layouts("vision dp2; llm tp2 pp2"), 6, BATCH,
                             recompute=("llm:0.5", "vision"))
    assert plan.recompute == ("llm", "vision") and plan.recompute_share("llm") == 0.5
    assert plan.recompute_share("vision") == 1.0 and plan.recompute_text() == ["llm:0.5", "vision"]
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    with pytest.raises(ConfigError, match="llm:half"):
        plan_from_layouts(cost.mllm, "internvl-8b", parse_layouts("vision dp2; llm tp2 pp2"), 6, BATCH,
                          recompute=("llm:half",))
    with pytest.raises(ConfigError, match="share in"):
        replace(plan, recompute_fraction={"llm": 1.5})
    with pytest.raises(ConfigError, match="share in"):
        replace(plan, recompute=("vision",))


def test_tp_and_cp_collectives_inside_a_unit_are_the_collective_functions(setup) -> None:
    """The simulator prices a unit's TP all-reduces and CP K/V all-gathers from factors kept per
    stage chunk; they equal `tp_allreduce_s` and `cp_kv_gather_s`, once per pass (a recomputing
    backward runs its recomputed blocks' forward again), bit for bit."""
    from harmonia.sim.collectives import chunk_blocks, cp_kv_gather_s, tp_allreduce_s
    from harmonia.sim.tasks import collective_extra
    from harmonia.schedule.stagework import stage_ranks

    cost, samples, _ = setup
    cluster = cluster_from_string("h100:2x8")
    for llm in (Layout(pp=2, tp=2, cp=2, rank_offset=2), Layout(pp=1, cp=2, dp=2, rank_offset=2)):
        plan = replace(_plan(("llm",), llm=llm), recompute_fraction={"llm": 0.5})
        iw, cache, checked = _work(cost, samples, plan), {}, 0
        for (key, m, sub), work in iw.work.items():
            if key.module != "llm":
                continue
            ranks = stage_ranks(plan, "llm", key.replica, key.stage)
            blocks = chunk_blocks(cost, llm, "llm", key.stage)
            for kind, passes in (("F", 1), ("B", 1.5), ("BW", 1.5), ("W", 0)):
                want = passes * tp_allreduce_s(cost, cluster, llm, "llm", blocks, work.tokens, ranks[: llm.tp])
                want += passes * cp_kv_gather_s(cost, cluster, llm, "llm", blocks, work.tokens, ranks[:: llm.tp])
                assert collective_extra(plan, cost, key, work, kind, cluster, cache) == want, (kind, key)
                checked += want > 0
        assert checked
