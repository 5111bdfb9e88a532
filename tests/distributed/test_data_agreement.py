"""Two gloo ranks agree on a sample that fails to decode after its header passed.

An image is cut short after a valid PNG header: the shape pass accepts it, only the rank that
decodes it finds it corrupt. Both ranks must drop the same sample, train the same sample ids, count
it once as ``corrupt_media`` (logged by rank 0 only), leave it out of the next epoch before
balancing, and with ``on_error=fail`` both stop with the same one-line error naming the file. The
same agreement gathers every rank's figures of the step before (the trainer's metrics) exactly.
"""

from __future__ import annotations

import logging

import pytest

from harmonia.data.loader import open_dataset
from harmonia.data.synth import write_synthetic_dataset
from harmonia.model.presets import mllm_preset
from harmonia.schedule.graph import LLM
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.train.iteration import DataOrder
from tests.distributed._spawn import LAYOUT_TIMEOUT_S, check_timeout, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

SPEC = mllm_preset("tiny-omni")
PLAN = Plan("tiny-omni", {LLM: Layout(dp=2), "vision": Layout(dp=2), "audio": Layout(dp=2)}, "colocated", "1f1b",
            n_microbatches=2, global_batch=8)
SEED = 7


def _train_split(root):
    return root / "data" / "train"


def _builder(rank: int, root, on_error: str, group):
    from harmonia.train.iteration import IterationBuilder
    from harmonia.train.rank import schedule_graph
    from harmonia.train.rank_data import agree_failures
    from harmonia.workload.cost import CostModel
    from harmonia.workload.devices import cluster_from_string

    ds = open_dataset(_train_split(root), SPEC, on_error=on_error, log_skips=rank == 0)
    shapes = {s.sample_id: s for s in ds.shapes()}
    cluster = cluster_from_string("cpu:1x2")
    return IterationBuilder(SPEC, PLAN, ds, DataOrder(list(shapes), PLAN.global_batch, SEED),
                            CostModel(SPEC, cluster.device), cluster, schedule_graph(SPEC, PLAN), rank,
                            search_evaluations=4, shapes=shapes,
                            agree=lambda failed, stop, row, extra: agree_failures(failed, group, stop, row, extra))


def _steps(rank: int, world: int, root, on_error: str, steps: int):
    import torch
    import torch.distributed as dist

    from harmonia.data.records import DataError

    group = dist.new_group(backend="gloo")
    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("harmonia.data.loader").addHandler(handler)
    builder = _builder(rank, root, on_error, group)
    out = []
    with check_timeout(LAYOUT_TIMEOUT_S, f"rank {rank}'s steps"):
        for step in range(steps):
            row = torch.tensor([rank + 0.25, 2.0**52 + rank, step], dtype=torch.float64)  # the trainer's figures
            extra = torch.tensor([rank + 1.0, 10.0 * step], dtype=torch.float64)  # e.g. loss and norm shares
            try:
                it = builder.settle(builder(step), 0, row, extra)
            except DataError as e:
                return {"error": str(e), "kind": e.kind}
            out.append((it.sample_ids, it.skipped, [f.index for f in it.failed], it.rows.tolist(),
                        it.summed.tolist()))
    return {"steps": out, "stats": builder.dataset.stats.metrics(), "warned": warned, "bad": sorted(builder.bad)}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The dataset with one image of step 0's batch cut after its header; returns (root, index, file)."""
    root = tmp_path_factory.mktemp("agree")
    write_synthetic_dataset(root / "data", 24, seed=2, tile=SPEC.encoders["vision"].image_size)
    ds = open_dataset(_train_split(root), SPEC)
    shapes = {s.sample_id: s for s in ds.shapes()}
    first = DataOrder(list(shapes), PLAN.global_batch, SEED).batch(0)
    index = next(i for i in first if [m.modality for m in shapes[i].items] == ["image"])
    conv = ds.records[index]
    path = conv.source.root / conv.media()[0].path
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert open_dataset(_train_split(root), SPEC).shapes() == list(shapes.values()), "the header still passes"
    return root, index, path.name


def test_both_ranks_drop_the_same_corrupt_sample(planted):
    root, index, name = planted
    a, b = run_workers(_steps, 2, (root, "skip", 4), timeout=180)
    assert a["steps"] == b["steps"], "the ranks trained different samples"
    assert a["stats"] == b["stats"] and a["stats"]["data/skipped/corrupt_media"] == 1
    assert a["bad"] == b["bad"] == [index]
    step0_ids, skipped, failed, *_ = a["steps"][0]
    assert index not in step0_ids and skipped == 1 and failed == []
    assert all(index not in ids for ids, *_ in a["steps"])
    assert sum(len(ids) for ids, *_ in a["steps"]) == 4 * PLAN.global_batch - sum(s for _, s, *_ in a["steps"])
    # every rank's row gathered exactly in the same agreement, the step that failed (agreed twice) too,
    # and every rank's extra values summed in it
    assert [rows for *_, rows, _ in a["steps"]] == [[[0.25, 2.0**52, k], [1.25, 2.0**52 + 1, k]] for k in range(4)]
    assert [summed for *_, summed in a["steps"]] == [[3.0, 20.0 * k] for k in range(4)]
    assert [w for w in a["warned"] if name in w] and not b["warned"], "logged once, by rank 0"


def test_on_error_fail_stops_both_ranks_naming_the_file(planted):
    root, _, name = planted
    a, b = run_workers(_steps, 2, (root, "fail", 1), timeout=180)
    assert a == b and a["kind"] == "corrupt_media" and name in a["error"] and "\n" not in a["error"]
