"""Communication-aware bounds on a plan's iteration time, computed without simulating.

The planner ranks and prunes candidates with these numbers before it spends a simulation on
them, so they must count what the simulator counts: compute, the collectives inside a stage, FSDP
weight gathers and the DP gradient reduction, each priced by the simulator's own functions
(`harmonia.sim.collectives`). A compute-only
bound ranks a communication-heavy layout (low TP on a 72B LLM, say) as good as any, although its
gathers and reductions cost more than its compute.

Derivation of `plan_bound`, per module stage chunk ``c`` on one rank of an average DP replica
(the slowest replica is never faster than the average one), with ``T``, ``P`` the batch's tokens
and attended pairs of the module divided by its ``dp``, ``n`` the microbatches of an LLM replica,
``L`` the blocks of the chunk and ``h`` its width:

- compute ``F, B, W``: the cost model's roofline of the replica's whole load; the simulator sums the
  roofline per microbatch, and ``sum_i max(a_i, b_i) >= max(sum a_i, sum b_i)``;
- TP: two ring all-reduces of ``tokens/cp * h`` activations per block in the forward and two in
  the backward (B or BW, not W). A ring is affine in its bytes, ``2 (t-1)/t * bytes / bw +
  2 (t-1) * latency``, so the microbatches of a replica sum to ``4 L (2 (t-1)/t * T/cp * h * a / bw
  + n * 2 (t-1) * latency)`` (the latency term for the LLM, whose ``n`` is known);
- CP: an all-gather of K and V per block in F and in the backward, ``L (c-1)/c * 2 T kv a / t / bw``;
- recompute (a module in ``plan.recompute``): the backward runs the blocks' forward again, its
  compute (the cost model's ``B + F_blocks``) and its TP and CP collectives (a third phase of each);
- FSDP: the rank gathers the chunk's weights, ``g = (dp-1)/dp * weights / tp / bw``, once per step
  on its communication stream, beside its first forward (harmonia's runtime), which adds nothing
  sure to the compute stream (it slows some compute by an amount the bound does not know);
  resharding per microbatch, before
  every forward and backward of a microbatch, hidden behind that phase's compute ``c``, which runs
  ``1 + s`` times slower beside it (`DeviceSpec.overlap_slowdown`), so the phase adds
  ``max(g - c, g s / (1 + s))`` (a backward ``g + r`` with its reduce-scatter ``r``:
  `harmonia.sim.tasks.overlapped_extra`); a maximum of affine terms is convex, so over ``n``
  microbatches that adds at least ``max(n g - C, n g s / (1 + s))``, ``C`` their total compute
  (for a backward ``n (g + r)`` against ``B + W``, which a split one's B alone never beats);
- DP gradient reduction ``R_c``: a ring all-reduce of the chunk's trainable gradients over its DP
  group (an FSDP chunk's reduce-scatter), started after the chunk's last weight gradient. Every F,
  B and W of the chunk precedes its last W on the rank's one compute stream, so the reduction ends
  after ``busy_c + R_c``; an LLM FSDP chunk reducing inside its last fused backward runs only its
  least exposed part past that backward (`reduce_exposed_s`), which stands for ``R_c`` here (the
  parts it overlaps total at most ``R_c`` minus that, on the same stream). The
  reductions of one rank share its communication stream, so they end after
  ``min_c busy_c + sum_c R_c``.

A rank's compute stream runs everything placed on it (colocated encoders add their share), so
``lower_s = max over ranks of max(busy, max_c (busy_c + R_c), min_c busy_c + sum_c R_c)``: no
schedule, balancing or order beats it, and a candidate whose bound exceeds the best simulated
time can be skipped.

`work_bound` is the second, sharper level, for one batch once its microbatches are known (the
balancer's assignment and the stage work of `harmonia.schedule.stagework`, both cheap next to a
simulation): the simulator runs every piece of stage work on its rank's one compute stream, each
lasting its compute plus its in-stage collectives, so the iteration
lasts at least the largest sum of those durations on one rank. This sees what averages hide: an
encoder replica fed more items than its peers, LLM replicas the balancer could not even out. It also
counts every LLM pipeline rank's fill and drain (`_pipeline_bound`), interleaved chunks included:
the rank's first LLM task is a forward of its lowest chunk that waits for some microbatch's chain of
forwards through the encoders and the earlier chunks, and, unless that chunk's backward is split
into B and W, its last is that chunk's backward, whose gradient still runs down the earlier chunks
and the encoders; its own tasks run one after another in between. Each link of a chain lasts its
whole task, exposed FSDP gathers and TP/CP collectives included.

``estimate_s`` adds what a schedule cannot avoid but the bound cannot prove without the batch's
microbatches: the pipeline fill and drain, about ``(pp - 1) / n`` of a stage's forward and
backward under 1F1B (the backward only under zero-bubble, whose W fill the bubbles), and for
disjoint encoders the wait of the LLM for the first microbatch's encoder forward and of the
encoders for its last backward. It orders candidates; it prunes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harmonia.plan.profiling import BatchProfile
from harmonia.schedule import StageGraph
from harmonia.schedule.actions import Kind, StageRef
from harmonia.schedule.layout import Placement
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, StageKey, plan_graph, stage_layer_range
from harmonia.sim.collectives import (backward_reduce_s, chunk_blocks, cp_kv_gather_s, fsdp_gather_s, grad_reduce_s,
                                      reduce_exposed_s, reduces_in_backward, stage_group, step_gathers,
                                      tp_allreduce_s)
from harmonia.sim.tasks import NO_SPLIT, collective_extra, compute_seconds, overlapped_extra, split_extra
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec
from harmonia.workload.work import ModuleLoad


@dataclass(frozen=True)
class ChunkBound:
    """One stage chunk on one rank of an average replica.

    Attributes:
        compute: F + B + W seconds of the cost model's roofline.
        comm: seconds the chunk's TP/CP collectives and exposed FSDP gathers add to its compute.
        reduce: seconds of its DP gradient all-reduce.
        forward: its forward seconds, exposed gathers included.
        weight: its W seconds when its backward can be split into B and W (zero-bubble fills with W).
    """

    compute: float
    comm: float
    reduce: float
    forward: float
    weight: float

    @property
    def busy(self) -> float:
        return self.compute + self.comm


@dataclass(frozen=True)
class PlanBound:
    """Bounds of one plan on one profiled batch mix.

    Attributes:
        lower_s: seconds no schedule beats (see module docstring).
        estimate_s: ``lower_s`` plus pipeline fill/drain and encoder waits; orders candidates.
        compute_s: the busiest rank's compute alone (the compute-only bound).
        comm_s: seconds communication adds on that rank (TP/CP, FSDP, DP reduction).
    """

    lower_s: float
    estimate_s: float
    compute_s: float
    comm_s: float


def _mean_loads(profile: BatchProfile, batches: list[int] | None) -> dict[str, ModuleLoad]:
    rows = slice(None) if batches is None else batches
    tokens = profile.batch_tokens[rows].mean(axis=0)
    pairs = profile.batch_pairs[rows].mean(axis=0)
    return {m: ModuleLoad(int(tokens[j]), int(pairs[j]), 1) for j, m in enumerate(profile.modules)}


def _scale(load: ModuleLoad, parts: int) -> ModuleLoad:
    return ModuleLoad(load.tokens // parts, load.pairs // parts, 1)


def _stage_ranks(plan: Plan, module: str, pp_rank: int) -> np.ndarray:
    """Global ranks holding pipeline rank ``pp_rank`` of a module (grid order puts pp outermost)."""
    layout = plan.layouts[module]
    per = layout.dp * layout.cp * layout.tp
    return np.asarray(layout.rank_list()[pp_rank * per:(pp_rank + 1) * per])


def _chunk_bound(plan: Plan, cost: CostModel, cluster: ClusterSpec, graph: StageGraph, module: str, chunk: int,
                 load: ModuleLoad, proj_load: ModuleLoad) -> ChunkBound:
    layout = plan.layouts[module]
    tp, cp = layout.tp, layout.cp
    start, stop = stage_layer_range(cost, plan, module, chunk)
    recompute = plan.recompute_share(module)
    times = cost.stage_times(module, load, start, stop, tp, cp, recompute)
    last = chunk == layout.n_stages - 1
    if last and module != "llm":
        times = times + cost.stage_times(f"{module}_proj", proj_load, cp=cp)  # whole on every TP rank
    ref = StageRef(module, chunk)
    has_b, has_w = graph.needs_b(ref), graph.needs_w(ref)
    backward = times.B + times.W if (has_b or has_w) else 0.0
    n_mb = plan.n_microbatches if module == "llm" else 0
    blocks = chunk_blocks(cost, layout, module, chunk)
    # F, and B or BW (a W-only backward has no collectives), whose recompute runs the recomputed
    # blocks' share of F's collectives again
    phases = 1 + ((1 + recompute) if has_b else 0)
    comm = phases * tp_allreduce_s(cost, cluster, layout, module, blocks, load.tokens,
                                   stage_group(layout, chunk, "tp"), calls=n_mb)
    comm += phases * cp_kv_gather_s(cost, cluster, layout, module, blocks, load.tokens, stage_group(layout, chunk, "cp"))
    forward = times.F
    gather = fsdp_gather_s(cost, cluster, plan, module, chunk)  # zero without FSDP
    if gather and n_mb and cost.reshards(layout):
        slowdown = cluster.device.overlap_slowdown
        exposed = overlapped_extra(n_mb * gather, times.F, slowdown)
        comm += exposed
        if has_b:
            comm += overlapped_extra(n_mb * (gather + backward_reduce_s(cost, cluster, plan, module, chunk)), backward,
                                     slowdown)
        forward = times.F + exposed
    kinds = graph.backward_kinds(ref, plan.schedule == "zb")
    reduce = _reduce_past_backward(plan, cost, cluster, module, chunk, kinds) if has_w else 0.0
    return ChunkBound(times.F + backward, comm, reduce, forward, times.W if has_b and has_w else 0.0)


def _reduce_past_backward(plan: Plan, cost: CostModel, cluster: ClusterSpec, module: str, chunk: int,
                          kinds: tuple[Kind, ...]) -> float:
    """Seconds no less than a chunk's DP gradient reduction runs past its last backward: all of it
    (`grad_reduce_s`), or, where a fused last backward reduces as it goes, its least exposed part
    (`reduce_exposed_s`)."""
    if kinds == (Kind.BW,) and reduces_in_backward(cost, plan, module):
        return reduce_exposed_s(cost, cluster, plan, module, chunk)
    return grad_reduce_s(cost, cluster, plan, module, chunk)


def plan_bound(plan: Plan, cost: CostModel, cluster: ClusterSpec, profile: BatchProfile,
               batches: list[int] | None = None) -> PlanBound:
    """Lower bound and estimate of a plan's iteration seconds on the profiled ``batches``."""
    loads = _mean_loads(profile, batches)
    graph = plan_graph(plan, cost)
    world = cluster.world_size
    busy = np.zeros(world)
    compute = np.zeros(world)
    chunk_busy: list[tuple[np.ndarray, float, float]] = []  # (ranks, busy_c, reduce_c)
    fill = np.zeros(world)
    chunks: dict[str, list[ChunkBound]] = {}
    for module, layout in plan.layouts.items():
        load = _scale(loads[module], layout.dp)
        proj = _scale(loads.get(f"{module}_proj", ModuleLoad()), layout.dp)
        chunks[module] = []
        for chunk in range(layout.n_stages):
            cb = _chunk_bound(plan, cost, cluster, graph, module, chunk, load, proj)
            ranks = _stage_ranks(plan, module, chunk % layout.pp)
            busy[ranks] += cb.busy
            compute[ranks] += cb.compute
            chunk_busy.append((ranks, cb.busy, cb.reduce))
            chunks[module].append(cb)
    lower = busy.copy()
    first_busy = np.full(world, np.inf)
    reduce_sum = np.zeros(world)
    for ranks, b, r in chunk_busy:
        lower[ranks] = np.maximum(lower[ranks], b + r)
        if r > 0:
            first_busy[ranks] = np.minimum(first_busy[ranks], b)
            reduce_sum[ranks] += r
    has_reduce = reduce_sum > 0
    lower[has_reduce] = np.maximum(lower[has_reduce], first_busy[has_reduce] + reduce_sum[has_reduce])
    worst = int(np.argmax(lower))
    fill[:] = _fill_s(plan, chunks)
    estimate = float(np.max(lower + fill))
    return PlanBound(float(lower[worst]), max(estimate, float(lower[worst])), float(compute[worst]),
                     float(lower[worst] - compute[worst]))


