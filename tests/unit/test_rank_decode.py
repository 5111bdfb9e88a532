"""Each rank decodes only the samples it trains: the same tensors as decoding the whole batch.

A small dataset with images, video and audio rendered by a chat template; for plans with
colocated and disjoint modules (LLM CP too), every rank's `RankBatch` built from its own decoded
samples (and outlines of the others) must equal, bit for bit, the one built from the whole decoded
batch as the trainer did before. The token-count cache must spare a second shape pass the renderer.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from harmonia.data.decode import SampleDecoder
from harmonia.data.loader import build_tokenizer, open_dataset
from harmonia.data.synth import write_synthetic_dataset
from harmonia.data.token_cache import token_cache_path
from harmonia.model.presets import mllm_preset
from harmonia.runtime.mllm_inputs import build_rank_batch, cp_token_ranks
from harmonia.schedule.graph import LLM
from harmonia.schedule.item_cuts import cut_encoder_items
from harmonia.schedule.iteration import assign_iteration, balancer_costs
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.train.iteration import DataOrder, IterationBuilder
from harmonia.train.rank import schedule_graph
from harmonia.train.rank_data import rank_positions
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string
from tests.unit._hf_tokenizer import write_chat_tokenizer

SPEC = mllm_preset("tiny-omni")
CLUSTER = cluster_from_string("cpu:1x8")
PLANS = {
    "colocated-cp": Plan("tiny-omni", {LLM: Layout(cp=2, dp=2), "vision": Layout(dp=4), "audio": Layout(dp=2, tp=2)},
                         "colocated", "1f1b", n_microbatches=2, global_batch=12),
    "disjoint-pp": Plan("tiny-omni", {"vision": Layout(dp=2), "audio": Layout(dp=1, rank_offset=2),
                                      LLM: Layout(dp=2, pp=2, rank_offset=3)},
                        "disjoint", "1f1b", n_microbatches=2, global_batch=12),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rank-decode")
    write_synthetic_dataset(root / "data", 30, seed=3, tile=SPEC.encoders["vision"].image_size)
    return root, write_chat_tokenizer(root / "tok", "qwen")


def _open(root, tok_dir, **options):
    return open_dataset(root / "data" / "train", SPEC, tokenizer=build_tokenizer(tok_dir), **options)


def _builder(ds, plan: Plan, rank: int, decoder=None) -> IterationBuilder:
    shapes = {s.sample_id: s for s in ds.shapes()}
    order = DataOrder(list(shapes), plan.global_batch, seed=5)
    return IterationBuilder(SPEC, plan, ds, order, CostModel(SPEC, CLUSTER.device), CLUSTER,
                            schedule_graph(SPEC, plan), rank, search_evaluations=8, shapes=shapes, decoder=decoder)


def _whole_batch(builder: IterationBuilder, step: int):
    """The rank's batch as the trainer built it before: the whole global batch decoded, then selected."""
    plan, llm = builder.plan, builder.plan.layouts[LLM]
    samples = builder.dataset.load(builder.order.batch(step))
    shapes = [s.shape for s in samples]
    costs, columns, tokens = balancer_costs(builder.cost, shapes, plan.encoders)
    assignment = assign_iteration(costs, columns, llm.dp, {e: plan.layouts[e].dp for e in plan.encoders},
                                  plan.n_microbatches, tokens=tokens, seed=step, feeds=builder.feeds)
    assignment = cut_encoder_items(assignment, plan, builder.cost, shapes)
    _, iw, _ = builder._schedule(shapes, assignment, builder.cost)
    micro = [[samples[i].tokens for i in mb] for mb in assignment.microbatches]
    llm_cp = None
    if llm.cp > 1:
        llm_cp = [[cp_token_ranks([mb[i] for i in replica], llm.cp, body=SPEC.llm.body) for replica in split]
                  for mb, split in zip(micro, assignment.llm_split)]
    batch = build_rank_batch(plan.layouts, builder.rank, micro, assignment.llm_split, assignment.encoder_split,
                             iw.n_sub, iw.sub_runs, llm_cp=llm_cp, encoder_cuts=assignment.encoder_cuts)
    return [s.index for s in samples], assignment, batch


