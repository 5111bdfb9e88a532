"""Candidate layouts for the planner: factorisations, rank-set sizes, memory filter, lower bounds.

For an LLM on ``n`` ranks every ``(tp, cp, pp, dp)`` with product ``n`` is a candidate when ``tp``
divides the heads and KV heads and fits in a node, ``pp`` does not exceed the blocks (and leaves the
first stage the blocks DeepStack adds features after), and ``cp``
divides nothing it must not (sequence shards are token-balanced by the balancer). Encoders are
small: ``pp = 1`` and ``cp = 1``, ``tp`` within the node. Disjoint placement sizes each encoder's
rank set by its share of the profiled work (rounded, then +-1 step), the rest goes to the LLM.

The memory filter uses the cost model's accounting (optimizer states sharded by FSDP over ``dp``,
weights and gradients whole through the step as harmonia's runtime keeps them, activations
of the microbatches in flight under 1F1B: ``min(pp - stage, n_microbatches)`` on stage ``stage``).
The lower bound of a candidate is the slowest module's work per rank, divided by its ranks, which
no schedule beats; candidates whose bound exceeds the best simulated time are pruned unsimulated.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from harmonia.errors import LayoutError
from harmonia.model.spec import MLLMSpec, TransformerSpec
from harmonia.plan.partition import plan_module_stages
from harmonia.plan.profiling import BatchProfile
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import layout_layer_range
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec
from harmonia.workload.work import ModuleLoad


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` in increasing order (pairs up to its square root: a cluster of 32,768
    devices is factored for every smaller size when the planner looks for the largest that works)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(low + [n // d for d in reversed(low) if d * d != n])


def tp_options(body: TransformerSpec, cluster: ClusterSpec, limit: int) -> list[int]:
    """TP degrees that divide the query and KV heads and fit in a node."""
    return [t for t in _divisors(min(limit, cluster.gpus_per_node))
            if body.n_heads % t == 0 and body.kv_heads % t == 0 and t <= limit]


def heads_split(body: TransformerSpec, tp: int) -> int:
    """The largest divisor of ``tp`` that divides the module's query and KV heads: the TP degree a
    module can run inside a group of ``tp`` ranks (its other ranks then hold more replicas)."""
    return max(t for t in _divisors(tp) if body.n_heads % t == 0 and body.kv_heads % t == 0)


def llm_layouts(cost: CostModel, cluster: ClusterSpec, n_ranks: int, rank_offset: int, global_batch: int,
                n_microbatches: int | None = None, max_cp: int = 4) -> Iterator[Layout]:
    """Every valid LLM factorisation of ``n_ranks`` ranks starting at ``rank_offset``.

    With ``n_microbatches`` given, layouts whose pipeline it cannot fill (``pp > n``) or whose
    replicas it cannot feed (``dp * n > global_batch``) are skipped; without it, only ``dp`` is
    bounded by the global batch.
    """
    n_mb = n_microbatches or 1
    body = cost.mllm.llm.body
    for tp in tp_options(body, cluster, n_ranks):
        for cp in _divisors(n_ranks // tp):
            if cp > max_cp:
                continue
            for pp in _divisors(n_ranks // (tp * cp)):
                dp = n_ranks // (tp * cp * pp)
                if pp > body.n_layers or global_batch < dp * max(n_mb, pp if n_microbatches is None else 1):
                    continue
                if body.n_layers // pp < cost.mllm.llm.deepstack:  # DeepStack's blocks on the first stage
                    continue
                if n_microbatches is not None and n_microbatches < pp:
                    continue
                yield Layout(tp=tp, cp=cp, dp=dp, pp=pp, rank_offset=rank_offset, fsdp=cost.fsdp_pays("llm", dp))


def encoder_layouts(mllm: MLLMSpec, encoder: str, cluster: ClusterSpec, n_ranks: int,
                    rank_offset: int) -> Iterator[Layout]:
    """Encoder factorisations: ``tp x dp = n_ranks`` (encoders are not pipelined or CP-sharded)."""
    body = mllm.encoders[encoder].body
    for tp in tp_options(body, cluster, n_ranks):
        yield Layout(tp=tp, dp=n_ranks // tp, rank_offset=rank_offset)


def disjoint_sizes(profile: BatchProfile, encoders: list[str], world: int, step: int = 1) -> Iterator[dict[str, int]]:
    """Rank counts per encoder near their work share: rounded, one ``step`` either side, and
    variants that leave the LLM a multiple of 8, 4 or 2 ranks (so it can factorise into TP and PP)
    with the remainder shared among encoders by their work."""
    if not encoders:  # an LLM alone takes every rank
        yield {}
        return
    costs = profile.mean_costs()
    total = sum(costs[m] for m in profile.modules)
    work = {e: costs[e] + costs.get(f"{e}_proj", 0.0) for e in encoders}
    shares = {e: max(1, round(world * work[e] / total)) for e in encoders}
    variants = [{e: max(1, s + delta) for e, s in shares.items()} for delta in (0, -step, step)]
    for multiple in (8, 4, 2):
        llm = (world - sum(shares.values())) // multiple * multiple
        spare = world - llm
        if llm < 1 or spare < len(encoders):
            continue
        weight = sum(work.values()) or 1.0
        sizes = {e: max(1, int(spare * work[e] / weight)) for e in encoders}
        heaviest = max(encoders, key=lambda e: work[e])
        sizes[heaviest] += spare - sum(sizes.values())
        if sizes[heaviest] >= 1:
            variants.append(sizes)
    seen = set()
    for sizes in variants:
        key = tuple(sizes.values())
        if key in seen or sum(sizes.values()) >= world:
            continue
        seen.add(key)
        yield sizes


@dataclass(frozen=True)
class MemoryCheck:
    """Peak bytes per rank of a module's layout, and whether it fits."""

    peak_bytes: float
    capacity: float

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity


