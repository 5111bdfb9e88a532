"""The multimodal attention mask against a brute-force reading of the rule, and the cost model's count."""

import random

import torch

from harmonia.model.attention_mask import (
    EMPTY,
    FULL,
    PARTIAL,
    TokenLayout,
    block_mask_kinds,
    count_pairs,
    multimodal_mask,
)
from harmonia.workload.work import attended_pairs


def random_pack(rng: random.Random, n_samples: int) -> list[list[tuple[str, int]]]:
    samples = []
    for _ in range(n_samples):
        segs = [(rng.choice(["text", "item"]), rng.randint(1, 7)) for _ in range(rng.randint(1, 5))]
        samples.append(segs)
    return samples


def brute_force(samples: list[list[tuple[str, int]]]) -> torch.Tensor:
    """The rule read literally, by token index in the packed order."""
    tokens = []  # (sample, segment, kind)
    seg = 0
    for s, segs in enumerate(samples):
        for kind, n in segs:
            tokens += [(s, seg, kind)] * n
            seg += 1
    T = len(tokens)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, (si, gi, ki) in enumerate(tokens):
        for j, (sj, gj, _) in enumerate(tokens):
            if si != sj:
                continue
            if j <= i or (ki == "item" and gi == gj):
                mask[i, j] = True
    return mask


def test_mask_matches_brute_force_on_random_packs():
    rng = random.Random(0)
    for _ in range(60):
        samples = random_pack(rng, rng.randint(1, 4))
        layout = TokenLayout.from_segments(samples)
        assert torch.equal(multimodal_mask(layout), brute_force(samples))


def test_layout_fields_are_those_of_each_token_read_one_by_one():
    """Empty samples and empty segments included: a skipped sample keeps its index, an empty
    segment takes none."""
    rng = random.Random(5)
    for _ in range(200):
        samples = [[(rng.choice(["text", "item"]), rng.randint(-1, 6)) for _ in range(rng.randint(0, 4))]
                   for _ in range(rng.randint(0, 5))]
        causal_items = rng.random() < 0.5
        sample, segment, is_item, position = [], [], [], []
        seg = 0
        for s, segs in enumerate(samples):
            pos = 0
            for kind, n in segs:
                if n <= 0:
                    continue
                for _ in range(n):
                    sample.append(s)
                    segment.append(seg)
                    is_item.append(kind == "item" and not causal_items)
                    position.append(pos)
                    pos += 1
                seg += 1
        layout = TokenLayout.from_segments(samples, causal_items)
        assert layout.sample.tolist() == sample and layout.segment.tolist() == segment
        assert layout.is_item.tolist() == is_item and layout.position.tolist() == position
        assert [t.dtype for t in (layout.sample, layout.segment, layout.is_item, layout.position)] == [
            torch.long, torch.long, torch.bool, torch.long]


def test_examples_text_item_and_packing():
    # sample 0: text(2) item(2) text(1); sample 1: item(2)
    layout = TokenLayout.from_segments([[("text", 2), ("item", 2), ("text", 1)], [("item", 2)]])
    m = multimodal_mask(layout).int().tolist()
    assert m[0] == [1, 0, 0, 0, 0, 0, 0]  # text: causal
    assert m[2] == [1, 1, 1, 1, 0, 0, 0]  # item token 0 sees its whole item and earlier text
    assert m[4] == [1, 1, 1, 1, 1, 0, 0]  # text after the item sees it
    assert m[5] == [0, 0, 0, 0, 0, 1, 1]  # nothing across samples
    assert layout.position.tolist() == [0, 1, 2, 3, 4, 0, 1]


def test_count_matches_cost_model_closed_form():
    rng = random.Random(1)
    for _ in range(40):
        samples = random_pack(rng, rng.randint(1, 3))
        layout = TokenLayout.from_segments(samples)
        assert count_pairs(layout, block=5) == sum(attended_pairs(s) for s in samples)


def test_cp_shard_rows_equal_full_mask_rows():
    layout = TokenLayout.from_segments(random_pack(random.Random(2), 3))
    full = multimodal_mask(layout)
    T = len(layout)
    idx = torch.cat([torch.arange(0, T // 4), torch.arange(T - T // 4, T)])  # a zig-zag shard
    assert torch.equal(multimodal_mask(layout.select(idx), layout), full[idx])


def test_block_kinds_agree_with_dense_mask():
    layout = TokenLayout.from_segments(random_pack(random.Random(3), 4))
    full = multimodal_mask(layout)
    b = 4
    kinds = block_mask_kinds(layout, block=b)
    T = len(layout)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            tile = full[i * b:(i + 1) * b, j * b:(j + 1) * b]
            want = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
            assert kinds[i, j] == want, (i, j, T)


def test_flex_block_mask_matches_dense():
    from harmonia.model.attention import flex_mask

    layout = TokenLayout.from_segments([[("text", 70), ("item", 90)], [("item", 40), ("text", 56)]])
    bm = flex_mask(layout, layout, None, block=128)
    dense = bm.to_dense()[0, 0]  # (n_q_blocks, n_kv_blocks) non-empty blocks
    kinds = block_mask_kinds(layout, block=128)
    assert torch.equal(dense.bool(), kinds != EMPTY)
