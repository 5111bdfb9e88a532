"""Encoder items cut over the replicas feeding an LLM replica (`harmonia.schedule.item_cuts`): every
slot encoded once, shares of about equal seconds, the stage work and boundary rows of the whole, and
a shorter simulated step where long videos meet more encoder replicas than samples."""

from __future__ import annotations

import numpy as np
import pytest

from harmonia.model.presets import mllm_preset
from harmonia.plan.recipes import Candidate, assign, candidate_schedule
from harmonia.schedule.item_cuts import cut_encoder_items, encoder_items, item_seconds, kept_parts, slot_unit
from harmonia.schedule.iteration import feeding_replicas
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import plan_iteration_work
from harmonia.sim.tasks import simulate_schedule
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.shapes import llm_tokens_of_item
from harmonia.workload.traces import synthesize_trace

COST = CostModel(mllm_preset("internvl-8b"), device_preset("h100"))
SPEC = COST.mllm.encoders["vision"]
CLUSTER = cluster_from_string("h100:1x8")


def _plan(n_microbatches: int = 4) -> Plan:
    """vision tp1 dp8 beside an LLM tp2 cp2 dp2 on 8 ranks: 4 encoder replicas per LLM replica."""
    return Plan("internvl-8b", {"vision": Layout(dp=8), "llm": Layout(tp=2, cp=2, dp=2)}, "colocated", "1f1b",
                n_microbatches=n_microbatches, global_batch=4 * n_microbatches, recompute=("vision",))


@pytest.fixture(scope="module")
def batch():
    plan = _plan()
    shapes = synthesize_trace(plan.global_batch, {"long_video": 0.5, "image": 0.5}, seed=5)
    costs = COST.costs_from_loads(*_loads(shapes))
    tokens = np.array([COST.sample_loads(s)["llm"].tokens for s in shapes])
    cand = Candidate("harmonia", plan)
    return plan, shapes, assign(cand, costs, tokens, COST), assign(cand, costs, tokens, COST, shapes)


def _loads(shapes):
    from harmonia.workload.work import load_arrays

    return load_arrays(shapes, COST.mllm)


def test_kept_parts_walk_a_share_item_by_item() -> None:
    assert kept_parts(2, None) == [(0, 0, None), (1, 0, None)]
    assert kept_parts(3, ((0, 4), (2, 1), 0)) == [(0, 4, None), (1, 0, None), (2, 0, 1)]
    assert kept_parts(3, ((1, 0), (2, 0), 0)) == [(1, 0, None)]
    assert kept_parts(1, ((0, 2), (1, 0), 0)) == [(0, 2, None)]


def test_every_slot_is_encoded_once_in_shares_of_about_equal_seconds(batch) -> None:
    plan, shapes, whole, cut = batch
    feeds = feeding_replicas(plan, "vision")
    assert any(cut.encoder_cuts["vision"])  # the videos are cut
    for m, samples in enumerate(cut.microbatches):
        for d, positions in enumerate(cut.llm_split[m]):
            seconds = {r: 0.0 for r in feeds[d]}
            for p in positions:
                items = encoder_items(shapes[samples[p]], SPEC)
                slots = {k: set() for k in range(len(items))}
                rows = 0
                for r in feeds[d]:
                    if p not in cut.encoder_split["vision"][m][r]:
                        continue
                    share = cut.cut("vision", m, r, p)
                    for k, a, b in kept_parts(len(items), share):
                        unit = slot_unit(items[k], SPEC)
                        n = unit[0] * unit[1] if unit else 1
                        stop = n if b is None else b
                        assert not slots[k] & set(range(a, stop)), "a slot encoded twice"
                        slots[k] |= set(range(a, stop))
                        seconds[r] += float(item_seconds(COST, "vision", [items[k]])[0]) * (stop - a) / n
                    if share is not None:
                        rows += share[2]
                    else:
                        rows += sum(llm_tokens_of_item(i, SPEC) for i in items)
                for k, item in enumerate(items):  # every slot of every item, once
                    unit = slot_unit(item, SPEC)
                    assert slots[k] == set(range(unit[0] * unit[1] if unit else 1))
                assert rows == sum(llm_tokens_of_item(i, SPEC) for i in items)
            biggest = max(float(item_seconds(COST, "vision", [i])[0]) / (slot_unit(i, SPEC) or (1,))[0]
                          for p in positions for i in encoder_items(shapes[samples[p]], SPEC))
            assert max(seconds.values()) - min(seconds.values()) <= 2 * biggest + 1e-9


