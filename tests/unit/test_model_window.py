"""Sliding-window attention: one rule for the dense mask, the packed kernel, CP shards, flex block masks and the
cost model."""

import dataclasses
import random

import pytest
import torch

from harmonia.model.attention import PackedAttention, flex_mask
from harmonia.model.attention_mask import TokenLayout, count_pairs, multimodal_mask
from harmonia.model.layers import restrict_to_window
from harmonia.model.llm import build_llm
from harmonia.model.presets import mllm_preset
from harmonia.model.spec import LLMSpec, TransformerSpec
from harmonia.workload.calibration import Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset
from harmonia.workload.shapes import ModalityItem, SampleShape
from harmonia.workload.work import attended_pairs, load_arrays, sample_loads


def random_pack(rng: random.Random, n_samples: int) -> list[list[tuple[str, int]]]:
    return [[(rng.choice(["text", "item"]), rng.randint(1, 9)) for _ in range(rng.randint(1, 5))]
            for _ in range(n_samples)]


def brute_force(samples: list[list[tuple[str, int]]], window: int) -> torch.Tensor:
    """The rule read literally by packed index: same sample, causal or own item, and ``i - j < window``."""
    tokens = []  # (sample, segment, kind, index within the sample)
    seg = 0
    for s, segs in enumerate(samples):
        pos = 0
        for kind, n in segs:
            tokens += [(s, seg, kind, pos + k) for k in range(n)]
            pos, seg = pos + n, seg + 1
    mask = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
    for i, (si, gi, ki, pi) in enumerate(tokens):
        for j, (sj, gj, _, pj) in enumerate(tokens):
            mask[i, j] = si == sj and (pj <= pi or (ki == "item" and gi == gj)) and pi - pj < window
    return mask


def test_windowed_mask_matches_brute_force_and_closed_form():
    rng = random.Random(0)
    for _ in range(40):
        samples, window = random_pack(rng, rng.randint(1, 3)), rng.randint(1, 12)
        layout = TokenLayout.from_segments(samples)
        want = brute_force(samples, window)
        assert torch.equal(multimodal_mask(layout, window=window), want)
        assert torch.equal(restrict_to_window(multimodal_mask(layout), layout.position, window), want)
        batched = restrict_to_window(multimodal_mask(layout)[None, None], layout.position[None], window)
        assert torch.equal(batched, want[None, None])
        assert count_pairs(layout, block=7, window=window) == sum(attended_pairs(s, window) for s in samples)
        assert int(want.sum()) == count_pairs(layout, window=window)
        full = multimodal_mask(layout)
        assert restrict_to_window(full, layout.position, int(layout.position.max()) + 1) is full  # hides nothing


