"""The packed attention entry: every kernel that runs on CPU equals the dense reference (outputs and
gradients, fp32), under context-parallel shards too; the kernel choice by device and mask kind;
work about the kept pairs; memory linear in the tokens."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import harmonia.model.attention as attention
from harmonia.errors import ConfigError
from harmonia.model.attention import PackedAttention, plan_query_blocks
from harmonia.model.attention_backend import CAUSAL, MIXED, SEQUENCES, choose_backend, mask_kind
from harmonia.model.attention_mask import TokenLayout, count_pairs, multimodal_mask

ROOT = Path(__file__).resolve().parents[2]


def random_layout(rng: random.Random, n_samples: int, longest: int = 40) -> TokenLayout:
    samples = [[(rng.choice(["text", "item"]), rng.randint(1, longest)) for _ in range(rng.randint(1, 4))]
               for _ in range(n_samples)]
    return TokenLayout.from_segments(samples, causal_items=rng.random() < 0.3)


def dense(q, k, v, queries, keys, window):
    mask = multimodal_mask(queries, keys, window)[None, None]  # (1, 1, t, T): the reference
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _grads(y, inputs, g):
    return torch.autograd.grad(y, inputs, g)


@pytest.mark.parametrize("seed", range(24))
def test_segments_equal_the_dense_reference_outputs_and_gradients(seed, monkeypatch) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(attention, "QUERY_BLOCK", rng.choice([4, 16, 64, 256]))
    layout = random_layout(rng, rng.randint(1, 6))
    T, nh, nkv = len(layout), 4, rng.choice([4, 2, 1])  # GQA and MQA included
    window = rng.choice([None, 1, 5, 30])
    torch.manual_seed(seed)
    q = torch.randn(1, nh, T, 8, requires_grad=True)
    k, v = (torch.randn(1, nkv, T, 8, requires_grad=True) for _ in range(2))
    want = dense(q, k, v, layout, layout, window)
    got = PackedAttention(layout).attend(q, k, v, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    for a, b in zip(_grads(got, (q, k, v), g), _grads(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_shard_attends_its_queries_against_every_key_in_sequence_order(cp) -> None:
    """One CP rank's queries; the other ranks' keys and values arrive in gathered (rank) order."""
    rng = random.Random(cp)
    layout = random_layout(rng, 5)
    T = len(layout)
    ranks = torch.tensor([(i // 3) % cp for i in range(T)])  # blocks of 3 tokens dealt round the ranks
    mine = (ranks == 1).nonzero().flatten()
    order = torch.argsort(ranks, stable=True)  # gathered order: rank by rank, each ascending
    torch.manual_seed(cp)
    q = torch.randn(1, 4, T, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, T, 8, requires_grad=True) for _ in range(2))
    others = torch.cat((k, v), dim=1).permute(2, 0, 1, 3)[order].detach()  # (T, 1, 4, 8) gathered

    def gather(local):  # this rank's rows placed among the others' (its gradient flows to them)
        at = (ranks[order] == 1).nonzero().flatten()
        return others.index_copy(0, at, local)

    shard = PackedAttention(layout, query_index=mine, gather=gather, key_order=order)
    for window in (None, 4):
        want = dense(q[:, :, mine], k, v, layout.select(mine), layout, window)
        ql, kl, vl = q[:, :, mine], k[:, :, mine], v[:, :, mine]
        got = shard.attend(ql, kl, vl, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(want)
        gq, gk, gv = _grads(got, (q, k, v), g)
        wq, wk, wv = _grads(want, (q, k, v), g)
        torch.testing.assert_close(gq, wq, rtol=1e-5, atol=1e-5)
        # this rank's keys and values: the gradient of its own queries' attention (the collective
        # sums the other ranks' shares onto them)
        torch.testing.assert_close(gk[:, :, mine], wk[:, :, mine], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv[:, :, mine], wv[:, :, mine], rtol=1e-5, atol=1e-5)


def test_blocks_cover_every_query_once_and_compute_about_the_kept_pairs() -> None:
    rng = random.Random(7)
    for _ in range(30):
        layout = random_layout(rng, rng.randint(1, 12), longest=400)
        packed = PackedAttention(layout)
        for window in (None, 64):
            blocks = packed.blocks(window)
            covered = [i for b in blocks for i in range(b.q0, b.q1)]
            assert covered == list(range(len(layout)))
            assert all(b.q1 - b.q0 <= attention.QUERY_BLOCK for b in blocks)
            kept = count_pairs(layout, window=window)
            assert kept <= packed.computed_pairs(window) <= kept + attention.QUERY_BLOCK * len(layout)


@pytest.mark.parametrize("seed", range(8))
def test_causal_samples_run_as_padded_groups_equal_to_the_dense_reference(seed) -> None:
    """Causal text samples of mixed lengths (1 to 300 tokens): padded groups, outputs and gradients
    as the dense rule's; a window or bidirectional items fall back to blocks."""
    rng = random.Random(seed)
    lengths = [rng.choice([1, rng.randint(2, 40), rng.randint(41, 300)]) for _ in range(rng.randint(1, 12))]
    layout = TokenLayout.from_segments([[("text", n)] for n in lengths])
    packed = PackedAttention(layout)
    assert packed.padded_groups() is not None and packed.padded_groups(8) is None
    T, nh, nkv = len(layout), 4, rng.choice([4, 2, 1])
    torch.manual_seed(seed)
    q = torch.randn(1, nh, T, 8, requires_grad=True)
    k, v = (torch.randn(1, nkv, T, 8, requires_grad=True) for _ in range(2))
    want = dense(q, k, v, layout, layout, None)
    got = packed.attend(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    for a, b in zip(_grads(got, (q, k, v), g), _grads(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    mixed = TokenLayout.from_segments([[("text", 3), ("item", 4), ("text", 2)]])
    assert PackedAttention(mixed).padded_groups() is None


def test_padded_groups_hold_every_token_once_and_bound_their_waste() -> None:
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(1, 20))]
        packed = PackedAttention(TokenLayout.from_segments([[("text", n)] for n in lengths]))
        groups = packed.padded_groups()
        assert sorted(groups.index[groups.valid].tolist()) == list(range(sum(lengths)))
        at = 0
        for n, L in groups.shapes:
            own = groups.valid[at:at + n * L].view(n, L).sum(1).tolist()
            assert max(own) == L
            assert n * L * (L + 1) / 2 <= attention.PADDING_WASTE * sum(m * (m + 1) / 2 for m in own) or n == 1
            at += n * L
        assert packed.computed_pairs() == sum(n * L * (L + 1) // 2 for n, L in groups.shapes)


@pytest.mark.parametrize("lengths, viewed", [([6, 6, 6, 6], True), ([7], True), ([9, 4, 4, 4, 1], False),
                                             ([3, 5, 5], False)])
def test_equally_long_samples_side_by_side_run_as_views_with_the_gathered_results(lengths, viewed) -> None:
    """A group of equally long samples that lie side by side in order takes its rows as a view of the
    sequence and writes them back as one slice: outputs and gradients bit for bit those of the
    gathered and scattered rows."""
    layout = TokenLayout.from_segments([[("text", n)] for n in lengths])
    torch.manual_seed(len(lengths))
    T, nh = len(layout), 4
    q0 = torch.randn(2, T, nh, 8).transpose(1, 2)  # token-major, as the projections lay them out
    k0, v0 = (torch.randn(2, T, 2, 8).transpose(1, 2) for _ in range(2))
    g = torch.randn(2, nh, T, 8)
    results = []
    for in_runs in (True, False):
        packed = PackedAttention(layout)
        groups = packed.padded_groups()
        if not in_runs:
            groups._runs = [None] * len(groups.shapes)
        elif viewed:  # one group of every sample
            assert groups._runs == [(0, T)]
            assert groups.pad(q0, 0).untyped_storage().data_ptr() == q0.untyped_storage().data_ptr()  # no copy
        q, k, v = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))
        out = packed.attend(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_short_samples_share_a_block_and_long_ones_are_cut() -> None:
    starts = [0] * 3 + [3] * 2 + [5] * 10  # samples of 3, 2 and 10 queries
    first, ends = starts, [i + 1 for i in range(15)]
    blocks = plan_query_blocks(starts, first, ends, width=6)
    assert [(b.q0, b.q1, b.k0, b.k1) for b in blocks] == [(0, 5, 0, 5), (5, 11, 5, 11), (11, 15, 5, 15)]


def test_the_kernel_is_chosen_by_device_and_mask_kind() -> None:
    assert choose_backend("auto", "cpu", MIXED) == "segments"
    assert choose_backend("auto", "cuda", CAUSAL) == "varlen"
    assert choose_backend("auto", "cuda", SEQUENCES) == "varlen"
    assert choose_backend("auto", "cuda", MIXED) == "flex"
    assert choose_backend("segments", "cuda", MIXED) == "segments"
    with pytest.raises(ConfigError, match="'varlen' runs on CUDA only, not on cpu \\(causal packed documents\\)"):
        choose_backend("varlen", "cpu", CAUSAL)
    with pytest.raises(ConfigError, match="'flex' runs on CUDA only, not on cpu \\(bidirectional items"):
        choose_backend("flex", "cpu", MIXED)
    with pytest.raises(ConfigError, match="'varlen' cannot express bidirectional items in causal text on cuda"):
        choose_backend("varlen", "cuda", MIXED)
    with pytest.raises(ConfigError, match="not one of"):
        choose_backend("math", "cpu", CAUSAL)


def test_the_mask_kind_is_read_from_the_layout() -> None:
    assert mask_kind(TokenLayout.from_segments([[("text", 3), ("item", 2)]], causal_items=True)) == CAUSAL
    assert mask_kind(TokenLayout.from_segments([[("text", 3), ("item", 2)]])) == MIXED
    assert mask_kind(TokenLayout.from_segments([[("item", 3), ("item", 2)]])) == MIXED  # two items, one sample
    assert mask_kind(TokenLayout.from_segments([[("item", 3)], [("item", 2)]])) == SEQUENCES


@pytest.mark.parametrize("seed", range(6))
def test_packed_encoder_sequences_equal_each_sequence_attended_alone(seed, monkeypatch) -> None:
    """Images of different sizes in one call: each sequence attends its whole self, nothing else."""
    rng = random.Random(seed)
    monkeypatch.setattr(attention, "QUERY_BLOCK", rng.choice([8, 64, 256]))
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 5))]
    nh, nkv = 4, rng.choice([4, 2])
    torch.manual_seed(seed)
    q = torch.randn(1, nh, sum(lengths), 8, requires_grad=True)
    k, v = (torch.randn(1, nkv, sum(lengths), 8, requires_grad=True) for _ in range(2))
    packed = PackedAttention.sequences(lengths)
    assert packed.kind == SEQUENCES and packed.backend == "segments"
    got = packed.attend(q, k, v)
    alone = [F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (q, k, v)), enable_gqa=nh != nkv)
             for a, b in zip(_offsets(lengths), _offsets(lengths)[1:])]
    want = torch.cat(alone, dim=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    for a, b in zip(_grads(got, (q, k, v), g), _grads(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    pairs = sum(n * n for n in lengths)
    assert pairs <= packed.computed_pairs() <= pairs + attention.QUERY_BLOCK * sum(lengths)


@pytest.mark.parametrize("lengths", [[16, 16, 8, 16, 16, 8, 4, 4], [64, 64, 64], [7], [5, 9, 5, 9, 1]])
def test_packed_sequences_of_equal_length_run_as_unpadded_batches(lengths) -> None:
    """Windows of a tower (most of one size, the edges smaller, interleaved): each length one
    unmasked call over its sequences, no padding, exactly their pairs computed, the outputs and
    gradients those of each sequence alone."""
    packed = PackedAttention.sequences(lengths)
    groups = packed.padded_groups()
    assert sorted(groups.shapes) == sorted((lengths.count(n), n) for n in set(lengths))
    assert bool(groups.valid.all()) and sorted(groups.index.tolist()) == list(range(sum(lengths)))
    assert packed.computed_pairs() == sum(n * n for n in lengths)
    assert packed.padded_groups(4) is None  # a window: blocks
    torch.manual_seed(len(lengths))
    q = torch.randn(2, sum(lengths), 4, 8).transpose(1, 2).requires_grad_()  # token-major rows
    k, v = (torch.randn(2, 2, sum(lengths), 8, requires_grad=True) for _ in range(2))
    got = packed.attend(q, k, v)
    at = _offsets(lengths)
    want = torch.cat([F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (q, k, v)), enable_gqa=True)
                      for a, b in zip(at, at[1:])], dim=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(want)
    for a, b in zip(_grads(got, (q, k, v), g), _grads(want, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_varlen_runs_of_packed_sequences_are_the_sequences_unmasked() -> None:
    packed = PackedAttention.sequences([5, 300, 17])
    (k_index, cu_q, cu_k, max_q, max_k), window = packed.varlen_runs()
    assert k_index is None and window == (-1, -1) and (max_q, max_k) == (300, 300)
    assert cu_q.tolist() == cu_k.tolist() == [0, 5, 305, 322] and cu_q.dtype == torch.int32
    causal = PackedAttention(TokenLayout.from_segments([[("text", 4)], [("text", 3)]]))
    (_, cu_q, cu_k, _, _), window = causal.varlen_runs(2)
    assert window == (1, 0) and cu_q.tolist() == [0, 4, 7]
    with pytest.raises(ConfigError, match="no sliding window"):
        packed.varlen_runs(8)
    with pytest.raises(ConfigError, match="positive lengths"):
        PackedAttention.sequences([3, 0])


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def test_a_layout_out_of_order_is_refused() -> None:
    layout = TokenLayout.from_segments([[("text", 4)], [("text", 3)]])
    with pytest.raises(ConfigError, match="positions 0, 1"):
        PackedAttention(layout.select(torch.tensor([1, 0, 2, 3, 4, 5, 6])))


def test_a_cpu_job_asking_for_a_cuda_kernel_stops_before_it_starts(tmp_path) -> None:
    from harmonia.config import load_config
    from harmonia.train.planning import check_cluster

    config = load_config(None, ["--model.preset=tiny-omni", "--train.attention=varlen", "--parallel.backend=gloo"])
    with pytest.raises(ConfigError, match="'varlen' runs on CUDA only, not on cpu"):
        check_cluster(config)


_PEAK = """
import sys, torch
from harmonia.model.attention import PackedAttention
from harmonia.model.attention_mask import TokenLayout

def status(field):  # kB
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])

T = int(sys.argv[1])
layout = TokenLayout.from_segments([[("text", T // 2), ("item", T // 4), ("text", T - T // 2 - T // 4)]])
q, k, v = (torch.randn(1, 2, T, 8, requires_grad=True) for _ in range(3))
packed = PackedAttention(layout)
packed.blocks()
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts from the resident set now
base = status("VmRSS:")
packed.attend(q, k, v).sum().backward()
print((status("VmHWM:") - base) / 1024)
"""


@pytest.mark.slow
def test_attention_memory_grows_linearly_in_the_tokens() -> None:
    """One 8k / 16k / 32k-token sample (text, a bidirectional item, text), forward and backward.
    The dense kernel would hold a 1 GiB mask and 8 GiB of scores at 32k; the allocator's returned
    memory is measured (a fixed mmap threshold, so the resident high-water mark is what was live at
    once, counted from just before the attention)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    peaks = [float(subprocess.run([sys.executable, "-c", _PEAK, str(T)], env=env, capture_output=True, text=True,
                                  check=True, timeout=600).stdout) for T in (8192, 16384, 32768)]
    growth = (peaks[2] - peaks[1]) / (peaks[1] - peaks[0])  # linear: 2; quadratic: 4
    assert growth < 3 and peaks[2] < 400, peaks


@pytest.mark.slow
def test_a_packed_microbatch_of_32k_tokens_trains_on_cpu() -> None:
    import dataclasses

    from harmonia.model.llm import build_llm, lm_loss
    from harmonia.model.presets import mllm_preset

    spec = mllm_preset("tiny-omni").llm
    spec = dataclasses.replace(spec, body=dataclasses.replace(spec.body, n_layers=2))
    torch.manual_seed(0)
    model = build_llm(spec)
    rng = random.Random(0)
    samples, total = [], 0
    while total < 32768 - 600:
        n = rng.randint(300, 3000)
        samples.append([("text", n // 2), ("item", n // 4), ("text", n - n // 2 - n // 4)])
        total += n
    samples.append([("text", 32768 - total)])
    layout = TokenLayout.from_segments(samples)
    ids = torch.randint(0, spec.vocab_size, (1, len(layout)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        loss = lm_loss(model(ids, layout.position[None], PackedAttention(layout)), torch.roll(ids, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert len(layout) == 32768 and losses[1] < losses[0]


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    """FlashAttention's varlen rule, per sequence: query ``r`` of ``lq`` against keys ``lk - lq + r -
    left .. lk - lq + r + right`` (bottom-right aligned; -1 = unbounded). q (tq, nh, hd), k/v (tk, nkv, hd)."""
    assert enable_gqa or k.shape[1] == q.shape[1], "keys need every query head without enable_gqa"
    assert cu_q.dtype == cu_k.dtype == torch.int32 and max_q == max(cu_q.diff()) and max_k == max(cu_k.diff())
    left, right = window_size
    out = []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        r = torch.arange(len(qi))[:, None] + len(ki) - len(qi)
        j = torch.arange(len(ki))[None]
        kept = (j <= r + right if right >= 0 else j >= 0) & (j >= r - left if left >= 0 else j >= 0)
        y = F.scaled_dot_product_attention(*(t.transpose(0, 1).float() for t in (qi, ki, vi)), attn_mask=kept,
                                           enable_gqa=enable_gqa)
        out.append(y.transpose(0, 1).to(q.dtype))
    return torch.cat(out)


@pytest.mark.parametrize("takes_gqa", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_varlen_calls_equal_the_dense_reference(seed, takes_gqa, monkeypatch) -> None:
    """The ``varlen`` path's sequences, key ranges and windows, through a kernel with FlashAttention's
    rule (with or without ``enable_gqa``, as torch 2.13 and 2.11 ship it), in bf16 as it runs."""
    kernel = flash_varlen if takes_gqa else (lambda *a, **kw: flash_varlen(*a, **kw))
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: (kernel, takes_gqa))
    rng = random.Random(seed)
    if seed % 3 == 2:
        layout, window = PackedAttention.sequences([rng.randint(1, 40) for _ in range(4)]).queries, None
    else:
        layout = TokenLayout.from_segments([[(rng.choice(["text", "item"]), rng.randint(1, 30))
                                             for _ in range(rng.randint(1, 3))] for _ in range(4)], causal_items=True)
        window = rng.choice([None, 3, 17])
    torch.manual_seed(seed)
    q = torch.randn(1, 4, len(layout), 8)
    k, v = torch.randn(2, 1, 2, len(layout), 8).unbind(0)
    want = dense(q, k, v, layout, layout, window)
    got = PackedAttention(layout, backend="varlen").attend(*(t.bfloat16() for t in (q, k, v)), window)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_auto_picks_a_cuda_kernel_that_takes_the_heads_and_an_explicit_one_that_cannot_is_refused() -> None:
    """flex needs 16 channels per head or more, FlashAttention's varlen a multiple of 8 up to 256."""
    assert choose_backend("auto", "cuda", CAUSAL, 64) == "varlen"
    assert choose_backend("auto", "cuda", CAUSAL, 20) == "flex"  # not a multiple of 8
    assert choose_backend("auto", "cuda", CAUSAL, 12) == "segments"  # neither
    assert choose_backend("auto", "cuda", MIXED, 12) == "segments"
    assert choose_backend("auto", "cuda", SEQUENCES, 512) == "flex"
    assert choose_backend("auto", "cpu", CAUSAL, 12) == "segments"
    with pytest.raises(ConfigError, match="'flex' cannot run heads of 12 channels"):
        choose_backend("flex", "cuda", MIXED, 12)
    with pytest.raises(ConfigError, match="'varlen' cannot run heads of 300 channels"):
        choose_backend("varlen", "cuda", CAUSAL, 300)


def test_a_gpu_job_asking_for_a_kernel_its_heads_do_not_fit_stops_before_it_starts(monkeypatch) -> None:
    from harmonia.config import load_config
    from harmonia.train import planning

    monkeypatch.setattr("harmonia.train.backend.backend_of", lambda config: "nccl")
    config = load_config(None, ["--model.preset=tiny-vlm", "--train.attention=flex", "--parallel.cluster=h100:1x1",
                                "--parallel.world_size=1"])
    with pytest.raises(ConfigError, match="'flex' cannot run heads of 12 channels"):
        planning.check_cluster(config)
