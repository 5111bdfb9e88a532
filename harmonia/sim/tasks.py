"""Turn per-rank compute orders into replayable tasks with dependencies and communication.

A compute key is ``(module, replica, chunk, kind, microbatch)``, with ``kind`` in F, B, W, BW and
``microbatch = (llm_replica, index)``. Every rank of a stage's TP x CP group runs the same keys. The
dependencies are the pipeline's data flow:

- F of chunk c waits for F of chunk c-1 (P2P delay of the activations); F of the LLM's first
  chunk waits for the last encoder chunk of every encoder replica feeding the microbatch (boundary
  delay of its rows).
- B of chunk c waits for B (or BW) of chunk c+1, for the LLM's last chunk on its own F; an
  encoder's last chunk waits for the LLM's first-chunk B (boundary gradients). W waits for its B,
  or, on a stage with no B (a trainable projector behind a frozen encoder), for the gradient itself.
- After a rank's last W (or BW) of a trainable stage, the DP gradient reduction runs on its
  communication stream: a ring all-reduce, ``2 (dp-1)/dp * bytes / bandwidth``.

TP adds two all-reduces of the activations per block forward and two per backward, CP an
all-gather of K and V per block; both are added to the compute duration (they are synchronous). A
recomputed module's backward (B or BW) runs its blocks' forward again, collectives included: two
more all-reduces and one more K/V all-gather per block.
FSDP gathers a stage's weights over its DP group before the forward and again before the backward
(weights resharded after forward, FSDP2's default); prefetching overlaps the gather with compute,
so only the part longer than the compute adds time.
"""

from __future__ import annotations

from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, StageKey
from harmonia.sim.collectives import (chunk_blocks, cp_kv_gather_s, fsdp_gather_s, grad_reduce_s, p2p_s,
                                      tp_allreduce_s)
from harmonia.sim.engine import Task
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec

ComputeKey = tuple[str, int, int, str, tuple[int, int]]


def collective_extra(plan: Plan, cost: CostModel, iw: IterationWork, key: StageKey, mb, kind: str,
                     cluster: ClusterSpec, cache: dict) -> float:
    """TP all-reduces, CP K/V all-gathers and exposed FSDP gathers inside a stage for one phase
    (`harmonia.sim.collectives`); ``cache`` keeps one FSDP gather price per stage chunk."""
    layout = plan.layouts[key.module]
    tp_collective = layout.tp > 1 and kind != "W"
    cp_collective = layout.cp > 1 and kind in ("F", "B", "BW")
    fsdp_gather = layout.fsdp and layout.dp > 1 and kind in ("F", "B", "BW")
    if not (tp_collective or cp_collective or fsdp_gather):
        return 0.0
    work = iw.work[(key, mb)]
    ranks = iw.stage_ranks[key]
    extra = 0.0
    if tp_collective or cp_collective:
        blocks = chunk_blocks(cost, layout, key.module, key.stage)
        passes = 2 if kind in ("B", "BW") and key.module in plan.recompute else 1  # recompute: forward again
        extra += passes * tp_allreduce_s(cost, cluster, layout, key.module, blocks, work.tokens, ranks[: layout.tp])
        extra += passes * cp_kv_gather_s(cost, cluster, layout, key.module, blocks, work.tokens, ranks[:: layout.tp])
    if fsdp_gather:
        # every replica's stage gathers over a DP group of the same shape: one price per stage chunk
        if (key.module, key.stage) not in cache:
            cache[(key.module, key.stage)] = fsdp_gather_s(cost, cluster, plan, key.module, key.stage, key.replica)
        gather = cache[(key.module, key.stage)]
        compute = {"F": work.times.F, "B": work.times.B, "BW": work.times.B + work.times.W}[kind]
        extra += max(0.0, gather - compute)
    return extra


def build_tasks(plan: Plan, cost: CostModel, iw: IterationWork, orders: dict[int, list[ComputeKey]],
                cluster: ClusterSpec) -> tuple[list[Task], dict[int, list[int]], dict[int, list[int]]]:
    """Tasks, per-rank compute queues and per-rank communication queues for `harmonia.sim.engine.replay`."""
    tasks: list[Task] = []
    index: dict[tuple[ComputeKey, int], int] = {}
    queue: dict[int, list[int]] = {r: [] for r in orders}
    gathers: dict[tuple[str, int], float] = {}
    has_w = {(k[0], k[1], k[2], k[4]) for keys in orders.values() for k in keys if k[3] == "W"}
    has_b = {(k[0], k[1], k[2], k[4]) for keys in orders.values() for k in keys if k[3] in ("B", "BW")}
    for rank, keys in orders.items():
        for ck in keys:
            module, replica, chunk, kind, mb = ck
            skey = StageKey(module, replica, chunk)
            work = iw.work[(skey, mb)]
            t = work.times
            # a stage without a B action (nothing trainable upstream) still backpropagates through
            # its own interior for its weight gradients: that work runs inside its W
            w_only = kind == "W" and (module, replica, chunk, mb) not in has_b
            duration = {"F": t.F, "B": t.B, "W": t.B + t.W if w_only else t.W, "BW": t.B + t.W}[kind]
            duration += collective_extra(plan, cost, iw, skey, mb, kind, cluster, gathers)
            flops_share = {"F": t.F, "B": t.B, "W": t.B + t.W if w_only else t.W,
                           "BW": t.B + t.W}[kind] / max(t.total, 1e-30)
            mem = _activation_delta(kind, work.act_bytes, w_only, (module, replica, chunk, mb) in has_w)
            recomputes = kind in ("B", "BW") or w_only  # the task that runs the blocks' forward again
            index[(ck, rank)] = len(tasks)
            queue[rank].append(len(tasks))
            tasks.append(Task(f"{module}.r{replica}.s{chunk}.{kind}{mb[0]}.{mb[1]}", rank, duration, [],
                              module, kind, mem, work.flops * flops_share,
                              work.transient if recomputes else 0.0))
    for (ck, rank), i in index.items():
        tasks[i].deps = _deps(plan, iw, ck, rank, index, cluster)
    comm = _gradient_reductions(plan, cost, iw, orders, tasks, index, cluster)
    return tasks, queue, comm


