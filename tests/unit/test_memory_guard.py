"""A step whose predicted peak would exceed the device runs with more, smaller microbatches.

The planner checks its plan's memory on the batches it profiled; a batch drawn later can be heavier.
The iteration builder predicts every step's peak per rank (states plus the activations its action
list holds at once) and, where it exceeds the device, doubles the microbatches per LLM replica until
it fits: every rank computes the same count. Where no count fits, the step's heaviest sample is a bad
record the data policy skips (or stops on). A step whose bound under any order of its actions fits
(`harmonia.sim.memory.activation_bound`) is not ordered for the check.
"""

from __future__ import annotations

import pytest

from harmonia.data.records import DataError
from harmonia.errors import SampleError
from harmonia.schedule.graph import LLM
from harmonia.schedule.item_cuts import cut_encoder_items
from harmonia.schedule.iteration import assign_iteration, balancer_costs
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.train.iteration import DataOrder, IterationBuilder
from harmonia.train.rank import schedule_graph
from harmonia.workload.cost import CostModel
from tests.unit.test_rank_decode import CLUSTER, SPEC, _open, data  # noqa: F401  (the dataset fixture)

PLAN = Plan("tiny-omni", {LLM: Layout(cp=2, dp=2), "vision": Layout(dp=4), "audio": Layout(dp=2, tp=2)},
            "colocated", "1f1b", n_microbatches=1, global_batch=12)


def _builder(ds, cluster, rank: int = 0) -> IterationBuilder:
    shapes = {s.sample_id: s for s in ds.shapes()}
    order = DataOrder(list(shapes), PLAN.global_batch, seed=5)
    return IterationBuilder(SPEC, PLAN, ds, order, CostModel(SPEC, cluster.device), cluster,
                            schedule_graph(SPEC, PLAN), rank, search_evaluations=8, shapes=shapes)


def _peaks(builder: IterationBuilder, step: int) -> dict[int, float]:
    """The step's largest predicted peak with each count of microbatches per LLM replica."""
    shapes = [builder.shapes[i] for i in builder.order.batch(step)]
    costs, columns, tokens = balancer_costs(builder.cost, shapes, PLAN.encoders)
    out = {}
    for n in (1, 2, 4):
        assignment = assign_iteration(costs, columns, 2, {e: PLAN.layouts[e].dp for e in PLAN.encoders}, n,
                                      tokens=tokens, seed=step, feeds=builder.feeds)
        out[n] = builder._peak(shapes, cut_encoder_items(assignment, PLAN, builder.cost, shapes))[1]
    return out


def test_a_step_over_the_device_takes_more_microbatches_and_one_no_count_fits_stops(data) -> None:
    root, tok = data
    ds = _open(root, tok)
    peaks = _peaks(_builder(ds, CLUSTER), 0)
    assert peaks[4] < peaks[2] < peaks[1] < CLUSTER.device.mem_bytes
    roomy = _builder(ds, CLUSTER).build(0)
    assert roomy.assignment.n_microbatches == 1
    # a device between the peaks of 2 and 1 microbatches: the step takes 2, on every rank alike
    tight = CLUSTER.with_device(mem_bytes=(peaks[1] + peaks[2]) / 2)
    built = [_builder(ds, tight, rank).build(0) for rank in (0, 3)]
    for it in built:
        assert it.assignment.n_microbatches == 2 and it.schedule.n_microbatches == 2 and len(it.batch.llm) == 2
        assert sorted(it.sample_ids) == sorted(roomy.sample_ids), "the same samples, in smaller microbatches"
    assert built[0].assignment.microbatches == built[1].assignment.microbatches
    # below the peak of the most microbatches the batch allows (6 samples per LLM replica: 4 is the
    # last doubling within it), the step's heaviest sample is a bad record, skipped by the data policy
    # (on every rank alike) or fatal, before any rank runs out of memory
    small = CLUSTER.with_device(mem_bytes=peaks[4] * 0.99)
    dropped = [_builder(ds, small, rank).build(0) for rank in (0, 3)]
    assert dropped[0].sample_ids == dropped[1].sample_ids and dropped[0].skipped >= 1
    assert set(dropped[0].sample_ids) < set(roomy.sample_ids)
    assert ds.stats.skipped["over device memory"] >= 1
    with pytest.raises(SampleError, match=r"step 0: only \d+ of 12 samples usable .* exceed the device"):
        _builder(ds, CLUSTER.with_device(mem_bytes=1.0)).build(0)  # nothing fits: samples go until too few are left
    strict = _open(root, tok, on_error="fail")
    with pytest.raises(DataError, match=r"step 0: rank \d+ would hold .* even with 4 microbatches per LLM replica"):
        _builder(strict, small).build(0)


def test_the_plans_microbatches_stay_where_the_step_fits(data) -> None:
    root, tok = data
    ds = _open(root, tok)
    builder = _builder(ds, CLUSTER)
    for step in range(3):
        it = builder.build(step)
        assert it.assignment.n_microbatches == PLAN.n_microbatches
        assert builder._peak([builder.shapes[i] for i in it.sample_ids], it.assignment)[1] <= CLUSTER.device.mem_bytes


def test_a_step_whose_any_order_bound_fits_skips_its_ordered_peak(data, monkeypatch) -> None:
    root, tok = data
    ds = _open(root, tok)

    def checked(builder: IterationBuilder) -> list[tuple[int, float]]:
        """The memory check's (microbatches, ordered peak) of a builder's steps: `_peak` called
        without a schedule (the order search's check of its pick passes one)."""
        found, ordered = [], builder._peak

        def peak(shapes, assignment, iw=None, schedule=None):
            out = ordered(shapes, assignment, iw, schedule)
            if iw is None:
                found.append((assignment.n_microbatches, out[1]))
            return out

        monkeypatch.setattr(builder, "_peak", peak)
        return found

    roomy = _builder(ds, CLUSTER)
    found = checked(roomy)
    assert roomy.build(0).assignment.n_microbatches == PLAN.n_microbatches and found == []
    # a device under the bound: the ordered peak decides, as without the bound
    peaks = _peaks(_builder(ds, CLUSTER), 0)
    tight = _builder(ds, CLUSTER.with_device(mem_bytes=(peaks[1] + peaks[2]) / 2))
    found = checked(tight)
    assert tight.build(0).assignment.n_microbatches == 2
    assert found[0] == (1, peaks[1]) and peaks[1] > tight.cluster.device.mem_bytes
