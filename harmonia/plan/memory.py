"""Per-rank memory of a plan before simulating it: every module's states and in-flight activations.

A rank holds the weights, gradients and optimizer states of every stage chunk placed on it (FSDP
shards the optimizer's over ``dp`` and keeps bf16 weights and fp32 gradients whole through the step,
as harmonia's runtime runs it: `harmonia.workload.cost`; `state_bytes_per_rank`), plus the
activations of the microbatches its stages keep in flight under the plan's schedule. The schedule's
gates set the count on each stage chunk (`harmonia.schedule.generators`): forward m + k waits for
the backward of m, with k the stages from the chunk to the LLM's last, at most the microbatches
there are. Counted per chunk:

- 1F1B: ``k`` microbatches, from forward to backward.
- zero bubble, on a stage that splits its backward: ``k`` until B, then up to ``k`` deferred weight
  gradients keeping all of theirs and the output gradients W needs (B keeps the autograd graph for
  W: `harmonia.workload.memory_cost`): ``2 k`` microbatches' activations and ``k`` of those gradients.
- encoders fused into the LLM's first stage (Megatron): as many as that stage, ``min(pp, n)``.
- interleaved 1F1B: the LLM's gate is per pipeline rank, over all its chunks: Megatron-LM's warm-up
  plus one chunk forward (`interleaved_in_flight`), counted as the largest chunk forwards the rank
  could hold (each chunk once per microbatch).
- an encoder replica serving several LLM replicas keeps ``k`` for each of them.

A microbatch's activations are those of the profiled mean sample times the samples per
microbatch (an encoder's split over the encoder replicas feeding one LLM replica); frozen layers
with no backward keep none. A module in ``plan.recompute`` keeps only its blocks' inputs
(`harmonia.workload.cost`), and a rank holding recomputed stages adds, once, the largest block's
activations one of them recomputes during a backward (a rank runs one backward at a time). The estimate prunes plans that cannot fit before they are simulated;
the simulated peak (actual microbatches, actual order) decides after scoring.
"""

from __future__ import annotations

import numpy as np

from harmonia.plan.candidates import state_bytes_per_rank
from harmonia.plan.profiling import BatchProfile
from harmonia.schedule import StageGraph
from harmonia.schedule.actions import StageRef
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, plan_graph, stage_layer_range
from harmonia.workload.cost import CostModel

LLM = "llm"


def in_flight(graph: StageGraph, plan: Plan, ref: StageRef, fused: bool = False) -> float:
    """Microbatches of activations a stage chunk keeps at most, per LLM replica it serves."""
    n = plan.n_microbatches
    if fused and ref.module != LLM:
        return float(min(graph.llm.n_stages, n))
    depth = float(min(graph.depth_to_end(ref), n))
    return depth + deferred_w(graph, plan, ref)


def deferred_w(graph: StageGraph, plan: Plan, ref: StageRef) -> float:
    """Microbatches whose weight gradient a stage chunk defers past their B at most, keeping their
    activations and W's output gradients: under zero bubble on a chunk that splits its backward, as
    many as it keeps in flight to B; else none."""
    if plan.schedule != "zb" or not (graph.needs_b(ref) and graph.needs_w(ref)):
        return 0.0
    return float(min(graph.depth_to_end(ref), plan.n_microbatches))


