"""Seconds of every transfer and collective harmonia's step runs, one function each.

The simulator (`harmonia.sim.tasks`) prices each piece of work with these, and the planner's bounds
(`harmonia.plan.bounds`) sum the same functions over a replica's microbatches, so the two can never
count a collective differently.

- ring all-reduce over ``n`` ranks: each rank sends and receives ``2 (n-1)/n`` of the buffer, in
  ``2 (n-1)`` steps of one latency each: ``2 (n-1)/n * bytes / bw + 2 (n-1) * latency``;
- TP: two all-reduces of the ``tokens/cp x hidden`` activations per block in a forward pass
  (Megatron-LM's column/row split: one after attention, one after the MLP) and two in the backward;
- CP: an all-gather of K and V per block, ``(c-1)/c * 2 tokens kv_dim bytes / tp / bw``;
- FSDP: an all-gather of the chunk's weights over its ``dp`` group, ``(dp-1)/dp * weight bytes /
  tp / bw``; harmonia's runtime issues the gathers of every FSDP chunk of a rank once, at the start
  of the step, on the communication stream, in module then chunk order (`step_gathers`), and each
  block's first forward waits for its own (`first_forward_gather`); a chunk that reshards per
  microbatch (``fsdp reshard``, or every FSDP chunk priced ``fsdp_per_microbatch``, as published
  runs gather) before every forward and backward instead (`harmonia.sim.tasks.collective_extra`);
- DP gradient reduction: a ring all-reduce of the chunk's fp32 trainable gradients (its projector's
  on an encoder's last chunk) over ``dp``, as the runtime reduces them; under FSDP a ring
  reduce-scatter of the fp32 accumulated gradients, ``(dp-1)/dp * trainable * 4 / tp / bw + (dp-1) *
  latency``; an LLM chunk gathered once per step whose last backward is fused reduce-scatters each
  block's inside that backward and the root group's (front end, head) after it
  (`reduce_exposed_s`); resharding per microbatch, that reduce-scatter runs in every backward
  (`backward_reduce_s`), overlapped with its blocks, and only the last block's follows the chunk's
  last backward (`grad_reduce_s`);
- P2P: ``latency + bytes / bw`` between two ranks, nothing on the same rank.

Bandwidths come from the cluster model: a group within a node runs at the node's link speed, one
that crosses nodes at the network's (`ClusterSpec.group_bandwidth`).
"""

from __future__ import annotations

import functools

from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import stage_layer_range
from harmonia.workload.cost import CostModel
from harmonia.workload.memory_cost import GRAD_BYTES
from harmonia.workload.devices import ClusterSpec


def ring_reduce_scatter_s(nbytes: float, ranks: tuple[int, ...], cluster: ClusterSpec) -> float:
    """Ring reduce-scatter time: each rank sends and receives ``(n-1)/n`` of the buffer."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / cluster.group_bandwidth(ranks) + (n - 1) * cluster.device.latency_s


def ring_allreduce_s(nbytes: float, ranks: tuple[int, ...], cluster: ClusterSpec) -> float:
    """Ring all-reduce time: each rank sends and receives ``2 (n-1)/n`` of the buffer."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / cluster.group_bandwidth(ranks) + 2 * (n - 1) * cluster.device.latency_s


def p2p_s(nbytes: float, src: int, dst: int, cluster: ClusterSpec) -> float:
    """Point-to-point transfer delay (zero on the same rank)."""
    if src == dst or nbytes <= 0:
        return 0.0
    return cluster.device.latency_s + nbytes / cluster.p2p_bandwidth(src, dst)


def chunk_blocks(cost: CostModel, layout: Layout, module: str, chunk: int) -> int:
    """Transformer blocks of a stage chunk (the front end and the head are not blocks)."""
    return layout.stage_split(len(cost.layers[module]) - 2)[chunk]


@functools.lru_cache(maxsize=1 << 16)
def stage_group(layout: Layout, chunk: int, axis: str, dp: int = 0, cp: int = 0, tp: int = 0) -> tuple[int, ...]:
    """The ranks of a chunk's pipeline rank along ``axis`` through the given coordinates (a pure
    function of its arguments, kept: every task and bound of a layout asks for the same groups)."""
    coords = {"dp": dp, "cp": cp, "tp": tp}
    out = []
    for i in range(getattr(layout, axis)):
        coords[axis] = i
        out.append(layout.rank_at(pp=chunk % layout.pp, **coords))
    return tuple(out)