def test_window_restricts_a_cp_shard_by_key_positions():
    rng = random.Random(1)
    layout = TokenLayout.from_segments(random_pack(rng, 3))
    T = len(layout)
    tokens = torch.tensor(sorted(rng.sample(range(T), T // 2)))
    order = torch.cat([tokens, torch.tensor([i for i in range(T) if i not in set(tokens.tolist())], dtype=torch.long)])
    q, k, v = torch.randn(3, 1, 2, T, 8).unbind(0)
    kv = torch.cat((k, v), dim=1).permute(2, 0, 1, 3)[order]  # (T, 1, 4, 8): every rank's rows, gathered order
    shard = PackedAttention(layout, query_index=tokens, gather=lambda local: kv, key_order=order)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, tokens], k, v, attn_mask=multimodal_mask(layout.select(tokens), layout, window=4)[None, None])
    layer = restrict_to_window(shard, layout.position[tokens][None], 4)
    assert layer.window == 4 and layer.packed is shard
    torch.testing.assert_close(layer.attend(q[:, :, tokens], k[:, :, tokens], v[:, :, tokens]), want)


def _windowed_llm(window: int = 6, layers=(1, 2)) -> LLMSpec:
    body = TransformerSpec(3, 32, 4, 48, n_kv_heads=2, mlp="swiglu", norm="rmsnorm", qkv_bias=False, out_bias=False,
                           mlp_bias=False, sliding_window=window, window_layers=layers)
    return LLMSpec("windowed", body, vocab_size=64)


def test_model_windows_are_the_same_through_the_packed_kernel_and_a_cp_shard():
    torch.manual_seed(0)
    model = build_llm(_windowed_llm()).eval()
    layout = TokenLayout.from_segments([[("text", 9), ("item", 5), ("text", 12)], [("text", 14)]])
    ids = torch.randint(0, 64, (1, len(layout)))
    with torch.no_grad():
        dense = model(ids, layout.position[None], multimodal_mask(layout))
        torch.testing.assert_close(model(ids, layout.position[None], PackedAttention(layout)), dense)
        # one CP rank holding every token, its keys gathered in a shuffled order and put back
        perm = torch.randperm(len(layout), generator=torch.Generator().manual_seed(1))
        shard = PackedAttention(layout, query_index=torch.arange(len(layout)), gather=lambda rows: rows[perm],
                                key_order=perm)
        torch.testing.assert_close(model(ids, layout.position[None], shard), dense)
        plain = build_llm(dataclasses.replace(model.spec, body=dataclasses.replace(
            model.spec.body, sliding_window=None, window_layers=None))).eval()
        plain.load_state_dict(model.state_dict())
        assert (plain(ids, layout.position[None], multimodal_mask(layout)) - dense).abs().max() > 1e-4


def test_flex_mask_with_a_window_equals_the_dense_rule():
    from torch.nn.attention.flex_attention import flex_attention

    layout = TokenLayout.from_segments([[("text", 70), ("item", 90)], [("item", 40), ("text", 56)]])
    q, k, v = torch.randn(3, 1, 2, len(layout), 8).unbind(0)
    for window in (None, 50):
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=multimodal_mask(layout, window=window)[None, None])
        got = flex_attention(q, k, v, block_mask=flex_mask(layout, layout, window))
        torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


def _windowed_mllm(window: int | None, layers=None):
    spec = mllm_preset("tiny-vlm")
    body = dataclasses.replace(spec.llm.body, sliding_window=window, window_layers=layers)
    return dataclasses.replace(spec, llm=dataclasses.replace(spec.llm, body=body))


def test_cost_model_prices_each_block_with_its_window():
    h100 = device_preset("h100")
    n = _windowed_mllm(None).llm.body.n_layers
    full, windowed = CostModel(_windowed_mllm(None), h100), CostModel(_windowed_mllm(16, (n - 1,)), h100)
    sample = SampleShape(text_tokens=300, items=(ModalityItem("image", tiles=1),), item_offsets=(20,))
    a, b = sample_loads(sample, full.mllm)["llm"], sample_loads(sample, windowed.mllm)["llm"]
    assert a.window_pairs is None and b.pairs == a.pairs and b.window_pairs < a.pairs
    f_pair = full.layers["llm"][1].f_pair
    saved = windowed.phase_flops("llm", b)[0] - full.phase_flops("llm", a)[0]
    assert saved == pytest.approx(-f_pair * (a.pairs - b.window_pairs))
    # the first blocks (no window) cost the same; the last block pays only for its window
    assert windowed.phase_flops("llm", b, 0, n - 1) == pytest.approx(full.phase_flops("llm", a, 0, n - 1))
    # whole-module costs from the arrays agree with the per-layer sum (under a calibration every
    # FLOP runs at one measured rate, so seconds x rate are FLOPs)
    measured = CostModel(windowed.mllm, h100, Calibration("h100", {"F": 0.5}))
    tokens, pairs = load_arrays([sample], measured.mllm)
    j = measured.modules.index("llm")
    from_arrays = measured.costs_from_loads(tokens, pairs, "F")[0, j] * h100.peak_flops * 0.5
    assert from_arrays == pytest.approx(measured.phase_flops("llm", b)[0], rel=1e-6)


def test_windowed_attention_work_grows_with_min_of_sequence_and_window():
    for length in (10, 100, 1000):
        assert attended_pairs([("text", length)], 64) == sum(min(p + 1, 64) for p in range(length))
    long = attended_pairs([("text", 4000)], 64)
    assert long == pytest.approx(4000 * 64, rel=0.01)
