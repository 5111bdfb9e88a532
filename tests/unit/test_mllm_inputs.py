"""One rank's iteration data under LLM context parallelism: token shards and boundary rows per CP rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harmonia.errors import SampleError
from harmonia.model.batch import ItemInputs, TokenizedSample, pack_samples
from harmonia.model.presets import llm_preset
from harmonia.runtime.mllm_inputs import build_rank_batch, cp_token_ranks, item_positions
from harmonia.schedule.layout import Layout


def _sample(segments: list[tuple[str, int]], i: int) -> TokenizedSample:
    n = sum(k for _, k in segments)
    items = [ItemInputs("vision" if k == 4 else "audio", torch.zeros(1, 2)) for kind, k in segments if kind == "item"]
    return TokenizedSample(torch.arange(n), torch.arange(n), segments, items, sample_id=i)


SAMPLES = [
    _sample([("text", 3), ("item", 4), ("text", 5)], 0),
    _sample([("text", 2), ("item", 6), ("item", 4), ("text", 9)], 1),
    _sample([("text", 7)], 2),
    _sample([("item", 4), ("text", 6), ("item", 6), ("text", 2)], 3),
]


def test_item_positions_follow_the_packed_sequence() -> None:
    assert item_positions(SAMPLES[:2], "vision").tolist() == [3, 4, 5, 6, 20, 21, 22, 23]
    assert item_positions(SAMPLES[:2], "audio").tolist() == list(range(14, 20))
    assert item_positions(SAMPLES[2:3], "audio").size == 0
    packed = pack_samples(SAMPLES)
    for e in ("vision", "audio"):
        assert item_positions(SAMPLES, e).tolist() == packed.media[e].index.tolist()


def test_balanced_token_ranks_cover_every_token() -> None:
    ranks = cp_token_ranks(SAMPLES, 4, block=4, body=llm_preset("tiny-llm").body)
    assert ranks.shape == (sum(len(s) for s in SAMPLES),)
    assert np.bincount(ranks, minlength=4).min() >= 4
    short = cp_token_ranks(SAMPLES[2:3], 3)  # 7 tokens: the block shrinks to 2 so that 3 ranks get some
    assert sorted(set(short.tolist())) == [0, 1, 2]
    with pytest.raises(SampleError, match="cannot feed 8 CP ranks"):
        cp_token_ranks(SAMPLES[2:3], 8)


def test_each_cp_rank_gets_the_item_rows_of_its_tokens() -> None:
    layouts = {"vision": Layout(dp=2), "audio": Layout(), "llm": Layout(dp=2, cp=2)}
    micro = [SAMPLES]
    llm_split = [[[0, 1], [2, 3]]]
    enc_split = {"vision": [[[1, 3], [0, 2]]], "audio": [[[0, 1, 2, 3]]]}
    rng = np.random.default_rng(0)
    assign = [[rng.integers(0, 2, sum(len(SAMPLES[i]) for i in r)) for r in llm_split[0]]]
    for a in assign[0]:
        a[:2] = [0, 1]
    for rank in range(4):
        batch = build_rank_batch(layouts, rank, micro, llm_split, enc_split, llm_cp=assign)
        d, c = layouts["llm"].coords(rank)["dp"], layouts["llm"].coords(rank)["cp"]
        replica = [SAMPLES[i] for i in llm_split[0][d]]
        assert batch.llm_cp[0].tolist() == assign[0][d].tolist()
        for e in ("vision", "audio"):
            mine = int((assign[0][d][item_positions(replica, e)] == c).sum())
            assert batch.plans[e][0].dst_rows[rank] == mine, (rank, e)
    with pytest.raises(SampleError, match="every rank at least one"):
        build_rank_batch(layouts, 0, micro, llm_split, enc_split,
                         llm_cp=[[np.zeros_like(a) for a in assign[0]]])
    default = build_rank_batch(layouts, 1, micro, llm_split, enc_split)  # balanced shards by default
    assert default.llm_cp[0].tolist() == cp_token_ranks(SAMPLES[:2], 2).tolist()
    assert build_rank_batch({**layouts, "llm": Layout(dp=2)}, 0, micro, llm_split, enc_split).llm_cp == []


def test_encoder_inputs_follow_the_schedules_sub_microbatch_runs() -> None:
    """An encoder replica's items are cut into the runs the schedule was priced with; given only the
    counts, into even runs (the same cut on equal costs)."""
    layouts = {"vision": Layout(), "audio": Layout(), "llm": Layout()}
    args = (layouts, 0, [SAMPLES], [[[0, 1, 2, 3]]], {"vision": [[[0, 1, 2, 3]]], "audio": [[[0, 1, 2, 3]]]})
    vision = [i for s in SAMPLES for i in s.items if i.module == "vision"]  # 3 items
    batch = build_rank_batch(*args, {"vision": (2,)}, {("vision", 0, 0): [(0, 1), (1, 3)]})
    parts = batch.media["vision"][0]
    assert [p.n_groups for p in parts] == [1, 2]
    assert torch.equal(parts[1].inputs, torch.cat([i.inputs for i in vision[1:]]))
    even = build_rank_batch(*args, {"vision": (2,), "audio": (3,)}).media
    assert [p.n_groups for p in even["vision"][0]] == [2, 1]
    assert [None if p is None else p.n_groups for p in even["audio"][0]] == [1, 1, None]  # two audio items


def test_only_an_encoders_first_stage_holds_its_inputs() -> None:
    """The pixels and mel frames go to the ranks of an encoder's first pipeline stage alone: its later
    stages take activations and the LLM the encoder's outputs, so their batches keep the items'
    slots and positions without the rows (which would otherwise go to every such device)."""
    layouts = {"vision": Layout(pp=2), "audio": Layout(pp=2), "llm": Layout(rank_offset=2)}
    args = ([SAMPLES], [[[0, 1, 2, 3]]], {"vision": [[[0, 1, 2, 3]]], "audio": [[[0, 1, 2, 3]]]})
    first, second, llm = (build_rank_batch(layouts, r, *args) for r in range(3))
    vision = torch.cat([i.inputs for s in SAMPLES for i in s.items if i.module == "vision"])
    assert torch.equal(first.media["vision"][0][0].inputs, vision)
    kept, dropped = first.media["vision"][0][0], second.media["vision"][0][0]
    assert dropped.inputs.shape == (0, 2) and dropped.n_groups == kept.n_groups
    assert torch.equal(dropped.groups, kept.groups)
    (packed,) = llm.llm
    whole = pack_samples(SAMPLES)
    for e, media in packed.media.items():
        assert media.inputs.shape[0] == 0 and torch.equal(media.index, whole.media[e].index)
        assert media.inputs.shape[1:] == whole.media[e].inputs.shape[1:] and media.n_groups == whole.media[e].n_groups
        assert torch.equal(media.groups, whole.media[e].groups)
