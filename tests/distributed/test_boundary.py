"""Boundary transfers between module layouts equal one process, forward and backward (gloo, CPU).

For every layout pair a toy encoder ``y = tanh(inputs @ W)`` runs per sample on the source ranks
(each source TP replica computes the same rows; with source CP each cp rank keeps its rows), the
executor's `BoundaryLink` moves the rows to the destination layout, and each destination rank's loss
``sum(coef * out**2) / 2`` (split over TP ranks in ``partial`` mode) is backpropagated; the link
carries the gradients back. Every destination rank must receive exactly the one-process rows, and
every source rank's row gradients and ``W`` gradient must equal one-process autograd. All pairs of
one world size share one process group.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from harmonia.errors import LayoutError
from harmonia.schedule.layout import Layout
from harmonia.runtime.boundary_link import BoundaryLink
from harmonia.runtime.boundary_plan import plan_boundary
from harmonia.runtime.meshes import build_module_meshes
from tests.distributed._spawn import LAYOUT_TIMEOUT_S, check_timeout, run_workers
from tests.unit.test_boundary_plan import _local_rows

pytestmark = pytest.mark.distributed

D_IN, D = 5, 6
SEEDS = (0, 1)


@dataclass(frozen=True)
class Case:
    """One layout pair: encoder (source) layout -> LLM (destination) layout."""

    name: str
    enc: Layout
    llm: Layout
    cp_random: bool = False
    tp_grads: str = "replicated"
    gpus_per_node: int | None = None  # relay rows inside nodes of this many ranks


def L(**kw) -> Layout:
    return Layout(**kw)


CASES: dict[int, list[Case]] = {
    2: [
        Case("co enc dp2 -> llm tp2", L(dp=2), L(tp=2)),
        Case("co enc tp2 -> llm dp2", L(tp=2), L(dp=2)),
        Case("co enc dp2 -> llm cp2 (random shard)", L(dp=2), L(cp=2), cp_random=True),
        Case("co enc dp2 -> llm dp2 (reshuffled)", L(dp=2), L(dp=2)),
        Case("dis enc dp1 -> llm dp1", L(), L(rank_offset=1)),
    ],
    4: [
        Case("dis enc dp2 -> llm tp2", L(dp=2), L(tp=2, rank_offset=2)),
        Case("dis enc dp2 -> llm tp2 (partial grads)", L(dp=2), L(tp=2, rank_offset=2), tp_grads="partial"),
        Case("dis enc tp2 -> llm dp2", L(tp=2), L(dp=2, rank_offset=2)),
        Case("dis enc dp3 -> llm dp1 (fan-in)", L(dp=3), L(rank_offset=3)),
        Case("co enc dp4 -> llm dp2 tp2", L(dp=4), L(dp=2, tp=2)),
        Case("co enc tp4 -> llm dp4", L(tp=4), L(dp=4)),
        Case("co enc dp4 -> llm dp2 cp2", L(dp=4), L(dp=2, cp=2), cp_random=True),
        Case("co enc pp2 dp2 -> llm pp2 dp2 (source-only ranks)", L(pp=2, dp=2), L(pp=2, dp=2)),
        Case("dis enc dp1 -> llm tp2, relay in nodes of 2", L(), L(tp=2, rank_offset=2), gpus_per_node=2),
        Case("dis enc dp2 -> llm tp2 (partial), relay in nodes of 2", L(dp=2), L(tp=2, rank_offset=2),
             tp_grads="partial", gpus_per_node=2),
        Case("co enc dp4 -> llm tp4, relay in nodes of 2", L(dp=4), L(tp=4), gpus_per_node=2),
        Case("co enc dp4 -> llm tp4 (partial), relay in nodes of 2", L(dp=4), L(tp=4), tp_grads="partial",
             gpus_per_node=2),
        Case("co enc tp2 dp2 -> llm tp4 cp1, relay in nodes of 2", L(tp=2, dp=2), L(tp=4), cp_random=True,
             gpus_per_node=2),
        Case("dis enc dp1 -> llm tp3 (partial), relay in nodes of 2", L(), L(tp=3, rank_offset=1),
             tp_grads="partial", gpus_per_node=2),
    ],
    8: [
        Case("dis enc dp4 -> llm dp2 tp2", L(dp=4), L(dp=2, tp=2, rank_offset=4)),
        Case("dis enc dp2 tp2 -> llm cp2 tp2", L(dp=2, tp=2), L(cp=2, tp=2, rank_offset=4), cp_random=True),
        Case("dis enc dp1 -> llm dp7 (fan-out)", L(), L(dp=7, rank_offset=1)),
        Case("co enc dp8 -> llm dp2 cp2 tp2", L(dp=8), L(dp=2, cp=2, tp=2), cp_random=True),
        Case("co enc dp2 tp4 -> llm dp4 tp2", L(dp=2, tp=4), L(dp=4, tp=2)),
        Case("co enc dp4 cp2 -> llm pp2 dp4", L(dp=4, cp=2), L(pp=2, dp=4), cp_random=True),
        Case("co enc dp4 -> llm dp2 cp2 tp2 (strided ranks)", L(dp=4),
             L(dp=2, cp=2, tp=2, ranks=(0, 4, 1, 5, 2, 6, 3, 7)), cp_random=True),
        Case("dis enc dp2 (ranks 6, 7) -> llm dp3 tp2 (ranks 0-5)", L(dp=2, rank_offset=6),
             L(dp=3, tp=2)),
    ],
}


def _split(n: int, parts: int, rng: random.Random) -> list[list[int]]:
    order = list(range(n))
    rng.shuffle(order)
    cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]


def _run_case(rank: int, case: Case, seed: int, meshes) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 10)
    items = [[rng.choice([0, 1, 4, 9]) for _ in range(rng.randint(0, 3))] for _ in range(n)]
    rows = [sum(i) for i in items]
    starts = [sum(rows[:s]) for s in range(n)]
    src_samples, dst_samples = _split(n, case.enc.dp, rng), _split(n, case.llm.dp, rng)

    def assign(layout: Layout, samples):
        if not case.cp_random:
            return None
        return [[rng.randrange(layout.cp) for _ in range(sum(rows[s] for s in rep))] for rep in samples]

    src_assign, dst_assign = assign(case.enc, src_samples), assign(case.llm, dst_samples)
    plan = plan_boundary(case.enc, case.llm, items, src_samples, dst_samples, dst_assign, src_assign,
                         case.tp_grads, case.gpus_per_node)
    assert case.gpus_per_node is None or plan.relays or sum(rows) == 0, case.name
    src_ref = _local_rows(case.enc, case.enc.pp - 1, src_samples, rows, starts, src_assign)
    dst_ref = _local_rows(case.llm, 0, dst_samples, rows, starts, dst_assign)

    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(D_IN, D, generator=gen)
    inputs = [torch.randn(rows[s], D_IN, generator=gen) for s in range(n)]
    coef = torch.rand(sum(rows), D, generator=gen) + 0.5

    # One process: the same per-sample encoder, every row, one loss.
    w_ref = w0.clone().requires_grad_()
    y_ref = torch.cat([torch.tanh(inputs[s] @ w_ref) for s in range(n)])  # (total_rows, D)
    y_ref.retain_grad()
    (coef * y_ref**2).sum().div(2).backward()

    if rank not in plan.ranks:
        return
    x, w = None, None
    if rank in src_ref:  # encoder on this rank: its replica's samples, then its cp rows
        replica = src_samples[case.enc.coords(rank)["dp"]]
        w = w0.clone().requires_grad_()
        full = torch.cat([torch.tanh(inputs[s] @ w) for s in replica] or [torch.zeros(0, D_IN) @ w])
        position = {g: i for i, g in enumerate(r for s in replica for r in range(starts[s], starts[s] + rows[s]))}
        x = full[[position[g] for g in src_ref[rank]]]  # (src_rows, D)
    link = BoundaryLink.lone([plan], rank, meshes.boundary_group("enc"), D, backward=True)
    if x is not None:
        link.send(0, x)
    if rank in dst_ref:
        out = link.take(0).requires_grad_()
        idx = torch.tensor(dst_ref[rank], dtype=torch.long)
        assert torch.equal(out, y_ref.detach()[idx]), f"{case.name} seed {seed}: rank {rank} forward rows differ"
        share = 1.0
        if case.tp_grads == "partial":  # TP ranks each hold a part of the gradient
            t = case.llm.coords(rank)["tp"]
            share = (t + 1) / sum(range(1, case.llm.tp + 1))
        (coef[idx] * out**2).sum().div(2).mul(share).backward()
        link.send(0, out.grad, backward=True)
    if x is not None:
        dx = link.take(0, backward=True)  # (src_rows, D)
        want = y_ref.grad[src_ref[rank]]
        torch.testing.assert_close(dx, want, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{case.name} seed {seed}: rank {rank} row grads: {m}")
        x.backward(dx)
        ref_w = w0.clone().requires_grad_()  # one-process W gradient through this rank's rows only
        y_all = torch.cat([torch.tanh(inputs[s] @ ref_w) for s in range(n)])  # (total_rows, D)
        (y_all[src_ref[rank]] * want).sum().backward()
        torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{case.name} seed {seed}: rank {rank} W grad: {m}")
    link.finish()


def _check_meshes(rank: int, case: Case, meshes) -> None:
    for name, layout in (("enc", case.enc), ("llm", case.llm)):
        if meshes.runs(name):
            for axis in ("pp", "dp", "cp", "tp"):
                mine = next(g for g in layout.group_ranks(axis) if rank in g)
                got = dist.get_process_group_ranks(meshes.group_of(name, axis))
                assert tuple(got) == mine, f"{case.name}: {name} {axis} group {got}, expected {mine}"
            assert meshes.meshes[name].get_coordinate() == tuple(layout.coords(rank).values())


def _worker(rank: int, world: int, cases: list[Case]) -> list[str]:
    with pytest.raises(LayoutError, match="increasing"):  # torch orders group ranks increasingly
        build_module_meshes({"llm": Layout(tp=2, ranks=(1, 0))})
    done = []
    for case in cases:
        with check_timeout(LAYOUT_TIMEOUT_S, case.name):
            meshes = build_module_meshes({"enc": case.enc, "llm": case.llm})
            _check_meshes(rank, case, meshes)
            for seed in SEEDS:
                _run_case(rank, case, seed, meshes)
            dist.barrier()
        done.append(case.name)
    return done


@pytest.mark.parametrize("world", sorted(CASES))
def test_boundary_matches_one_process(world: int) -> None:
    results = run_workers(_worker, world, (CASES[world],), timeout=900)
    assert all(r == [c.name for c in CASES[world]] for r in results)
