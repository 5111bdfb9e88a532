"""Boundary plans, checked without a process group by replaying their messages on numbered rows.

Every rank's expected rows are derived here row by row from the definitions (an independent
reference); the plan's messages must deliver exactly those rows forward and the exact adjoint backward.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from harmonia.errors import LayoutError, SampleError
from harmonia.runtime.boundary_plan import BoundaryPlan, plan_boundary
from harmonia.schedule.cp_shards import plan_cp_shards
from harmonia.schedule.layout import Layout

DEGREES = [{"dp": 1}, {"dp": 2}, {"dp": 4}, {"tp": 2}, {"dp": 2, "tp": 2}, {"cp": 2}, {"dp": 2, "cp": 2},
           {"pp": 2, "dp": 2}, {"tp": 2, "cp": 2}, {"dp": 3}]


def _split(samples: list[int], parts: int, rng: random.Random) -> list[list[int]]:
    """Shuffle samples and deal them into ``parts`` lists of random sizes (some may be empty)."""
    order = samples[:]
    rng.shuffle(order)
    cuts = sorted(rng.randint(0, len(order)) for _ in range(parts - 1))
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)])]


def _local_rows(layout: Layout, stage: int, samples, rows, starts, assign) -> dict[int, list[int]]:
    """Reference: rank -> global row ids it holds, in local order (TP replicas hold the same)."""
    out = {}
    for d, replica in enumerate(samples):
        g = [starts[s] + k for s in replica for k in range(rows[s])]
        a = assign[d] if assign else None
        if a is None:  # contiguous front-heavy split, as the plan's default
            base, extra = divmod(len(g), layout.cp)
            a = [c for c in range(layout.cp) for _ in range(base + (c < extra))]
        for c in range(layout.cp):
            mine = [r for r, x in zip(g, a) if x == c]
            for t in range(layout.tp):
                out[layout.rank_at(stage, d, c, t)] = mine
    return out


def _case(src: Layout, dst: Layout, seed: int, cp_random: bool, tp_grads: str = "replicated",
          gpus_per_node: int | None = None):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    items = [[rng.choice([0, 1, 3, 4, 7]) for _ in range(rng.randint(0, 3))] for _ in range(n)]
    src_samples = _split(list(range(n)), src.dp, rng)
    dst_samples = _split(list(range(n)), dst.dp, rng)
    rows = [sum(i) for i in items]
    starts = [sum(rows[:s]) for s in range(n)]

    def assign(layout, samples):
        if not cp_random:
            return None
        return [[rng.randrange(layout.cp) for _ in range(sum(rows[s] for s in rep))] for rep in samples]

    src_assign, dst_assign = assign(src, src_samples), assign(dst, dst_samples)
    plan = plan_boundary(src, dst, items, src_samples, dst_samples, dst_assign, src_assign, tp_grads,
                         gpus_per_node)
    src_ref = _local_rows(src, src.pp - 1, src_samples, rows, starts, src_assign)
    dst_ref = _local_rows(dst, 0, dst_samples, rows, starts, dst_assign)
    return plan, src_ref, dst_ref, sum(rows)


def _replay(plan: BoundaryPlan, held: dict[int, torch.Tensor], sizes: dict[int, int], backward: bool,
            accumulate: bool) -> dict[int, torch.Tensor]:
    """Apply a plan's messages (forward or backward) to per-rank row tensors ``(n, D)``.

    Forward: hop 0 reads the held rows, hop 1 the rows received so far. Backward: hop 1 first adds the
    peers' rows to a copy of the receiving rank's own, hop 0 sends from those sums.
    """
    out = {r: torch.zeros(n, 2, dtype=torch.float64) for r, n in sizes.items()}
    hits = {r: torch.zeros(n, dtype=torch.long) for r, n in sizes.items()}
    messages = plan.backward if backward else plan.forward
    if backward:
        summed = {r: v.clone() for r, v in held.items()}
        for m in (m for m in messages if m.hop == 1):
            summed[m.dst].index_add_(0, torch.tensor(m.receiver_rows(), dtype=torch.long),
                                     held[m.src][m.sender_rows()])
        held = summed
    for m in sorted(messages, key=lambda m: m.hop):
        if m.hop == 1 and backward:
            continue
        data = (out if m.hop == 1 else held)[m.src][m.sender_rows()]
        idx = torch.tensor(m.receiver_rows(), dtype=torch.long)
        out[m.dst].index_add_(0, idx, data)
        hits[m.dst].index_add_(0, idx, torch.ones_like(idx))
    for r, h in hits.items():
        if not accumulate:
            assert bool((h == 1).all()), f"rank {r}: rows filled {h.tolist()} times, expected once each"
    return out


LAYOUT_PAIRS = []
for a, b in itertools.product(DEGREES, DEGREES):
    for colocated in (True, False):
        src = Layout(**a)
        dst = Layout(**b, rank_offset=0 if colocated else src.size)
        LAYOUT_PAIRS.append(pytest.param(src, dst, id=f"{a}->{b}-{'co' if colocated else 'dis'}"))


def _check_rows_and_adjoint(src: Layout, dst: Layout, gpus_per_node: int | None, seeds=range(4)) -> None:
    for seed, cp_random, tp_grads in itertools.product(seeds, (False, True), ("replicated", "partial")):
        plan, src_ref, dst_ref, total = _case(src, dst, seed, cp_random, tp_grads, gpus_per_node)
        assert plan.src_rows == {r: len(v) for r, v in src_ref.items()}
        assert plan.dst_rows == {r: len(v) for r, v in dst_ref.items()}
        values = torch.randn(total, 2, dtype=torch.float64)
        # Forward: every destination rank gets exactly its rows, each once.
        held = {r: values[rows] for r, rows in src_ref.items()}
        got = _replay(plan, held, plan.dst_rows, backward=False, accumulate=False)
        for r, rows in dst_ref.items():
            assert torch.equal(got[r], values[rows]), f"rank {r} forward rows differ"
        # Backward: per destination rank gradients; TP replicas identical (replicated) or partial (summed).
        grads = torch.randn(total, 2, dtype=torch.float64)
        g_dst, expected = {}, torch.zeros(total, 2, dtype=torch.float64)
        for r, rows in dst_ref.items():
            part = grads[rows] if tp_grads == "replicated" else torch.randn(len(rows), 2, dtype=torch.float64)
            g_dst[r] = part
            if tp_grads == "partial" or dst.coords(r)["tp"] == 0:
                expected.index_add_(0, torch.tensor(rows, dtype=torch.long), part)
        back = _replay(plan, g_dst, plan.src_rows, backward=True, accumulate=tp_grads == "partial")
        for r, rows in src_ref.items():
            torch.testing.assert_close(back[r], expected[rows], rtol=0, atol=1e-12)
        # Adjoint: <F x, g> (one copy per TP group on both sides) == <x, B g>.
        lhs = sum(float((got[r] * g_dst[r]).sum()) for r in dst_ref
                  if tp_grads == "partial" or dst.coords(r)["tp"] == 0)
        rhs = sum(float((held[r] * back[r]).sum()) for r in src_ref if src.coords(r)["tp"] == 0)
        assert lhs == pytest.approx(rhs, rel=1e-9, abs=1e-9)
        if gpus_per_node:  # rows enter each node once: the lower bound
            entering = {k: v[1] for k, v in plan.node_bytes(1).items() if v[1]}
            assert entering == _cross_node_bound(src_ref, dst_ref, gpus_per_node), f"seed {seed}"


def _cross_node_bound(src_ref, dst_ref, per: int) -> dict[int, int]:
    """Node -> rows some rank of it needs that no rank of it holds (nodes with none left out)."""
    need: dict[int, set[int]] = {}
    held: dict[int, set[int]] = {}
    for r, rows in dst_ref.items():
        need.setdefault(r // per, set()).update(rows)
    for r, rows in src_ref.items():
        held.setdefault(r // per, set()).update(rows)
    out = {k: len(v - held.get(k, set())) for k, v in need.items()}
    return {k: v for k, v in sorted(out.items()) if v}


@pytest.mark.parametrize("src,dst", LAYOUT_PAIRS)
def test_rows_and_adjoint(src: Layout, dst: Layout) -> None:
    _check_rows_and_adjoint(src, dst, None)


RELAY_PAIRS = [
    (Layout(), Layout(tp=4, rank_offset=4)),  # one source, one node of four receivers
    (Layout(dp=2), Layout(tp=4, dp=2, rank_offset=2)),  # TP groups straddle nodes of 4
    (Layout(tp=2), Layout(tp=8, rank_offset=2)),
    (Layout(dp=4), Layout(dp=2, tp=2)),  # colocated: some rows held on the node, some not
    (Layout(dp=2, tp=2), Layout(tp=4)),
    (Layout(dp=4), Layout(tp=4, cp=2)),
    (Layout(tp=2, cp=2), Layout(tp=4, dp=2, rank_offset=4)),
    (Layout(dp=3), Layout(tp=2, dp=3, ranks=(5, 0, 6, 1, 7, 2))),  # strided TP peers
    (Layout(tp=2, dp=2), Layout(tp=2, dp=2, rank_offset=4)),  # equal TP, disjoint nodes
]


@pytest.mark.parametrize("gpus_per_node", [1, 2, 3, 4])
@pytest.mark.parametrize("src,dst", RELAY_PAIRS)
def test_relay_rows_adjoint_and_node_bound(src: Layout, dst: Layout, gpus_per_node: int) -> None:
    """With nodes: every destination rank still gets exactly its rows, the backward is the exact
    adjoint, and the rows entering each node are the lower bound."""
    _check_rows_and_adjoint(src, dst, gpus_per_node)


@pytest.mark.parametrize("src,dst", LAYOUT_PAIRS[::3])
def test_relay_any_layout_pair(src: Layout, dst: Layout) -> None:
    _check_rows_and_adjoint(src, dst, 2, seeds=range(2))


def test_relay_enters_each_node_once() -> None:
    """One source, a TP 4 destination on another node: rows cross once, split over the four
    receivers, each forwarding its chunk to its peers (Megatron's bridge sends it 1x and broadcasts)."""
    items = [[5], [3], [8]]
    direct = plan_boundary(Layout(), Layout(tp=4, rank_offset=4), items, [[0, 1, 2]], [[0, 1, 2]])
    relay = plan_boundary(Layout(), Layout(tp=4, rank_offset=4), items, [[0, 1, 2]], [[0, 1, 2]],
                          gpus_per_node=4)
    assert direct.node_bytes(1, gpus_per_node=4) == {0: (64, 0), 1: (0, 64)}
    assert relay.node_bytes(1) == {0: (16, 0), 1: (0, 16)}
    assert relay.relays and not direct.relays
    assert {(m.src, m.dst, m.runs) for m in relay.forward if m.hop == 0} == {
        (0, 4, ((0, 0, 4),)), (0, 5, ((4, 4, 4),)), (0, 6, ((8, 8, 4),)), (0, 7, ((12, 12, 4),))}
    sent = relay.bytes_per_rank(1)
    assert sent[0] == (16, 0) and all(sent[r] == (12, 16) for r in range(4, 8))
    # Replicated gradients need no relay backward; partial ones are summed on the node first.
    assert not any(m.hop for m in relay.backward)
    partial = plan_boundary(Layout(), Layout(tp=4, rank_offset=4), items, [[0, 1, 2]], [[0, 1, 2]],
                            dst_tp_grads="partial", gpus_per_node=4)
    assert partial.node_bytes(1, backward=True) == {0: (0, 16), 1: (16, 0)}


def test_colocated_copies_stay_local() -> None:
    """Colocated with equal layouts and the same samples: nothing crosses the network."""
    layout = Layout(dp=2, tp=2)
    plan = plan_boundary(layout, layout, [[3], [2, 2], [5]], [[0, 1], [2]], [[0, 1], [2]])
    assert plan.sends(0) == [] and plan.sends(0, backward=True) == []
    assert all(m.src == m.dst for m in (*plan.forward, *plan.backward))
    assert all(v == (0, 0) for v in plan.bytes_per_rank(4).values())


def test_fan_in_variable_tokens() -> None:
    """enc dp 4 -> llm dp 1 with different token counts per sample: one message per source replica."""
    plan = plan_boundary(Layout(dp=4), Layout(rank_offset=4), [[1], [2, 3], [0], [4]],
                         [[0], [1], [2], [3]], [[3, 1, 0, 2]])
    assert plan.dst_rows == {4: 10}
    assert {(m.src, m.dst, m.runs) for m in plan.forward} == {(3, 4, ((0, 0, 4),)), (1, 4, ((0, 4, 5),)),
                                                             (0, 4, ((0, 9, 1),))}
    assert plan.bytes_per_rank(4)[4] == (0, 40)


def test_tp_replicas_share_sending() -> None:
    """A TP 2 source feeding two DP replicas uses both of its replicas as senders."""
    plan = plan_boundary(Layout(tp=2), Layout(dp=2, rank_offset=2), [[2], [2]], [[0, 1]], [[0], [1]])
    assert {m.src for m in plan.forward} == {0, 1}
    # Backward: each source TP replica gets the whole gradient, from the destination that holds each row.
    assert {(m.src, m.dst) for m in plan.backward} == {(2, 0), (2, 1), (3, 0), (3, 1)}


def test_cp_shards_of_the_packed_sequence() -> None:
    """Destination CP assignment read from `plan_cp_shards` of each replica's packed sequence (numpy)."""
    rng = random.Random(3)
    n = 12
    items = [[rng.choice([16, 64, 200]) for _ in range(rng.randint(0, 3))] for _ in range(n)]
    text = [[rng.randint(1, 90) for _ in range(len(i) + 1)] for i in items]  # text around every item
    src, dst = Layout(dp=3), Layout(dp=2, cp=2, tp=2, rank_offset=3)
    src_samples, dst_samples = _split(list(range(n)), 3, rng), _split(list(range(n)), 2, rng)
    dst_assign = []
    for replica in dst_samples:
        segments = [[seg for t, m in zip(text[s], [*items[s], None]) for seg in
                     (("text", t), ("item", m)) if seg[1] is not None] for s in replica]
        kinds = np.concatenate([np.full(k, kind == "item") for seg in segments for kind, k in seg])
        shards = plan_cp_shards(segments, dst.cp, block=32)
        dst_assign.append(shards.token_ranks()[np.flatnonzero(kinds)])  # (media rows,) cp rank per row
    plan = plan_boundary(src, dst, items, src_samples, dst_samples, dst_cp_assign=dst_assign)
    rows = [sum(i) for i in items]
    starts = [sum(rows[:s]) for s in range(n)]
    src_ref = _local_rows(src, 0, src_samples, rows, starts, None)
    dst_ref = _local_rows(dst, 0, dst_samples, rows, starts, dst_assign)
    assert plan.dst_rows == {r: len(v) for r, v in dst_ref.items()}
    values = torch.randn(sum(rows), 2, dtype=torch.float64)
    got = _replay(plan, {r: values[v] for r, v in src_ref.items()}, plan.dst_rows, False, False)
    assert all(torch.equal(got[r], values[v]) for r, v in dst_ref.items())


def test_user_errors() -> None:
    with pytest.raises(SampleError, match="exactly one replica"):
        plan_boundary(Layout(), Layout(), [[1], [1]], [[0]], [[0, 1]])
    with pytest.raises(SampleError, match="negative"):
        plan_boundary(Layout(), Layout(), [[-1]], [[0]], [[0]])
    with pytest.raises(LayoutError, match="one \\(possibly empty\\) list"):
        plan_boundary(Layout(dp=2), Layout(), [[1]], [[0]], [[0]])
    with pytest.raises(LayoutError, match="cp rank in 0..1"):
        plan_boundary(Layout(), Layout(cp=2), [[2]], [[0]], [[0]], dst_cp_assign=[[0, 2]])
    with pytest.raises(LayoutError, match="integer cp rank"):
        plan_boundary(Layout(), Layout(cp=2), [[2]], [[0]], [[0]], dst_cp_assign=[np.array([0.0, 1.0])])
    with pytest.raises(LayoutError, match="for each of its 2 rows"):
        plan_boundary(Layout(), Layout(cp=2), [[2]], [[0]], [[0]], dst_cp_assign=[np.zeros(3, dtype=int)])
    with pytest.raises(LayoutError, match="dst_tp_grads"):
        plan_boundary(Layout(), Layout(), [[1]], [[0]], [[0]], dst_tp_grads="mean")
    with pytest.raises(LayoutError, match="gpus_per_node"):
        plan_boundary(Layout(), Layout(), [[1]], [[0]], [[0]], gpus_per_node=0)
    with pytest.raises(LayoutError, match="ranks per node"):
        plan_boundary(Layout(), Layout(), [[1]], [[0]], [[0]]).node_bytes(2)


def test_spans_without_cp_equal_the_general_path_of_an_explicit_cp_assignment() -> None:
    """The plain path (no CP, no assignment) gives the spans the vectorised path gives when told
    every row sits on CP rank 0: empty samples and replicas included."""
    from harmonia.runtime.boundary_plan import _spans

    rng = random.Random(4)
    for _ in range(200):
        dp = rng.randint(1, 4)
        rows = [rng.choice([0, rng.randint(1, 9)]) for _ in range(rng.randint(dp, 12))]
        starts = [sum(rows[:s]) for s in range(len(rows))]
        order = list(range(len(rows)))
        rng.shuffle(order)
        samples = [order[d::dp] for d in range(dp)]
        layout = Layout(dp=dp)
        zeros = [np.zeros(sum(rows[s] for s in rep), dtype=np.int64) for rep in samples]
        assert _spans("source", layout, samples, rows, starts, None) == _spans("source", layout, samples, rows,
                                                                               starts, zeros)
