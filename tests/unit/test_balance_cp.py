"""CP token shards: tile counts under the multimodal mask, placement, balance against uniform/zigzag."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmonia.errors import ScheduleError
from harmonia.model.attention_mask import EMPTY, TokenLayout, block_mask_kinds
from harmonia.model.presets import mllm_preset
from harmonia.schedule import (
    attention_unit_costs,
    block_costs,
    plan_cp_shards,
    uniform_shards,
    zigzag_shards,
)

segment = st.tuples(st.sampled_from(["text", "item"]), st.integers(1, 40))
packed = st.lists(st.lists(segment, min_size=1, max_size=4), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(samples=packed, block=st.sampled_from([4, 8, 16]))
def test_tile_counts_match_the_model_mask(samples, block) -> None:
    _, tiles = block_costs(samples, block)
    kinds = block_mask_kinds(TokenLayout.from_segments(samples), block=block)
    assert tiles.tolist() == (kinds != EMPTY).sum(dim=1).tolist()


@settings(max_examples=60, deadline=None)
@given(samples=packed, block=st.sampled_from([4, 8]), cp=st.integers(1, 6), tile=st.floats(0.0, 50.0))
def test_every_token_on_exactly_one_rank(samples, block, cp, tile) -> None:
    n_tokens = sum(n for s in samples for _, n in s)
    if -(-n_tokens // block) < 2 * cp:
        return
    costs, _ = block_costs(samples, block, tile_cost=tile)
    for plan in (plan_cp_shards, uniform_shards, zigzag_shards):
        shards = plan(samples, cp, block=block, tile_cost=tile)
        ranks = shards.token_ranks()
        assert ranks.shape == (n_tokens,) and (ranks >= 0).all()
        assert sum(shards.rank_tokens(r).size for r in range(cp)) == n_tokens
        counts = [b.size for b in shards.rank_blocks]
        assert max(counts) - min(counts) <= 2 if plan is zigzag_shards else max(counts) - min(counts) <= 1
        assert np.isclose(shards.rank_costs.sum(), costs.sum())
    ours = plan_cp_shards(samples, cp, block=block, tile_cost=tile)
    assert ours.rank_costs.max() <= uniform_shards(samples, cp, block=block, tile_cost=tile).rank_costs.max() + 1e-9
    assert ours.rank_blocks[0].tolist() == plan_cp_shards(samples, cp, block=block, tile_cost=tile).rank_blocks[0].tolist()


def test_balanced_on_8k_multimodal_packs_better_than_zigzag() -> None:
    token_cost, tile_cost = attention_unit_costs(mllm_preset("omni-8b").llm.body, 128)
    rng = np.random.default_rng(0)
    worst = {"ours": 0.0, "zigzag": 0.0}
    for _ in range(10):
        samples, total = [], 0
        while total < 8192:
            n_text = int(rng.integers(20, 400))
            item = int(rng.choice([256, 1024, 1280, 2048]))
            segs = [("text", n_text), ("item", item), ("text", int(rng.integers(10, 300)))]
            length = sum(n for _, n in segs)
            if total + length > 8192:
                segs, length = [("text", 8192 - total)], 8192 - total
            samples.append(segs)
            total += length
        kw = {"block": 128, "token_cost": token_cost, "tile_cost": tile_cost}
        worst["ours"] = max(worst["ours"], plan_cp_shards(samples, 4, **kw).imbalance)
        worst["zigzag"] = max(worst["zigzag"], zigzag_shards(samples, 4, **kw).imbalance)
    assert worst["ours"] <= 1.05
    assert worst["ours"] < worst["zigzag"]


def test_single_causal_sequence_is_balanced() -> None:
    shards = plan_cp_shards([[("text", 8192)]], 4, block=128, token_cost=1.0, tile_cost=100.0)
    assert shards.imbalance < 1.01
    assert uniform_shards([[("text", 8192)]], 4, block=128, token_cost=1.0, tile_cost=100.0).imbalance > 1.2


def test_errors() -> None:
    with pytest.raises(ScheduleError, match="cannot feed 8 CP ranks"):
        plan_cp_shards([[("text", 100)]], 8, block=64)
    with pytest.raises(ScheduleError, match="empty"):
        plan_cp_shards([[("text", 0)]], 1)
    with pytest.raises(ScheduleError, match="kind must be"):
        block_costs([[("image", 10)]])