def _activation_delta(kind: str, act_bytes: float, w_only: bool, has_w: bool) -> float:
    """Activation bytes a task allocates (+) or frees (-): F keeps them; a split backward frees half
    at B and half at W; a fused BW, or a W that is the stage's whole backward, frees them all."""
    if kind == "F":
        return act_bytes
    if (kind == "B" and has_w) or (kind == "W" and not w_only):
        return -0.5 * act_bytes
    return -act_bytes


def _peer(iw: IterationWork, key: StageKey, position: int) -> int:
    ranks = iw.stage_ranks[key]
    return ranks[position % len(ranks)]


def _find(index, ck: ComputeKey, rank: int) -> int | None:
    return index.get((ck, rank))


def _deps(plan: Plan, iw: IterationWork, ck: ComputeKey, rank: int, index, cluster) -> list[tuple[int, float]]:
    module, replica, chunk, kind, mb = ck
    skey = StageKey(module, replica, chunk)
    pos = iw.stage_ranks[skey].index(rank)
    n_chunks = plan.layouts[module].n_stages
    deps: list[tuple[int, float]] = []

    def need(dep_ck: ComputeKey, dep_rank: int, nbytes: float) -> None:
        i = _find(index, dep_ck, dep_rank)
        if i is None:
            alt = _find(index, (*dep_ck[:3], "BW", dep_ck[4]), dep_rank) if dep_ck[3] == "B" else None
            if alt is None:
                return
            i = alt
        deps.append((i, p2p_s(nbytes, dep_rank, rank, cluster)))

    if kind == "F":
        if chunk > 0:
            prev = StageKey(module, replica, chunk - 1)
            need((module, replica, chunk - 1, "F", mb), _peer(iw, prev, pos), iw.work[(prev, mb)].send_bytes)
        elif module == "llm":
            for enc in plan.encoders:
                last = plan.layouts[enc].n_stages - 1
                for e in iw.encoder_feeds.get((enc, mb[0], mb[1]), []):
                    src = StageKey(enc, e, last)
                    need((enc, e, last, "F", mb), _peer(iw, src, 0), iw.boundary_bytes[(enc, e, mb[0], mb[1])])
    else:
        i = _find(index, (module, replica, chunk, "B", mb), rank) if kind == "W" else None
        if i is not None:  # W after its own B, which already waited for the gradient
            deps.append((i, 0.0))
            return deps
        index_f = _find(index, (module, replica, chunk, "F", mb), rank)
        if index_f is not None:
            deps.append((index_f, 0.0))
        if chunk < n_chunks - 1:
            nxt = StageKey(module, replica, chunk + 1)
            need((module, replica, chunk + 1, "B", mb), _peer(iw, nxt, pos), iw.work[(skey, mb)].send_bytes)
        elif module != "llm":
            llm_key = StageKey("llm", mb[0], 0)
            need(("llm", mb[0], 0, "B", mb), _peer(iw, llm_key, 0),
                 iw.boundary_bytes.get((module, replica, mb[0], mb[1]), 0.0))
    return deps


def _gradient_reductions(plan: Plan, cost: CostModel, iw: IterationWork, orders, tasks: list[Task], index,
                         cluster: ClusterSpec) -> dict[int, list[int]]:
    """One DP gradient all-reduce per trainable stage and rank, after its last weight gradient."""
    comm: dict[int, list[int]] = {r: [] for r in orders}
    seconds_of: dict[tuple, float] = {}  # (module, chunk, cp, tp) -> seconds: one DP group's reduction
    for rank, keys in orders.items():
        last: dict[tuple[str, int, int], int] = {}
        for ck in keys:
            if ck[3] in ("W", "BW"):
                last[(ck[0], ck[1], ck[2])] = index[(ck, rank)]
        for (module, replica, chunk), i in last.items():
            layout = plan.layouts[module]
            if layout.dp <= 1:
                continue
            coords = layout.coords(rank)
            group_key = (module, chunk, coords["cp"], coords["tp"])
            if group_key not in seconds_of:
                seconds_of[group_key] = grad_reduce_s(cost, cluster, plan, module, chunk, coords["cp"], coords["tp"])
            seconds = seconds_of[group_key]
            if seconds <= 0:  # nothing to train on the chunk
                continue
            comm[rank].append(len(tasks))
            tasks.append(Task(f"{module}.r{replica}.s{chunk}.allreduce", rank, seconds, [(i, 0.0)], module, "C"))
    return comm
