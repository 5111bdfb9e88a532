"""The planner's memory model: every module on every rank, in-flight activations under the schedule,
and the search's rejection of plans whose simulated peak exceeds the device."""

from collections import Counter
from dataclasses import replace

import pytest

from harmonia.plan.candidates import state_bytes_per_rank
from harmonia.plan.memory import plan_peak_bytes
from harmonia.plan.recipes import candidates
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import _Scorer
from harmonia.plan.branch_bound import branch_and_bound as _branch_and_bound
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import iteration_schedule, plan_iteration_work
from harmonia.sim.tasks import simulate_schedule
from harmonia.workload.devices import cluster_from_string
from tests.unit.iteration_helpers import assignment

BATCH = 16


@pytest.fixture(scope="module")
def equal_samples(equal_image_samples):
    return equal_image_samples


def _plan(layouts, schedule):
    return Plan("internvl-8b", layouts, "disjoint", schedule, n_microbatches=4, global_batch=BATCH)


def _simulated_peaks(cost, samples, plan):
    per_replica = [[list(range(d * 8 + 2 * i, d * 8 + 2 * i + 2)) for i in range(4)] for d in range(2)]
    iw = plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, per_replica))
    timeline = simulate_schedule(plan, cost, cluster_from_string("h100x8"), iw, iteration_schedule(plan, cost, iw))
    states = state_bytes_per_rank(cost, plan)
    acts = timeline.peak_mem
    return {r: states.get(r, 0.0) + acts.get(r, 0.0) for r in states}, acts


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
@pytest.mark.parametrize("vision", [Layout(dp=1), Layout(dp=2)], ids=["serves-2", "serves-1"])
def test_estimate_bounds_the_simulated_peak_of_every_rank(equal_samples, schedule, vision) -> None:
    cost, samples, profile = equal_samples
    plan = _plan({"vision": vision, "llm": Layout(pp=2, dp=2, rank_offset=vision.dp)}, schedule)
    estimate = plan_peak_bytes(cost, plan, profile)
    simulated, acts = _simulated_peaks(cost, samples, plan)
    assert set(estimate) == set(simulated) == set(range(vision.dp + 4))  # encoder ranks included
    for rank in simulated:
        assert simulated[rank] <= estimate[rank] * (1 + 1e-9), rank
    # the encoder's gate is what the estimate counts: its rank reaches it (to within a microbatch)
    states = state_bytes_per_rank(cost, plan)
    per_mb = max(acts[0] / 3, 1.0)
    assert estimate[0] - states[0] - acts[0] <= per_mb * (2 if vision.dp == 1 else 1) * 1.5


@pytest.mark.parametrize("recompute", [(), ("llm", "vision")])
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_the_stage_work_floor_never_exceeds_the_simulated_peak(equal_samples, schedule, recompute) -> None:
    """The search rejects a plan unsimulated when its stage work's floor is over the device: the
    floor (states plus one unit's kept and recomputed activations) must be reached on every rank."""
    from harmonia.plan.memory import work_peak_floor

    cost, samples, _ = equal_samples
    plan = replace(_plan({"vision": Layout(dp=2), "llm": Layout(pp=2, dp=2, rank_offset=2)}, schedule),
                   recompute=recompute)
    per_replica = [[list(range(d * 8 + 2 * i, d * 8 + 2 * i + 2)) for i in range(4)] for d in range(2)]
    iw = plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, per_replica))
    floor = work_peak_floor(cost, plan, iw)
    simulated, _ = _simulated_peaks(cost, samples, plan)
    states = state_bytes_per_rank(cost, plan)
    assert set(floor) == set(simulated)
    for rank in simulated:
        assert states[rank] < floor[rank] <= simulated[rank] * (1 + 1e-9), rank


def test_an_encoder_replica_serving_more_llm_replicas_holds_more(equal_samples) -> None:
    cost, _, profile = equal_samples
    one = plan_peak_bytes(cost, _plan({"vision": Layout(dp=2), "llm": Layout(pp=2, dp=2, rank_offset=2)}, "1f1b"),
                          profile)
    two = plan_peak_bytes(cost, _plan({"vision": Layout(dp=1), "llm": Layout(pp=2, dp=2, rank_offset=1)}, "1f1b"),
                          profile)
    states = cost.state_bytes("vision") + cost.state_bytes("vision_proj")
    # dp1 encodes both LLM replicas' samples of every microbatch at once; dp2 one replica's each
    assert two[0] - states == pytest.approx(2 * (one[0] - states))