def _fill_s(plan: Plan, chunks: dict[str, list[ChunkBound]]) -> float:
    """Pipeline fill and drain the schedule cannot avoid, and the waits across a disjoint boundary."""
    n_mb = plan.n_microbatches
    llm = chunks["llm"]
    stage = max(c.busy for c in llm)
    per_mb = stage / n_mb
    if plan.schedule == "zb":
        split = max(llm, key=lambda c: c.busy)
        per_mb = max(0.0, split.busy - 2 * split.weight) / n_mb
    out = (plan.layouts["llm"].pp - 1) * per_mb
    if plan.placement is Placement.DISJOINT:
        for enc in plan.encoders:
            # an encoder rank encodes n_mb microbatches (each for every LLM replica it feeds); the LLM
            # waits for the first one's forward, the encoder for the last one's gradient
            out += sum(c.busy for c in chunks[enc]) / n_mb
    return out


def work_bound(plan: Plan, cost: CostModel, cluster: ClusterSpec, iw: IterationWork) -> float:
    """Seconds no schedule of this iteration's stage work beats (see the module docstring): the
    busiest rank, each task timed exactly as `harmonia.sim.tasks.build_tasks` times it, and every
    LLM pipeline rank's fill and drain (`_pipeline_bound`)."""
    return work_bound_busy(plan, cost, cluster, iw)[0]