def check_memory(cost: CostModel, module: str, layout: Layout, microbatch_load: ModuleLoad,
                 n_microbatches: int, capacity: float, extra: float = 0.0, recompute: bool = False) -> MemoryCheck:
    """The most loaded stage's states + in-flight activations under 1F1B (worst chunk per rank);
    with ``recompute`` the blocks keep only their inputs, plus one block's recomputed activations."""
    shards = layout.dp if layout.fsdp else 1
    reshard = cost.reshards(layout)
    n_blocks = len(cost.layers[module]) - 2
    split = layout.stage_split(n_blocks)
    peak = 0.0
    start = 1
    for chunk, n in enumerate(split):
        lo = 0 if chunk == 0 else start
        hi = start + n if chunk < len(split) - 1 else len(cost.layers[module])
        in_flight = min(layout.pp - chunk % layout.pp, n_microbatches)
        states = cost.state_bytes(module, lo, hi, layout.tp, shards, reshard)
        if reshard:  # once per rank although its v chunks' states are counted v times below
            states += cost.reshard_transient_bytes(module, lo, hi, layout.tp) / layout.virtual_stages
        acts = in_flight * cost.activation_bytes(module, microbatch_load.tokens, lo, hi, layout.tp, layout.cp,
                                                 recompute)
        acts += cost.transient_bytes(module, microbatch_load.tokens, lo, hi, layout.tp, layout.cp, recompute)
        peak = max(peak, states * layout.virtual_stages + acts)
        start += n
    return MemoryCheck(peak + extra, capacity)


@functools.lru_cache(maxsize=4096)
def _stage_split(cost: CostModel, module: str, load: ModuleLoad, n_stages: int, tp: int, cp: int) -> tuple[int, ...]:
    """`plan_module_stages`, once per distinct request: candidates repeat the same LLM split for
    every encoder layout, placement and schedule they pair it with."""
    return plan_module_stages(cost, module, load, n_stages, tp, cp)


def balanced_split(cost: CostModel, module: str, layout: Layout, load: ModuleLoad) -> Layout:
    """The layout with its stages split by the frozen-aware partitioner."""
    if layout.n_stages == 1:
        return layout
    # partition over blocks only: front end and head stay with the first and last chunk
    split = _stage_split(cost, module, load, layout.n_stages, layout.tp, layout.cp)
    blocks = list(split)
    blocks[0] -= 1
    blocks[-1] -= 1
    if min(blocks) < 0 or sum(blocks) != len(cost.layers[module]) - 2:
        return layout
    if module == "llm" and blocks[0] < cost.mllm.llm.deepstack:  # the first stage holds DeepStack's blocks
        return layout
    return replace(layout, stage_layers=tuple(blocks))


def even_split(cost: CostModel, module: str, layout: Layout) -> Layout | None:
    """The layout with its stages split evenly (every baseline's split), or None where its own
    split already is even."""
    n_blocks = len(cost.layers[module]) - 2
    even = replace(layout, stage_layers=None)
    if layout.stage_layers is None or tuple(layout.stage_split(n_blocks)) == tuple(even.stage_split(n_blocks)):
        return None
    return even


