"""``train.assignment=sequential``: the trainer's steps in fixed-size microbatches in data order.

The iteration builder of a Megatron-style plan (LLM pp2 x dp2, both encoders on the LLM's first-stage
ranks) must cut each step's batch, in the data order's sample order, into contiguous equal DP shards
and contiguous equal microbatches, run them in that order with no encoder split, and build every
rank's tensors and its simulated step from that assignment; the default stays balanced.
"""

from __future__ import annotations

import pytest

from harmonia.config import load_config
from harmonia.data.loader import build_tokenizer, open_dataset
from harmonia.data.synth import write_synthetic_dataset
from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from harmonia.schedule.families import build_schedule
from harmonia.schedule.graph import LLM
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import cost_table, plan_iteration_work
from harmonia.train.iteration import DataOrder, IterationBuilder
from harmonia.train.rank import schedule_graph
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string
from tests.unit._hf_tokenizer import write_chat_tokenizer
from tests.unit.iteration_helpers import assignment as hand_assignment
from tests.unit.test_rank_decode import assert_identical

SPEC = mllm_preset("tiny-omni")
CLUSTER = cluster_from_string("cpu:1x4")
BATCH, DP, N_MB = 12, 2, 3
FIRST_STAGE = (0, 1)  # the LLM's stage-0 ranks of its two replicas
PLAN = Plan("tiny-omni", {"vision": Layout(dp=2, ranks=FIRST_STAGE), "audio": Layout(dp=2, ranks=FIRST_STAGE),
                          LLM: Layout(pp=2, dp=DP)}, "colocated", "1f1b", n_microbatches=N_MB, global_batch=BATCH)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequential")
    write_synthetic_dataset(root / "data", 30, seed=4, tile=SPEC.encoders["vision"].image_size)
    tokenizer = build_tokenizer(write_chat_tokenizer(root / "tok", "qwen"))
    return open_dataset(root / "data" / "train", SPEC, tokenizer=tokenizer)


def _builder(ds, rank: int, assignment: str) -> IterationBuilder:
    shapes = {s.sample_id: s for s in ds.shapes()}
    return IterationBuilder(SPEC, PLAN, ds, DataOrder(list(shapes), BATCH, seed=2), CostModel(SPEC, CLUSTER.device),
                            CLUSTER, schedule_graph(SPEC, PLAN), rank, search_evaluations=8, simulate=rank == 0,
                            shapes=shapes, assignment=assignment)


def test_sequential_steps_are_fixed_size_microbatches_in_data_order(dataset):
    assert tuple(PLAN.layouts[LLM].rank_at(pp=0, dp=d) for d in range(DP)) == FIRST_STAGE
    shard, size = BATCH // DP, BATCH // DP // N_MB
    # replica d's m-th microbatch: batch positions d * shard + m * size ... + size - 1
    per_replica = [[list(range(d * shard + m * size, d * shard + (m + 1) * size)) for m in range(N_MB)]
                   for d in range(DP)]
    by_id = {s.sample_id: s for s in dataset.shapes()}
    cost = CostModel(SPEC, CLUSTER.device)
    balanced_differs = False
    for step in (0, 1):
        for rank in (0, 3):  # a rank with encoders and the LLM's first stage, one with its last
            it = _builder(dataset, rank, "sequential").build(step)
            assert it.sample_ids == _builder(dataset, rank, "sequential").order.batch(step), "data order"
            shapes = [by_id[i] for i in it.sample_ids]
            expected = hand_assignment(PLAN, cost, shapes, per_replica)
            assert_identical(it.assignment, expected, "assignment")
            assert [len(mb) for mb in it.assignment.microbatches] == [DP * size] * N_MB
            assert it.n_sub == {"vision": 1, "audio": 1}
            iw = plan_iteration_work(shapes, PLAN, cost, expected)
            unsearched = build_schedule(schedule_graph(SPEC, PLAN), N_MB, PLAN.schedule, order=list(range(N_MB)),
                                        costs=cost_table(PLAN, iw))
            assert it.schedule.orders == unsearched.orders, "microbatches run in data order"
            assert (it.predicted is not None) == (rank == 0)
            balanced = _builder(dataset, rank, "balanced").build(step)
            assert balanced.sample_ids == it.sample_ids
            balanced_differs |= balanced.assignment.microbatches != it.assignment.microbatches
    assert balanced_differs, "the default balances: its microbatches are not the sequential ones"


def test_assignment_must_be_balanced_or_sequential(dataset):
    assert load_config(None, []).train.assignment == "balanced"
    assert load_config(None, ["--train.assignment=sequential"]).train.assignment == "sequential"
    with pytest.raises(ConfigError, match="train.assignment"):
        load_config(None, ["--train.assignment=reordered"])
    with pytest.raises(ConfigError, match="train.assignment"):
        _builder(dataset, 0, "sorted")