def work_bound_busy(plan: Plan, cost: CostModel, cluster: ClusterSpec,
                    iw: IterationWork) -> tuple[float, dict[int, float]]:
    """`work_bound`, and every rank's busy seconds (the sum of its tasks) it is taken from."""
    graph = plan_graph(plan, cost)
    split = plan.schedule == "zb"
    kinds = {ref: graph.backward_kinds(ref, split) for ref in graph.stages()}
    backwards = {(ref.module, ref.stage): [(k.value, k.value == "W" and len(ks) == 1) for k in ks]
                 for ref, ks in kinds.items()}  # (phase, W-only stage's W: it backpropagates too)
    gathers: dict = {}
    splits = {(ref.module, ref.stage): split_extra(cost, plan, ref.module, ref.stage, gathers) if len(ks) == 2
              else NO_SPLIT for ref, ks in kinds.items()}  # what a split backward adds to its B and W
    per_key: dict[StageKey, float] = {}  # a replica's stage chunk -> the seconds of all its tasks
    tasks: dict = {}  # (LLM stage key, microbatch, sub) -> {phase: seconds of its task}
    for (key, m, sub), work in iw.work.items():
        seconds = work.times.F + collective_extra(plan, cost, key, work, "F", cluster, gathers)
        phases = {"F": seconds}
        for kind, w_only in backwards[(key.module, key.stage)]:
            phase = compute_seconds(work, kind, w_only, splits[(key.module, key.stage)])
            if kind != "W":  # a W runs no collective
                phase += collective_extra(plan, cost, key, work, kind, cluster, gathers)
            phases[kind] = phase
            seconds += phase
        if key.module == "llm":  # the pipeline bound's tasks
            tasks[(key, m, sub)] = phases
        per_key[key] = per_key.get(key, 0.0) + seconds
    busy: dict[int, float] = {}
    for key, seconds in per_key.items():
        for rank in iw.stage_ranks[key]:
            busy[rank] = busy.get(rank, 0.0) + seconds
    reduce = [_reduce_past_backward(plan, cost, cluster, "llm", c, kinds[StageRef("llm", c)])
              if graph.needs_w(StageRef("llm", c)) else 0.0 for c in range(plan.layouts["llm"].n_stages)]
    llm_gathers = {(rank, c): seconds for rank, found in step_gathers(cost, cluster, plan).items()
                   for module, c, seconds in found if module == "llm"}
    pipeline = _pipeline_bound(plan, iw, kinds, tasks, per_key, reduce, llm_gathers, cluster.device.overlap_slowdown)
    return max(max(busy.values(), default=0.0), pipeline), busy