def state_bytes_per_rank(cost: CostModel, plan: Plan) -> dict[int, float]:
    """Weights, gradients and optimizer states each rank holds: every stage chunk placed on it
    (FSDP shards over ``dp``; a projector lives whole on its encoder's last chunk), plus, on a rank with
    FSDP chunks, what gathering them holds beyond that: where they reshard per microbatch the largest
    block one of them gathers whole (a rank runs one unit at a time: `CostModel.reshard_transient_bytes`),
    else the largest unit's buffer as it is copied out (`CostModel.gather_transient_bytes`)."""
    return dict(_state_bytes(cost, tuple(plan.layouts.items())))


@functools.lru_cache(maxsize=64)
def _state_bytes(cost: CostModel, layouts: tuple[tuple[str, Layout], ...]) -> dict[int, float]:
    """`state_bytes_per_rank` of a plan's layouts (kept: a search asks again for every recompute
    option, schedule and batch of one set of layouts; callers get a copy)."""
    by_module, transient = _rank_states(cost, dict(layouts))
    return {rank: sum(modules.values()) + transient[rank] for rank, modules in by_module.items()}


def _rank_states(cost: CostModel, layouts: Mapping[str, Layout]) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """Per rank, each module's states on it; and its FSDP gathering transient (`state_bytes_per_rank`)."""
    out: dict[int, dict[str, float]] = {}
    transient: dict[int, float] = {}
    for module, layout in layouts.items():
        shards = layout.dp if layout.fsdp else 1
        reshard = cost.reshards(layout)
        ranks = layout.rank_list()
        per = layout.size // layout.pp
        states, gathered = [0.0] * layout.pp, [0.0] * layout.pp  # per pipeline rank: its chunks, their largest block
        for chunk in range(layout.n_stages):
            start, stop = layout_layer_range(cost, layout, module, chunk)
            nbytes = cost.state_bytes(module, start, stop, layout.tp, shards, reshard)
            if module != "llm" and chunk == layout.n_stages - 1:
                nbytes += cost.state_bytes(f"{module}_proj")  # held whole: no TP, no FSDP
            held = (cost.reshard_transient_bytes(module, start, stop, layout.tp) if reshard else
                    cost.gather_transient_bytes(module, start, stop, layout.tp) if layout.sharded else 0.0)
            states[chunk % layout.pp] += nbytes
            gathered[chunk % layout.pp] = max(gathered[chunk % layout.pp], held)
        for pp_rank in range(layout.pp):
            nbytes, held = states[pp_rank], gathered[pp_rank]
            for rank in ranks[pp_rank * per:(pp_rank + 1) * per]:
                out.setdefault(rank, {})[module] = nbytes
                transient[rank] = max(transient.get(rank, 0.0), held)
    return out, transient


def check_states_fit(cost: CostModel, plan: Plan, mem_bytes: float, device: str, where: str) -> None:
    """Refuse a plan some rank of which holds more weights, gradients and optimizer states than its
    device, before any activation (`state_bytes_per_rank`), naming the rank, each module's share,
    the estimate and the device.

    Raises:
        LayoutError: the largest such rank.
    """
    by_module, transient = _rank_states(cost, plan.layouts)
    rank = max(by_module, key=lambda r: sum(by_module[r].values()) + transient[r])
    most = sum(by_module[rank].values()) + transient[rank]
    if most <= mem_bytes:
        return
    gib = 2**30
    parts = ", ".join(f"{m} {b / gib:.1f} GiB" for m, b in by_module[rank].items())
    if transient[rank] > 0.05 * gib:
        parts += f", an FSDP unit gathered whole {transient[rank] / gib:.1f} GiB"
    raise LayoutError(f"{where}: rank {rank} would hold {most / gib:.1f} GiB of weights, gradients and optimizer "
                      f"states ({parts}) before any activation, over the {device}'s {mem_bytes / gib:.3g} GiB; shard "
                      "more (fsdp, tp, pp) or freeze more, or let the planner choose (parallel.plan=auto)")


def lower_bound_s(profile: BatchProfile, layouts: dict[str, Layout], batches: list[int] | None = None) -> float:
    """Seconds per iteration no schedule beats: the larger of (a) the whole batch's work spread
    over every rank and (b) each module's work spread over its own ranks, averaged over the
    profiled ``batches`` (default all). Both hold whatever the placement."""
    rows = profile.batch_costs if batches is None else profile.batch_costs[batches]
    costs = dict(zip(profile.modules, rows.mean(axis=0).tolist()))
    world = len({r for layout in layouts.values() for r in layout.rank_list()})
    per_module = [(costs[m] + costs.get(f"{m}_proj", 0.0)) / layout.size for m, layout in layouts.items()]
    return max(sum(costs.values()) / world, *per_module)
