"""A step's actions read nothing back from the device: plans come from the batch's host copies.

On CPU a GPU's syncs cannot be watched, so the batch's device tensors are played by `DeviceTensor`s
(`tests.unit.host_reads`), which refuse every host read while the actions run: the LLM's attention
plan (query blocks, varlen runs), the Qwen-VL tower's plan from its item grids, a CP shard and its
item rows, and whole executor steps (tiled ViT, Qwen2.5-VL) of `benchmarks/gpu_sync_audit.py`,
whose losses match those of plain tensors (nothing computed differently).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from harmonia.model.attention import PackedAttention
from harmonia.model.batch import ItemInputs, TokenizedSample, pack_samples
from tests.unit.host_reads import DeviceTensor, HostRead, no_host_reads, on_device

ROOT = Path(__file__).resolve().parents[2]


def _batch():
    """Two samples of text around images (bidirectional items), packed."""
    samples = []
    for i, segments in enumerate(([("text", 5), ("item", 4), ("text", 7)], [("text", 9), ("item", 4), ("text", 3)])):
        n = sum(k for _, k in segments)
        ids = torch.arange(n) + 4
        items = [ItemInputs("vision", torch.randn(1, 3, 16, 16))]
        samples.append(TokenizedSample(ids, torch.roll(ids, -1), segments, items, sample_id=i))
    return pack_samples(samples)


def test_the_stand_in_refuses_host_reads() -> None:
    t = on_device(torch.arange(4))
    assert isinstance(t + 1, DeviceTensor) and isinstance(t[t > 1], DeviceTensor)  # off: anything goes
    with no_host_reads():
        _ = (t * 2)[1:3]  # device work: fine
        for read in (lambda: t.tolist(), lambda: t.sum().item(), lambda: int(t[0]), lambda: bool(t.any()),
                     lambda: t[t > 1], lambda: torch.equal(t, t), lambda: t.nonzero(), lambda: torch.bincount(t)):
            with pytest.raises(HostRead):
                read()


def test_moved_batches_keep_their_plans_on_the_host() -> None:
    batch = _batch()
    moved = on_device(batch)
    assert isinstance(moved.input_ids, DeviceTensor) and isinstance(moved.layout.sample, DeviceTensor)
    assert moved.host_layout is batch.layout and moved.media["vision"].host_index is batch.media["vision"].index
    assert not isinstance(moved.media["vision"].plan_index, DeviceTensor)


@pytest.mark.parametrize("window", [None, 3])
def test_the_llm_attention_plan_reads_only_the_host_layout(window) -> None:
    moved = on_device(_batch())
    with no_host_reads():
        packed = moved.attention("segments")
        blocks, runs = packed.blocks(window), packed.varlen_runs(window)
        first, _ = packed.bounds(window)
        packed.block_bias(blocks[0], window, torch.float32)
    plain = _batch().attention("segments")
    assert blocks == plain.blocks(window) and torch.equal(first, plain.bounds(window)[0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][:3], plain.varlen_runs(window)[0][:3]))


def test_packed_sequences_plan_on_the_host() -> None:
    with no_host_reads():
        packed = PackedAttention.sequences([3, 5, 2], device="cpu")
        (_, cu, _, longest, _), _ = packed.varlen_runs()
    assert cu.tolist() == [0, 3, 8, 10] and longest == 5


def test_a_cp_shard_and_its_item_rows_are_planned_on_the_host() -> None:
    from harmonia.runtime.context_parallel import build_cp_shard

    batch = _batch()
    ranks = torch.arange(batch.n_tokens) % 2  # the CP assignment, kept on the host
    moved = on_device(batch)
    with no_host_reads():
        shard = build_cp_shard(moved, ranks, 1, None, 2, "segments")
        mine, local = shard.item_rows(moved.media["vision"].plan_index)
        shard.attention.blocks()
    index = batch.media["vision"].index
    assert mine.tolist() == (index % 2 == 1).tolist()
    assert local.tolist() == (index[index % 2 == 1] // 2).tolist()
    assert shard.tokens.tolist() == list(range(1, batch.n_tokens, 2))


def test_the_qwen_vision_tower_plans_from_the_host_grids() -> None:
    transformers = pytest.importorskip("transformers")
    from harmonia.model.qwen_spec import spec_from_hf
    from harmonia.model.qwen_vit import build_qwen_vision_encoder

    config = transformers.Qwen2_5_VLVisionConfig(depth=2, hidden_size=16, intermediate_size=24, num_heads=2,
                                                 patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                                                 window_size=8, fullatt_block_indexes=[1], out_hidden_size=32)
    spec = spec_from_hf(config.to_dict())
    tower = build_qwen_vision_encoder(spec)
    grid = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 8, 2]])  # kept on the host (MediaInputs.grid)
    pixels = torch.randn(int(grid.prod(-1).sum()), spec.patch_dim)
    with no_host_reads():
        got = tower(on_device(pixels), grid)
    assert isinstance(got, DeviceTensor)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), tower(pixels, grid), rtol=0, atol=0)


@pytest.mark.parametrize("model", ["tiny-vlm", "qwen2.5-vl"])
def test_executor_steps_read_nothing_back_from_the_device(one_process_group, model) -> None:
    """`benchmarks/gpu_sync_audit.py`'s steps on CPU, host reads refused while the actions run."""
    if model == "qwen2.5-vl":
        pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_sync_audit import build_job, run_steps

    device = torch.device("cpu")
    plain = run_steps(build_job(model, device), 2, lambda batch: batch, no_host_reads)
    got = run_steps(build_job(model, device), 2, on_device, no_host_reads)
    assert got["actions"] == plain["actions"] > 0
    assert math.isclose(got["loss"], plain["loss"], rel_tol=0, abs_tol=0)


def test_slot_means_count_their_sequences_on_the_device() -> None:
    from harmonia.model.mllm import group_mean

    x, groups = torch.randn(5, 3, 2), torch.tensor([0, 0, 2, 2, 2])  # slot 1 empty
    with no_host_reads():
        got = group_mean(on_device(x), on_device(groups), 3)
    counts = torch.bincount(groups, minlength=3).clamp(min=1).to(x.dtype)  # what it counted before
    want = torch.zeros(3, 3, 2).index_add(0, groups, x) / counts[:, None, None]
    assert torch.equal(got.as_subclass(torch.Tensor), want)