def interleaved_in_flight(plan: Plan, pp_rank: int) -> float:
    """Stage-chunk forwards an LLM pipeline rank keeps in flight under interleaved 1F1B: Megatron-LM's
    warm-up ``(v - 1) * pp + 2 * (pp - 1 - pp_rank)`` plus the steady state's one, at most every
    chunk forward of the iteration (the gate of `harmonia.schedule.families.build_interleaved_1f1b`)."""
    layout = plan.layouts[LLM]
    pp, v, n = layout.pp, layout.virtual_stages, plan.n_microbatches
    per_round = n // max(1, n // pp)
    return float(min((v - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1, n * v))


def _largest(sizes: list[float], copies: int, count: float) -> float:
    """Sum of the ``count`` largest of ``sizes`` (descending), each available ``copies`` times."""
    total, left = 0.0, count
    for size in sizes:
        take = min(left, copies)
        total, left = total + take * size, left - take
    return total


def _microbatch_share(plan: Plan, module: str) -> float:
    """Mean samples of one microbatch a replica of ``module`` runs: an LLM replica its share of the
    global microbatch, an encoder replica the global microbatch over the encoder's replicas."""
    replicas = plan.layouts[module].dp
    return plan.global_batch / plan.n_microbatches / replicas


def microbatch_activation_bytes(cost: CostModel, plan: Plan, profile: BatchProfile, module: str,
                                chunk: int, recompute: float | None = None) -> float:
    """Activation bytes one mean microbatch keeps on one rank of a stage chunk (projector included
    on an encoder's last chunk), recomputing the plan's share of the module's blocks or
    ``recompute``."""
    layout: Layout = plan.layouts[module]
    share = _microbatch_share(plan, module)
    start, stop = stage_layer_range(cost, plan, module, chunk)
    tokens = profile.sample_load(module).tokens * share
    recompute = plan.recompute_share(module) if recompute is None else recompute
    act = cost.activation_bytes(module, tokens, start, stop, layout.tp, layout.cp, recompute)
    if module != LLM and chunk == layout.n_stages - 1:
        proj = f"{module}_proj"
        act += cost.activation_bytes(proj, profile.sample_load(proj).tokens * share, cp=layout.cp)  # whole per TP rank
    return act


def microbatch_wgrad_bytes(cost: CostModel, plan: Plan, profile: BatchProfile, module: str, chunk: int) -> float:
    """Output-gradient bytes one mean microbatch keeps from B to W on one rank of a stage chunk that
    splits its backward (`harmonia.workload.memory_cost.MemoryCosts.wgrad_bytes`; the projector's on
    an encoder's last chunk)."""
    layout: Layout = plan.layouts[module]
    share = _microbatch_share(plan, module)
    start, stop = stage_layer_range(cost, plan, module, chunk)
    held = cost.wgrad_bytes(module, profile.sample_load(module).tokens * share, start, stop, layout.tp, layout.cp)
    proj = f"{module}_proj"
    if module != LLM and chunk == layout.n_stages - 1 and proj in cost.layers:
        held += cost.wgrad_bytes(proj, profile.sample_load(proj).tokens * share, cp=layout.cp)
    return held


def transient_bytes(cost: CostModel, plan: Plan, profile: BatchProfile, module: str, chunk: int,
                    recompute: float | None = None) -> float:
    """Bytes a mean microbatch holds on one rank of a stage chunk beyond what it keeps, while one of
    its blocks runs: the larger of its backward's (a block's gradients, and recomputed activations
    for the plan's share or ``recompute``) and its forward's (a block that keeps nothing)."""
    recompute = plan.recompute_share(module) if recompute is None else recompute
    layout: Layout = plan.layouts[module]
    start, stop = stage_layer_range(cost, plan, module, chunk)
    share = _microbatch_share(plan, module)
    load = profile.sample_load(module)
    return cost.transient_bytes(module, load.tokens * share, start, stop, layout.tp, layout.cp, recompute)


def _module_activations(cost: CostModel, plan: Plan, profile: BatchProfile, graph: StageGraph, module: str,
                        recompute: float, fused: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per rank (indexed by global rank), the activations ``module``'s stage chunks keep in flight
    there and the bytes one of its recomputing backwards adds on top, recomputing ``recompute``."""
    layout = plan.layouts[module]
    kept, again = np.zeros(plan.world_size), np.zeros(plan.world_size)
    ranks = np.asarray(layout.rank_list())
    per = layout.size // layout.pp
    interleaved = module == LLM and plan.schedule == "interleaved" and layout.virtual_stages > 1
    acts = [microbatch_activation_bytes(cost, plan, profile, module, c, recompute) for c in range(layout.n_stages)]
    for chunk in range(layout.n_stages):
        pp_rank = chunk % layout.pp
        if interleaved:  # one gate per rank over its chunks: the largest chunk forwards it admits
            if chunk >= layout.pp:
                continue
            mine = sorted(acts[pp_rank::layout.pp], reverse=True)
            act = _largest(mine, plan.n_microbatches, interleaved_in_flight(plan, pp_rank))
        else:
            ref = StageRef(module, chunk)
            act = in_flight(graph, plan, ref, fused) * acts[chunk]
            if not (fused and module != LLM) and (deferred := deferred_w(graph, plan, ref)):
                act += deferred * microbatch_wgrad_bytes(cost, plan, profile, module, chunk)
        held = max(transient_bytes(cost, plan, profile, module, c, recompute)
                   for c in range(pp_rank, layout.n_stages, layout.pp))
        mine_ranks = ranks[pp_rank * per:(pp_rank + 1) * per]
        kept[mine_ranks] += act
        again[mine_ranks] = np.maximum(again[mine_ranks], held)
    return kept, again


def _states(cost: CostModel, plan: Plan) -> np.ndarray:
    """`state_bytes_per_rank` indexed by global rank."""
    out = np.zeros(plan.world_size)
    for rank, nbytes in state_bytes_per_rank(cost, plan).items():
        out[rank] = nbytes
    return out


def plan_peak_bytes(cost: CostModel, plan: Plan, profile: BatchProfile, fused: bool = False) -> dict[int, float]:
    """Per rank, states plus the activations its stage chunks keep in flight (module docstring)."""
    graph = plan_graph(plan, cost)
    total, transient = _states(cost, plan), np.zeros(plan.world_size)
    used = np.zeros(plan.world_size, dtype=bool)
    for module, layout in plan.layouts.items():
        kept, again = _module_activations(cost, plan, profile, graph, module, plan.recompute_share(module), fused)
        total += kept
        transient = np.maximum(transient, again)
        used[list(layout.rank_list())] = True
    total += transient
    return {int(r): float(total[r]) for r in np.flatnonzero(used)}


def recompute_peaks(cost: CostModel, plan: Plan, profile: BatchProfile, options: list[dict[str, float]],
                    fused: bool = False, cache: dict | None = None) -> list[float]:
    """The largest `plan_peak_bytes` over ranks of the plan under each recompute option (module ->
    share of its blocks recomputed; a module left out recomputes nothing). Equal to evaluating
    each option's plan, but each module's activations are computed once per share it takes, and
    with a ``cache`` once per search: they depend on the module's and the LLM's layouts, the
    schedule, the microbatches and the batch only (an encoder's in-flight count follows the
    LLM's stages after it)."""
    graph = None
    cache = {} if cache is None else cache
    world = plan.world_size
    fixed = (plan.layouts[LLM], plan.schedule, plan.n_microbatches, plan.global_batch, fused, world)
    total = np.tile(_states(cost, plan), (len(options), 1))  # (options, world)
    transient = np.zeros_like(total)
    for module in plan.layouts:
        shares = [float(option.get(module, 0.0)) for option in options]
        distinct = sorted(set(shares))
        rows = []  # per distinct share: (kept, again), each (world,)
        for share in distinct:
            key = (module, plan.layouts[module], share, *fixed)
            if key not in cache:
                graph = graph or plan_graph(plan, cost)
                cache[key] = _module_activations(cost, plan, profile, graph, module, share, fused)
            rows.append(cache[key])
        which = np.searchsorted(distinct, shares)  # (options,) each option's row
        total += np.stack([kept for kept, _ in rows])[which]
        np.maximum(transient, np.stack([again for _, again in rows])[which], out=transient)
    return [float(peak) for peak in (total + transient).max(axis=1)]


def work_peak_floor(cost: CostModel, plan: Plan, iw: IterationWork) -> dict[int, float]:
    """Per rank, bytes no schedule of this iteration's stage work holds less of at its peak: the
    rank's states plus the largest activations one unit keeps from its forward to its backward,
    with the bytes its backward or forward holds on top (`harmonia.sim.engine` counts both)."""
    out = state_bytes_per_rank(cost, plan)
    per_key: dict = {}  # stage key -> its largest unit's bytes
    for (key, _, _), work in iw.work.items():
        nbytes = work.act_bytes + max(work.transient, work.f_transient)
        if nbytes > per_key.get(key, 0.0):
            per_key[key] = nbytes
    held: dict[int, float] = {}
    for key, nbytes in per_key.items():
        for rank in iw.stage_ranks.get(key, ()):
            if nbytes > held.get(rank, 0.0):
                held[rank] = nbytes
    for rank, nbytes in held.items():
        out[rank] = out.get(rank, 0.0) + nbytes
    return out