def tp_allreduce_s(cost: CostModel, cluster: ClusterSpec, layout: Layout, module: str, blocks: int,
                   tokens: float, group: tuple[int, ...], calls: int = 1) -> float:
    """TP all-reduces of one forward (or one backward) pass of ``blocks`` blocks over ``tokens``.

    A ring is affine in its bytes, so ``calls`` passes whose tokens sum to ``tokens`` take the bytes
    term of ``tokens`` once and the latency term ``calls`` times (the planner's bound over a replica's
    microbatches; the simulator prices one microbatch with ``calls=1``).
    """
    if layout.tp <= 1 or tokens <= 0:
        return 0.0
    n = layout.tp
    hidden = cost.mllm.llm.hidden if module == "llm" else cost.mllm.encoders[module].body.hidden  # a block's width
    nbytes = tokens / layout.cp * hidden * cost.act_bytes
    per_block = 2 * (n - 1) / n * nbytes / cluster.group_bandwidth(group) + calls * 2 * (n - 1) * cluster.device.latency_s
    return 2 * blocks * per_block


def cp_kv_gather_s(cost: CostModel, cluster: ClusterSpec, layout: Layout, module: str, blocks: int,
                   tokens: float, group: tuple[int, ...]) -> float:
    """The K and V all-gathers of one pass of ``blocks`` blocks over ``tokens`` (context parallelism)."""
    if layout.cp <= 1 or tokens <= 0:
        return 0.0
    spec = cost.mllm.llm.body if module == "llm" else cost.mllm.encoders[module].body
    kv = 2 * tokens * spec.kv_dim * cost.act_bytes / layout.tp
    return blocks * (layout.cp - 1) / layout.cp * kv / cluster.group_bandwidth(group)


def fsdp_gather_s(cost: CostModel, cluster: ClusterSpec, plan: Plan, module: str, chunk: int,
                  dp: int = 0, cp: int = 0, tp: int = 0) -> float:
    """One all-gather of a chunk's weights over its DP group (FSDP), before a forward or a backward."""
    layout = plan.layouts[module]
    if not layout.fsdp or layout.dp <= 1:
        return 0.0
    start, stop = stage_layer_range(cost, plan, module, chunk)
    weights = cost.param_count(module, start, stop)[0] * cost.weight_bytes / layout.tp
    group = stage_group(layout, chunk, "dp", dp, cp, tp)
    return (layout.dp - 1) / layout.dp * weights / cluster.group_bandwidth(group)


def grad_reduce_s(cost: CostModel, cluster: ClusterSpec, plan: Plan, module: str, chunk: int,
                  cp: int = 0, tp: int = 0) -> float:
    """The DP reduction of a chunk's trainable gradients (its projector's on an encoder's last chunk)
    after its last backward; zero with ``dp = 1`` or nothing to train. A chunk that reshards per
    microbatch reduce-scatters in every backward (`backward_reduce_s`, overlapped with its blocks):
    only its last block's share follows the last backward."""
    layout = plan.layouts[module]
    if layout.dp <= 1:
        return 0.0
    if cost.reshards(layout):
        blocks = max(1, chunk_blocks(cost, layout, module, chunk))
        return backward_reduce_s(cost, cluster, plan, module, chunk, cp, tp) / blocks
    group = stage_group(layout, chunk, "dp", 0, cp, tp)
    nbytes = _trainable(cost, plan, module, chunk) * GRAD_BYTES / layout.tp
    if layout.fsdp:
        return ring_reduce_scatter_s(nbytes, group, cluster)
    return ring_allreduce_s(nbytes, group, cluster)


def backward_reduce_s(cost: CostModel, cluster: ClusterSpec, plan: Plan, module: str, chunk: int,
                      cp: int = 0, tp: int = 0) -> float:
    """The reduce-scatter of a resharding FSDP chunk's fp32 gradients that each of its backwards runs."""
    layout = plan.layouts[module]
    if not cost.reshards(layout):
        return 0.0
    group = stage_group(layout, chunk, "dp", 0, cp, tp)
    return ring_reduce_scatter_s(_trainable(cost, plan, module, chunk) * GRAD_BYTES / layout.tp, group, cluster)