def test_colocated_encoders_add_to_the_llm_ranks(equal_samples) -> None:
    cost, _, profile = equal_samples
    llm = Layout(pp=2, dp=2)
    alone = plan_peak_bytes(cost, _plan({"vision": Layout(dp=2, rank_offset=4), "llm": llm}, "1f1b"), profile)
    shared = plan_peak_bytes(cost, replace(_plan({"vision": Layout(dp=4), "llm": llm}, "1f1b"),
                                           placement="colocated"), profile)
    assert all(shared[r] > alone[r] for r in range(4))


def test_search_rejects_plans_whose_simulated_peak_exceeds_the_device(shared_traces) -> None:
    scenario = Scenario("m", "internvl-8b", "h100:1x4", str(shared_traces / "chartqa.csv"), 32,
                        iterations=1, search_batches=1, memory_batches=0)
    run = ScenarioRun(scenario)
    cands = list(candidates("harmonia", run.cost, run.cluster, run.profile, 32, scenario.model))
    scorer = _Scorer(run, [1])
    ranked, _, _ = _branch_and_bound(scorer, cands, [1], len(cands), Counter())
    peaks = sorted(scorer.peak_bytes.values())
    # a device just below the median simulated peak: the plans above it must go, counted under one reason
    cap = peaks[len(peaks) // 2] * 0.999
    run.cluster = replace(run.cluster, device=replace(run.cluster.device, mem_bytes=cap))
    scorer, rejected = _Scorer(run, [1]), Counter()
    kept, _, _ = _branch_and_bound(scorer, cands, [1], len(cands), rejected)
    over = {why: n for why, n in rejected.items() if why.startswith("memory: peak")}
    assert list(over) == [f"memory: peak above the device's {cap / 2**30:.0f} GiB"]
    assert 0 < len(kept) < len(ranked)
    from harmonia.plan.search import simulation_key
    assert all(scorer.peak_bytes[simulation_key(c, run.cost)] <= cap for _, _, c in kept)
    assert [c for _, _, c in kept] == [c for _, _, c in ranked
                                       if scorer.peak_bytes.get(simulation_key(c, run.cost), 0.0) <= cap]


def test_search_rejects_plans_that_fit_their_scored_batch_but_not_a_heavier_one(shared_traces) -> None:
    """A plan is timed on its search batches but trains on every batch: before it is ranked it must
    fit the scenario's memory batches too (never scored for time)."""
    from harmonia.plan.search import simulation_key

    scenario = Scenario("m", "internvl-8b", "h100:1x4", str(shared_traces / "chartqa.csv"), 32,
                        iterations=1, search_batches=1, memory_batches=4)
    run = ScenarioRun(scenario)
    cands = list(candidates("harmonia", run.cost, run.cluster, run.profile, 32, scenario.model))[:12]
    scored, heavier = {}, {}
    for cand in cands:
        scorer, key = _Scorer(run, [1]), simulation_key(cand, run.cost)
        scorer.simulate(cand, key, 0)
        scored[key] = scorer.peak_bytes[key]
        assert scorer.heavier_batches_over(cand, key) is None  # an 80 GiB device holds them all
        heavier[key] = scorer.peak_bytes[key]
    key = max(heavier, key=lambda k: heavier[k] / scored[k])
    assert heavier[key] > scored[key], "some memory batch needs more than the scored one"
    cand = next(c for c in cands if simulation_key(c, run.cost) == key)
    cap = (scored[key] + heavier[key]) / 2  # the scored batch fits, a heavier one does not
    run.cluster = replace(run.cluster, device=replace(run.cluster.device, mem_bytes=cap))
    rejected = Counter()
    kept, _, _ = _branch_and_bound(_Scorer(run, [1]), [cand], [1], 1, rejected)
    assert kept == [] and rejected == Counter({f"memory: peak above the device's {cap / 2**30:.0f} GiB on a "
                                               "heavier batch": 1})


@pytest.mark.parametrize("virtual", [2, 4])
def test_interleaved_estimate_counts_the_rank_gate_not_every_chunk_depth(equal_samples, virtual) -> None:
    cost, samples, profile = equal_samples
    llm = Layout(pp=2, dp=2, rank_offset=1, virtual_stages=virtual)
    plan = _plan({"vision": Layout(dp=1), "llm": llm}, "interleaved")
    estimate = plan_peak_bytes(cost, plan, profile)
    simulated, acts = _simulated_peaks(cost, samples, plan)
    states = state_bytes_per_rank(cost, plan)
    for rank in simulated:
        assert simulated[rank] <= estimate[rank] * (1 + 1e-9), rank
    # equal microbatches: the LLM ranks hold about what the rank's gate admits (its largest chunk
    # forwards); summing every chunk's 1F1B depth instead would count 14 chunk forwards on the first
    # rank at v = 4 where the gate admits 9
    for rank in llm.rank_list():
        held = estimate[rank] - states[rank]
        assert acts[rank] <= held * (1 + 1e-9)
        assert held <= acts[rank] * 1.4, (rank, held, acts[rank])


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_recompute_peaks_equal_the_peak_of_each_options_plan(equal_samples, schedule) -> None:
    """The planner prices every recompute option of a candidate at once; each must be the peak of
    that option's own plan, states (FSDP resharding included) and transients alike."""
    from harmonia.plan.memory import recompute_peaks
    from harmonia.plan.recipes import recompute_options

    cost, _, profile = equal_samples
    llm = Layout(pp=2, dp=2, rank_offset=2, virtual_stages=2 if schedule == "interleaved" else 1, fsdp=True,
                 reshard=True)
    plan = _plan({"vision": Layout(dp=2, fsdp=True), "llm": llm}, schedule)
    options = recompute_options(cost, plan)
    assert len(options) > 10
    shares = [{m: (o[1].get(m, 1.0) if m in o[0] else 0.0) for m in plan.layouts} for o in options]
    got = recompute_peaks(cost, plan, profile, shares)
    for option, peak in zip(options, got):
        own = replace(plan, recompute=option[0], recompute_fraction=option[1])
        assert peak == pytest.approx(max(plan_peak_bytes(cost, own, profile).values()), rel=1e-12)
    assert len(set(got)) > 1


def test_a_given_plan_whose_states_exceed_the_device_is_refused_before_any_process(tmp_path, monkeypatch) -> None:
    """An 8B LLaVA replicated on 2 CPU ranks holds 16 bytes of states per trained weight on each:
    far over a CPU rank's 16 GiB; refused naming the rank, each module's share and the device.
    Sharded over both ranks with the LLM frozen it fits."""
    from harmonia.config import load_config
    from harmonia.errors import LayoutError
    from harmonia.model.presets import mllm_preset
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
    from harmonia.train.planning import load_training_plan

    def job(layouts: str, *extra: str):
        plan_from_layouts(mllm_preset("llava-siglip-8b"), "llava-siglip-8b", parse_layouts(layouts), 2, 32).save(
            tmp_path / "plan.json")
        return load_config(None, ["--model.preset=llava-siglip-8b", "--parallel.world_size=2",
                                  f"--parallel.plan={tmp_path / 'plan.json'}", *extra])

    monkeypatch.setattr("harmonia.train.backend.host_memory_bytes", lambda: 32 * 2**30)  # 16 GiB per rank
    with pytest.raises(LayoutError, match=r"rank 0 would hold 1\d\d\.\d GiB of weights, gradients and optimizer "
                                          r"states \(vision \d+\.\d GiB, llm 1\d\d\.\d GiB\) .* over the "
                                          r"CPU share \(host memory / ranks\)'s 16 GiB"):
        load_training_plan(job("vision dp2; llm dp2"))
    plan = load_training_plan(job("vision dp2 fsdp; llm dp2 fsdp reshard", "--model.frozen=llm,vision",
                                  "--train.precision=bf16"))
    assert plan.layouts["llm"].reshard