def test_cut_stage_work_and_boundary_rows_add_up_to_the_whole(batch) -> None:
    plan, shapes, whole, cut = batch
    a, b = (plan_iteration_work(shapes, plan, COST, x) for x in (whole, cut))
    for m in range(a.n_microbatches):
        for what in ("F", "W"):
            totals = [sum(getattr(w.times, what) for (key, mb, _), w in iw.work.items()
                          if key.module == "vision" and mb == m) for iw in (a, b)]
            assert totals[1] == pytest.approx(totals[0], rel=1e-9)
        for d in range(plan.layouts["llm"].dp):
            rows = [sum(v for (e, _, dd, mb), v in iw.boundary_bytes.items() if dd == d and mb == m) for iw in (a, b)]
            assert rows[1] == pytest.approx(rows[0])
    spread = [max(w.times.F for (key, mb, _), w in iw.work.items() if key.module == "vision" and mb == 1)
              for iw in (a, b)]
    assert spread[1] < spread[0]  # the busiest replica's share of a microbatch shrinks


def test_cutting_videos_over_a_groups_encoder_replicas_shortens_the_simulated_step(batch) -> None:
    plan, shapes, whole, cut = batch
    cand = Candidate("harmonia", plan)
    steps = []
    for assignment in (whole, cut):
        iw = plan_iteration_work(shapes, plan, COST, assignment)
        steps.append(simulate_schedule(plan, COST, CLUSTER, iw, candidate_schedule(cand, COST, iw)).iteration_s)
    assert steps[1] < 0.95 * steps[0]


def test_encoders_fed_across_llm_replicas_are_not_cut() -> None:
    plan = Plan("internvl-8b", {"vision": Layout(dp=2), "llm": Layout(dp=2, rank_offset=2)}, "disjoint", "1f1b",
                n_microbatches=2, global_batch=8)
    shapes = synthesize_trace(8, {"long_video": 1.0}, seed=1)
    cand = Candidate("harmonia", plan)
    costs = COST.costs_from_loads(*_loads(shapes))
    tokens = np.array([COST.sample_loads(s)["llm"].tokens for s in shapes])
    assert not cut_encoder_items(assign(cand, costs, tokens, COST), plan, COST, shapes).encoder_cuts


def test_plans_differing_in_the_llm_alone_share_the_assignments_encoder_work(batch) -> None:
    """The encoder units an assignment's stage work priced are kept on it for the next plan with the
    same encoder layout, recomputation and cost model: the same entries as priced afresh; another
    encoder recomputation is priced again."""
    import copy
    from dataclasses import replace

    plan, shapes, _, cut = batch
    fresh = copy.deepcopy(cut)
    first = plan_iteration_work(shapes, plan, COST, cut)
    other = replace(plan, layouts={**plan.layouts, "llm": Layout(tp=4, dp=2)})
    shared = plan_iteration_work(shapes, other, COST, cut)
    alone = plan_iteration_work(shapes, other, COST, fresh)
    vision = {k: w for k, w in shared.work.items() if k[0].module == "vision"}
    assert vision and vision == {k: w for k, w in alone.work.items() if k[0].module == "vision"}
    assert all(vision[k] is first.work[k] for k in vision), "kept, not priced again"
    assert shared.work == alone.work and shared.stage_ranks == alone.stage_ranks and shared.sub_runs == alone.sub_runs
    lighter = plan_iteration_work(shapes, replace(other, recompute=()), COST, cut)
    assert all(lighter.work[k].act_bytes > w.act_bytes for k, w in vision.items())