def assert_identical(a, b, where: str = "batch") -> None:
    """Equal structure, and tensors equal bit for bit (same dtype, shape and values); caches (fields
    left out of comparison) aside."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{where}: arrays differ"
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            if not f.compare:  # a cache of what the fields derive (an assignment's memo)
                continue
            assert_identical(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {a.keys()} vs {b.keys()}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} entries"
        for k, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.mark.parametrize("name", sorted(PLANS))
def test_each_rank_trains_the_tensors_of_the_whole_batch_decode(data, name):
    root, tok = data
    plan = PLANS[name]
    ds = _open(root, tok)
    assert {m.modality for s in ds.shapes() for m in s.items} == {"image", "video", "audio"}
    for rank in range(plan.world_size):
        builder = _builder(ds, plan, rank)
        for step in (0, 2):  # step 2 wraps into the second epoch
            it = builder.build(step)
            ids, assignment, reference = _whole_batch(builder, step)
            assert it.sample_ids == ids and it.skipped == 0
            assert_identical(it.assignment, assignment, "assignment")
            assert_identical(it.batch, reference, f"rank {rank} step {step}")


def test_a_rank_decodes_only_its_samples_and_workers_give_the_same(data):
    root, tok = data
    plan = PLANS["disjoint-pp"]
    ds = _open(root, tok)
    calls: list[list[int]] = []
    decode = ds.decode
    ds.decode = lambda indices: calls.append(list(indices)) or decode(indices)
    audio = _builder(ds, plan, 2).build(0)  # the audio rank: only samples with audio
    with_audio = {s.sample_id for s in ds.shapes() if any(i.modality == "audio" for i in s.items)}
    assert calls and set(calls[0]) == with_audio & set(audio.sample_ids) and len(calls[0]) < plan.global_batch
    ds.decode = decode
    with SampleDecoder(_open(root, tok), num_workers=2) as workers:
        in_workers = _builder(workers.dataset, plan, 0, decoder=workers).build(1)
    assert_identical(in_workers.batch, _builder(ds, plan, 0).build(1).batch, "batch from workers")


def test_token_counts_are_cached_beside_the_shape_index(data, tmp_path):
    root, tok = data
    cache = tmp_path / "run" / "data-cache" / "train.shapes.json"
    first = _open(root, tok, shape_cache=cache)
    calls = {"n": 0}
    render = first.tokenizer.encode_conversation

    def counted(*args):
        calls["n"] += 1
        return render(*args)

    first.tokenizer.encode_conversation = counted
    shapes = first.shapes()
    assert calls["n"] == len(first) and token_cache_path(cache).is_file()
    assert not any((root / "data").rglob("*tokens*")), "nothing is written into the dataset"

    second = _open(root, tok, shape_cache=cache)
    second.tokenizer.encode_conversation = counted
    calls["n"] = 0
    assert second.shapes() == shapes and calls["n"] == 0
    outlines = [second.outline(s) for s in shapes]  # the counts outlines need come from the cache too
    assert calls["n"] == 0
    for o, s in zip(outlines, second.load([s.sample_id for s in shapes])):
        assert o.segments == s.tokens.segments and o.n_targets == int((s.tokens.labels != -100).sum())

    payload = json.loads(token_cache_path(cache).read_text())  # another template renders again
    payload["key"]["renderer"] = "another"
    token_cache_path(cache).write_text(json.dumps(payload))
    third = _open(root, tok, shape_cache=cache)
    third.tokenizer.encode_conversation = counted
    calls["n"] = 0
    assert third.shapes() == shapes and calls["n"] == len(third)


def test_prefetched_steps_follow_the_agreement_and_close_unblocks_the_prefetcher(data):
    from harmonia.schedule.prefetch import SchedulePrefetcher

    root, tok = data
    plan = PLANS["colocated-cp"]
    ds = _open(root, tok)
    builder = _builder(ds, plan, 1)
    with SchedulePrefetcher(builder, first_step=0, last_step=10) as prefetch:
        got = [builder.settle(prefetch.get(step)) for step in range(2)]
        t0 = time.perf_counter()
        builder.close()  # the prefetcher's thread waits for step 2's agreement: closing frees it
    assert time.perf_counter() - t0 < 4.0
    alone = _builder(ds, plan, 1)
    for it in got:
        assert_identical(it.batch, alone.build(it.step).batch, f"prefetched step {it.step}")


def test_a_decoded_shape_unlike_its_header_shape_is_a_shape_mismatch(data):
    from harmonia.data.loader import Failed
    from harmonia.train.rank_data import check_decoded

    root, tok = data
    ds = _open(root, tok)
    shape = ds.shapes()[0]
    (loaded,) = ds.load([shape.sample_id])
    assert check_decoded(loaded, shape, ds) is loaded
    other = dataclasses.replace(shape, text_tokens=shape.text_tokens + 1)
    failed = check_decoded(loaded, other, ds)
    assert isinstance(failed, Failed) and failed.kind == "shape_mismatch" and failed.index == shape.sample_id
    assert ds.records[shape.sample_id].where in failed.message


def test_a_killed_data_worker_is_a_clear_error(data):
    import os
    import signal

    from harmonia.errors import SampleError

    root, tok = data
    with SampleDecoder(_open(root, tok), num_workers=1) as decoder:
        assert len(decoder.decode([0, 1])) == 2
        for pid in list(decoder._pool._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(SampleError, match="data worker process died"):
            decoder.decode([0, 1])


def test_kept_samples_are_not_decoded_again_and_the_cache_holds_its_byte_limit(data):
    from harmonia.data.decode import tensor_bytes

    root, tok = data
    ds = _open(root, tok)
    calls: list[int] = []
    decode = ds.decode
    ds.decode = lambda indices: calls.extend(indices) or decode(indices)
    sizes = [tensor_bytes(s) for s in decode(list(range(6)))]
    decoder = SampleDecoder(ds, cache_bytes=sum(sizes[:3]))  # room for samples 0-2 exactly
    first = decoder.decode([0, 1, 2])
    again = decoder.decode([2, 0, 1])
    assert calls == [0, 1, 2] and [s.index for s in again] == [2, 0, 1] and again[1] is first[0]
    decoder.decode([3])  # over the limit: the least recently used go first (recency 2, 0, 1, 3)
    recency, fits = [2, 0, 1, 3], []
    for i in reversed(recency):
        if sum(sizes[j] for j in fits) + sizes[i] > sum(sizes[:3]):
            break
        fits.insert(0, i)
    assert list(decoder.cache._kept) == fits and decoder.cache.held == sum(sizes[i] for i in fits)
    calls.clear()
    assert_identical(decoder.decode([2, 4]), decode([2, 4]), "decoded again")
    assert calls == [2, 4] and 2 not in fits
    assert SampleDecoder(ds).cache is None  # cache_bytes 0: every call decodes


def test_a_job_trains_the_same_with_its_decoded_samples_kept(tmp_path):
    """Two epochs on one process: the second takes every sample from the cache; the losses are equal
    bit for bit to a job that decodes every time (nothing on the training path writes into a sample),
    and to one whose worker decodes each step's samples a step ahead."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    losses = {}
    for cache, workers in ((0, 0), (64, 0), (64, 1)):  # workers: each step's samples decoded a step ahead
        run = tmp_path / f"cache-{cache}-workers-{workers}"
        flags = ["--model.preset=tiny-vlm", "--parallel.world_size=1", "--train.epochs=2", "--train.global_batch=8",
                 "--data.synthesize=24", "--data.heldout=0", f"--data.path={tmp_path / 'data'}",
                 f"--data.cache_mb={cache}", f"--data.num_workers={workers}", f"--log.dir={run / 'log'}",
                 f"--checkpoint.dir={run / 'ck'}",
                 "--log.tensorboard=false"]
        done = subprocess.run([sys.executable, "-m", "harmonia", "train", *flags], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        records = [json.loads(line) for line in (run / "log" / "metrics.jsonl").read_text().splitlines()]
        losses[cache, workers] = [r["loss"] for r in records if "loss" in r]
    assert len(losses[0, 0]) == 6 and losses[0, 0] == losses[64, 0] == losses[64, 1]


def test_workers_decode_the_next_steps_samples_while_the_rank_trains(data):
    """With workers, preparing a step starts decoding the next one's samples of this rank (as the
    balancer assigns them); the next step takes them without decoding and trains what a rank without
    workers trains."""
    root, tok = data
    plan = PLANS["disjoint-pp"]
    ds = _open(root, tok)
    with SampleDecoder(_open(root, tok), num_workers=2) as workers:
        builder = _builder(workers.dataset, plan, 0, decoder=workers)
        first = builder.build(0)
        ahead = set(workers._ahead)
        waited = []
        decode = workers._decode
        workers._decode = lambda indices: waited.extend(indices) or decode(indices)
        second = builder.build(1)
    plain = _builder(ds, plan, 0)
    plain.build(0)
    reference = plain.build(1)
    shapes = [plain.shapes[i] for i in reference.sample_ids]
    mine = set(rank_positions(plan.layouts, 0, reference.assignment, shapes, SPEC))
    assert ahead and ahead == {reference.sample_ids[p] for p in mine} and waited == []
    assert_identical(second.assignment, reference.assignment, "assignment")
    assert_identical(second.batch, reference.batch, "batch from the workers' decoding ahead")
    assert_identical(first.batch, plain.build(0).batch, "the first step's batch")