def _encoder_chains(plan: Plan, iw: IterationWork, kinds: dict, feeders: dict, d: int, m: int) -> tuple[float, float]:
    """The shortest forward chain through the encoders that LLM replica ``d``'s microbatch ``m`` waits
    for (the slowest encoder replica with rows for it, ``feeders[(encoder, d, m)]``: every
    sub-microbatch runs its chunks in turn, and the rows leave once the last one has), and the
    backward chain its gradient still runs there."""
    head = tail = 0.0
    for enc in plan.encoders:
        layout = plan.layouts[enc]
        trains_all = all(kinds[StageRef(enc, c)] for c in range(layout.n_stages))
        for e in feeders.get((enc, d, m), ()):
            for sub in iw.subs(enc, m):
                works = [w for c in range(layout.n_stages) if (w := iw.unit(StageKey(enc, e, c), m, sub)) is not None]
                head = max(head, sum(w.times.F for w in works))
                if works and trains_all:
                    # one chunk: its B then W (or fused BW) follow the LLM's gradient; over several
                    # chunks only the input gradients are sure to form a chain
                    tail = max(tail, sum(w.times.B + (w.times.W if layout.n_stages == 1 else 0.0) for w in works))
    return head, tail


def _pipeline_bound(plan: Plan, iw: IterationWork, kinds: dict, tasks: dict, per_key: dict[StageKey, float],
                    reduce: list[float], gathers: dict[tuple[int, int], float], slowdown: float) -> float:
    """Fill and drain of every LLM pipeline rank ``p`` of every replica, from the iteration's microbatches.

    The rank holds chunks ``p, p + pp, ...`` (one unless interleaved). Its first LLM task is a
    forward of chunk ``p`` (a later chunk of a microbatch needs the microbatch's chunk ``p`` first,
    on this rank), which waits for that microbatch's forward through the encoders (the slowest
    encoder replica holding its rows) and chunks ``0 .. p-1``, on other ranks, and, with FSDP, ends
    after the chunk's gather ``G`` (``gathers``, per rank and chunk), which it computes beside for at
    most its own seconds slowed, ``(1 + s) F``. It ends, unless chunk
    ``p``'s backward is split into B and W (its last task may then be a W nothing waits for), with
    chunk ``p``'s input gradient for some microbatch, which still needs the gradients of chunks
    ``p-1 .. 0`` and the encoders' backward. Its own LLM tasks run one after another in between,
    so the iteration lasts at least ``max(G - (1 + s) max_m F_m, min_m head(m)) + rank's LLM work +
    max(min_m tail(m), R_p)``,
    ``R_p`` the DP gradient reduction of chunk ``p`` past its last backward (``reduce``); with a split
    backward the last task is some chunk's W (where every chunk with a backward has weight
    gradients), whose reduction follows it: ``+ min_c R_c``. Each link
    of a chain lasts its task (compute and the collectives inside it, as ``tasks`` times it); the
    transfers between them are not counted, so it stays a lower bound.
    """
    llm = plan.layouts["llm"]
    out = 0.0
    ms = range(iw.n_microbatches)
    feeders: dict[tuple[str, int, int], list[int]] = {}  # (encoder, LLM replica, microbatch) -> its encoder replicas
    for enc, e, d, m in sorted(iw.boundary_bytes):
        feeders.setdefault((enc, d, m), []).append(e)
    for d in sorted({key.replica for key in per_key if key.module == "llm"}):  # those priced: all, or some
        chains = [_encoder_chains(plan, iw, kinds, feeders, d, m) for m in ms]
        head = [f for f, _ in chains]
        grads: list[list[float | None]] = [[] for _ in ms]  # per microbatch, chunk c's input-gradient task
        for s in range(llm.pp):
            key = StageKey("llm", d, s)
            own = sum(per_key[StageKey("llm", d, c)] for c in range(s, llm.n_stages, llm.pp))
            stage_kinds = [k.value for k in kinds[StageRef("llm", s)]]
            drains = bool(stage_kinds) and stage_kinds[0] in ("B", "BW") and len(stage_kinds) == 1
            if drains:
                after = min(_drain_s(grads[m], reduce, s, chains[m][1]) for m in ms)
            else:  # the last task is a W where every chunk with a backward has weight gradients
                backs = [c for c in range(s, llm.n_stages, llm.pp) if kinds[StageRef("llm", c)]]
                after = min((reduce[c] for c in backs), default=0.0)
            gather = max((gathers.get((r, s), 0.0) for r in iw.stage_ranks.get(key, ())), default=0.0)
            if gather:
                gather -= (1 + slowdown) * max(tasks[(key, m, None)]["F"] for m in ms)
            out = max(out, max(gather, min(head)) + own + after)
            for m in ms:
                phases = tasks[(key, m, None)]
                head[m] += phases["F"]
                grads[m].append(phases[stage_kinds[0]] if stage_kinds and stage_kinds[0] in ("B", "BW") else None)
    return out


def _drain_s(grads: list[float | None], reduce: list[float], s: int, encoders: float) -> float:
    """What must still run after chunk ``s``'s input gradient of a microbatch: its own DP reduction,
    and down the chain of input gradients ``s-1 .. 0`` (``grads``, None where a chunk has none and
    the chain stops) each chunk's reduction after its gradient, and the encoders' backward."""
    out, chain = reduce[s], 0.0
    for c in range(s - 1, -1, -1):
        if grads[c] is None:
            return out
        chain += grads[c]
        out = max(out, chain + reduce[c])
    return max(out, chain + encoders)