def _trainable(cost: CostModel, plan: Plan, module: str, chunk: int) -> int:
    """Trainable weights of a chunk, its projector's on an encoder's last chunk."""
    start, stop = stage_layer_range(cost, plan, module, chunk)
    trainable = cost.param_count(module, start, stop)[1]
    if chunk == plan.layouts[module].n_stages - 1 and module != "llm":
        trainable += cost.param_count(f"{module}_proj")[1]
    return trainable


def rank_gathers_s(cost: CostModel, cluster: ClusterSpec, plan: Plan) -> dict[int, float]:
    """Seconds of FSDP gathers each rank issues at the start of the step (`step_gathers`, summed)."""
    return {rank: sum(seconds for _, _, seconds in gathers)
            for rank, gathers in step_gathers(cost, cluster, plan).items()}


def step_gathers(cost: CostModel, cluster: ClusterSpec, plan: Plan) -> dict[int, list[tuple[str, int, float]]]:
    """Per rank, the FSDP gathers harmonia's runtime issues at the start of the step, in its order
    (modules by name, then chunks: `harmonia.runtime.grads.start_fsdp_backward`): (module, chunk,
    seconds); chunks that reshard per microbatch gather before every forward and backward instead."""
    out: dict[int, list[tuple[str, int, float]]] = {}
    for module, layout in sorted(plan.layouts.items()):
        if not layout.sharded or cost.reshards(layout):
            continue
        for chunk in range(layout.n_stages):
            for cp in range(layout.cp):
                for tp in range(layout.tp):  # one DP group: its ranks gather alike
                    seconds = fsdp_gather_s(cost, cluster, plan, module, chunk, 0, cp, tp)
                    for rank in stage_group(layout, chunk, "dp", 0, cp, tp):
                        out.setdefault(rank, []).append((module, chunk, seconds))
    return out


def first_forward_gather(gather: float, forward: float, blocks: int, slowdown: float) -> tuple[float, float]:
    """(seconds the gather adds to the chunk's first forward, delay of that forward's start after
    the gather's end): FSDP2 waits for each block's gather in the block's pre-forward, so the forward
    computes beside the gathers still in flight, ``1 + slowdown`` times slower for as long as they
    overlap (at most the gather, at most the slowed forward): ``min(g, F (1 + s)) s / (1 + s)``; and
    its last group (a block, or the root of a chunk without blocks) computes after the last gather
    ends: the forward ends at least ``F / (blocks + 1)`` after it (the root counts as a group)."""
    extra = min(gather, forward * (1 + slowdown)) * slowdown / (1 + slowdown)
    return extra, forward / (blocks + 1) - (forward + extra)


def reduces_in_backward(cost: CostModel, plan: Plan, module: str) -> bool:
    """Whether a module's FSDP chunks reduce-scatter inside their last fused backward (the LLM's,
    gathered once per step: `harmonia.runtime.grads.reduce_in_last_backward`)."""
    layout = plan.layouts[module]
    return module == "llm" and layout.sharded and not cost.reshards(layout)


def reduce_exposed_s(cost: CostModel, cluster: ClusterSpec, plan: Plan, module: str, chunk: int,
                     backward: float | None = None, cp: int = 0, tp: int = 0) -> float:
    """Seconds a chunk's reduction inside its last backward (`reduces_in_backward`) runs past that
    backward's end, ``backward`` seconds long (None: the least over every length, the bounds').

    The blocks' reduce-scatters ``r_b`` (over ``L`` blocks) start as each block's backward ends, one
    after another on the communication stream, and the root group's ``r_0`` after the backward:
    past its end run at least the last block's share and the root's, ``r_b / L + r_0``, and at least
    what the stream cannot fit beside the backward after its first block, ``r - B (L - 1) / L``."""
    total = grad_reduce_s(cost, cluster, plan, module, chunk, cp, tp)
    blocks = chunk_blocks(cost, plan.layouts[module], module, chunk)
    start, stop = stage_layer_range(cost, plan, module, chunk)
    trainable = cost.param_count(module, start, stop)[1]
    block_share = cost.param_count(module, max(start, 1), min(stop, len(cost.layers[module]) - 1))[1] / trainable \
        if trainable and blocks else 0.0
    least = total * (1 - block_share) + total * block_share / max(blocks, 1)
    if backward is None:
        return least
    return max(least, total - backward * (blocks - 1) / blocks if blocks else total)
