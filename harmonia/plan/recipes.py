"""Training recipes as complete, searchable systems: layout rules + batch assignment + schedule.

Each recipe is searched over the layouts its own rules allow (scored by simulating profiled
batches), so no baseline is hand-weakened:

==============  ==========================================================================  =========
recipe          layout rules                                                                stands for
==============  ==========================================================================  =========
``megatron``    one layout for all modules: the LLM's (tp, pp, dp); each encoder runs        Megatron-LM,
                inside the LLM's first pipeline stage on its ranks; layers split evenly;   torchtitan
                fixed-size microbatches in dataset order; 1F1B or interleaved 1F1B          VLM
                (two or four virtual stages per rank)
``cornstarch``  encoders on pipeline stages of their own (the LLM's tp and dp, one or two    Cornstarch
                stages each), frozen-aware layer split; fixed-size microbatches; 1F1B
``disttrain``   disjoint encoder and LLM rank sets sized to their work share, any           DistTrain
                factorisation; samples reordered across microbatches on total work; 1F1B
``harmonia``    disjoint (rank sets by work share) or colocated (encoders on every rank,    harmonia
                data parallel or with the LLM's tp), and every placement above
                (encoders on the LLM's first stage, or on stages of their own);
                frozen-aware split; every module balanced per iteration; 1F1B,
                interleaved 1F1B or zero-bubble, whichever wins
==============  ==========================================================================  =========

A plan that does not fit device memory is retried, under every recipe alike, recomputing the
activations of a quarter, half, three quarters or all of each stage's blocks of each module with a
backward, the LLM and each encoder on its own, least extra work first (`recompute_options`), as
Megatron-LM's full and block recompute do; only what fits in none of these counts as a memory
misfit. So is, where it needs less recompute, the same plan with FSDP on every module where FSDP
saves memory (`sharded_everywhere`): as harmonia's runtime runs it, FSDP shards the fp32 weights and
optimizer states only; and, under schedules with fused backward, the same with the LLM resharding
per microbatch (`resharded`: ZeRO-3, every state sharded, weights gathered before every forward
and backward), which trades gathers and reduce-scatters in every unit for memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product

import numpy as np

from harmonia.errors import ConfigError
from harmonia.plan.candidates import (balanced_split, check_memory, disjoint_sizes, encoder_layouts, heads_split,
                                      llm_layouts, tp_options)
from harmonia.plan.memory import recompute_peaks
from harmonia.plan.profiling import BatchProfile
from harmonia.schedule.assign import assign_reordered, assign_sequential
from harmonia.schedule.families import fuse_encoders
from harmonia.schedule.graph import IterationSchedule
from harmonia.schedule.item_cuts import cut_encoder_items
from harmonia.schedule.iteration import (IterationAssignment, assemble_iteration, assign_iteration, feeding_replicas,
                                        module_columns)
from harmonia.schedule.layout import Layout, Placement
from harmonia.schedule.order_search import (SUB_OPTIONS, OrderStep, ReplayRate, SearchResult, search_batch_order,
                                            search_submicrobatches)
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, iteration_schedule, plan_graph, plan_iteration_work
from harmonia.sim.engine import Timeline
from harmonia.sim.tasks import SimulatedOrders, simulate_schedule, simulated_step
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec
from harmonia.workload.shapes import SampleShape
from harmonia.workload.work import ModuleLoad

RECIPES = ("megatron", "cornstarch", "disttrain", "harmonia")
MEMORY_HEADROOM = 0.9


@dataclass(frozen=True)
class Candidate:
    """A recipe's concrete choice: the plan and how its work is ordered."""

    recipe: str
    plan: Plan
    fused: bool = False  # encoders fused into the LLM's first stage (Megatron)


def _microbatch_load(profile: BatchProfile, global_batch: int, dp: int, n_mb: int) -> ModuleLoad:
    """The LLM load of a typical microbatch: the profile's mean sample times samples per microbatch."""
    k = max(1, global_batch // dp // n_mb)
    mean = profile.sample_load("llm")
    return ModuleLoad(mean.tokens * k, mean.pairs * k, 1)


VIRTUAL_STAGES = (2, 4)
"""Stage chunks per pipeline rank interleaved 1F1B may use (Megatron-LM's virtual pipeline size)."""


def _interleaved(cost: CostModel, llm: Layout, n_mb: int, load: ModuleLoad | None) -> Iterator[Layout]:
    """The LLM layout with ``v`` stage chunks per pipeline rank for each ``v`` of `VIRTUAL_STAGES`
    that its blocks and microbatches allow (Megatron-LM's virtual pipeline: ``n_mb`` a multiple of
    ``pp``, at least one block per chunk): split evenly, or by the frozen-aware partitioner for
    ``load`` when given."""
    blocks = len(cost.layers["llm"]) - 2  # embedding and head live on the first and last chunk
    if llm.pp < 2 or n_mb % llm.pp:
        return
    for v in VIRTUAL_STAGES:  # every chunk at least one block, the first DeepStack's
        if blocks >= v * llm.pp and blocks // (v * llm.pp) >= cost.mllm.llm.deepstack:
            virtual = replace(llm, virtual_stages=v, stage_layers=None)
            yield virtual if load is None else balanced_split(cost, "llm", virtual, load)


def _schedules(cost: CostModel, llm: Layout, n_mb: int, families: tuple[str, ...],
               load: ModuleLoad | None = None) -> Iterator[tuple[Layout, str]]:
    """(LLM layout, schedule family) pairs: each family of ``families`` on ``llm``, ``interleaved``
    on its virtual-stage forms (frozen-aware split for ``load`` when given)."""
    for family in families:
        if family != "interleaved":
            yield llm, family
        else:
            yield from ((virtual, family) for virtual in _interleaved(cost, llm, n_mb, load))


LONG_SAMPLE = 4096
"""Mean LLM tokens per sample from which LLM layouts with context parallelism are searched."""


def _microbatch_counts(pp: int, per_replica: int, long: bool = False) -> list[int]:
    """Microbatches per LLM replica to try: ``pp``, ``2 pp``, ``4 pp`` and 8 that the replica's samples
    fill, and with ``long`` samples also one sample per microbatch (what fits long sequences in memory
    without recompute)."""
    counts = {c for c in (pp, 2 * pp, 4 * pp, 8) if pp <= c <= per_replica}
    if long and per_replica >= pp:
        counts.add(per_replica)
    return sorted(counts) or [min(per_replica, pp)]


def _llm_options(cost: CostModel, cluster: ClusterSpec, n_ranks: int, offset: int, global_batch: int,
                 profile: BatchProfile, frozen_aware: bool,
                 rejected: Counter | None = None) -> Iterator[tuple[Layout, int]]:
    """LLM layouts with microbatch counts that fit in memory, recomputing its activations if need be;
    misfits are counted in ``rejected`` by reason. Where samples are long (`LONG_SAMPLE` LLM tokens
    on average) context parallelism (up to 4) and one sample per microbatch are searched too: CP
    splits a sequence, and shards of short ones would leave its ring attention's kernels too small to
    run at the cost model's rates."""
    seen = set()
    cap = cluster.device.mem_bytes * MEMORY_HEADROOM
    long = profile.sample_load("llm").tokens >= LONG_SAMPLE
    for base in llm_layouts(cost, cluster, n_ranks, offset, global_batch, max_cp=4 if long else 1):
        if base.pp > 8:
            continue
        per_replica = global_batch // base.dp
        for n_mb in _microbatch_counts(base.pp, per_replica, long):
            key = (base.tp, base.pp, base.dp, n_mb)
            if key in seen:
                continue
            seen.add(key)
            load = _microbatch_load(profile, global_batch, base.dp, n_mb)
            layout = balanced_split(cost, "llm", base, load) if frozen_aware else base
            forms = (layout, *((resharded_llm(layout),) if cost.fsdp_pays("llm", layout.dp, reshard=True) else ()))
            if any(check_memory(cost, "llm", form, load, n_mb, cap, recompute=r).fits
                   for form in forms for r in (False, True)):
                yield layout, n_mb
            elif rejected is not None:
                rejected["llm exceeds device memory"] += 1


def candidates(recipe: str, cost: CostModel, cluster: ClusterSpec, profile: BatchProfile,
               global_batch: int, model: str, rejected: Counter | None = None) -> Iterator[Candidate]:
    """Every plan a recipe's rules allow on this cluster that fits device memory on every rank
    (`harmonia.plan.memory`); misfits are counted in ``rejected`` by reason."""
    found = _recipe_candidates(recipe, cost, cluster, profile, global_batch, model, rejected)
    return fitting(found, cost, cluster, profile, rejected)


RECOMPUTE_SHARES = (0.25, 0.5, 0.75)
"""Partial recompute options, as shares of each stage's blocks (`Plan.recompute_fraction`)."""

Recompute = tuple[tuple[str, ...], dict[str, float]]


def recompute_options(cost: CostModel, plan: Plan, weights: dict[str, float] | None = None) -> list[Recompute]:
    """What a plan may recompute, least extra work first: the plan's own choice, then every
    combination of none, a quarter, half, three quarters or all of each stage's blocks of each
    module with a backward (the LLM and every encoder on its own), the last recomputing every such
    module whole.

    Extra work is each module's share times its weight (``weights``: the module's seconds per
    batch, e.g. `BatchProfile.mean_costs`; equal without): recomputing runs a share of the
    module's forward again, a fixed part of its work. A long-video encoder may need its
    activations recomputed while the LLM's fit, or the reverse, so modules are not recomputed in a
    fixed order. Every recipe gets the same rule (Megatron-LM's ``--recompute-granularity full``
    with ``--recompute-method block --recompute-num-layers``, torchtitan's full activation
    checkpointing). Zero-bubble plans are not retried: their deferred W keeps the linear inputs its
    B recomputed, which the memory model does not follow from B to W; the same layout under 1F1B
    is a candidate of its own and is retried.
    """
    own: Recompute = (plan.recompute, dict(plan.recompute_fraction))
    modules = [m for m in ("llm", *plan.encoders) if cost.needs_backward(m)]
    if plan.schedule == "zb" or not modules:
        return [own]
    kept = tuple(m for m in plan.recompute if m not in modules)
    levels = (0.0, *RECOMPUTE_SHARES, 1.0)
    grids = [[s for s in levels if s >= plan.recompute_share(m)] for m in modules]
    weight = weights or {}
    combos = sorted(product(*grids), key=lambda c: (sum(s * weight.get(m, 1.0) for m, s in zip(modules, c)), c))
    options = [own]
    for combo in combos:
        option = ((*kept, *(m for m, s in zip(modules, combo) if s > 0)),
                  {m: s for m, s in zip(modules, combo) if 0 < s < 1})
        if option != own:
            options.append(option)
    return options


def _share(option: Recompute, module: str) -> float:
    return option[1].get(module, 1.0) if module in option[0] else 0.0


def _covers(more: Recompute, less: Recompute) -> bool:
    """Whether ``more`` recomputes every module whole or not at all, and at least what ``less`` does."""
    whole = not more[1]
    return whole and more != less and all(_share(more, m) >= _share(less, m) for m in less[0])


def _extra(option: Recompute, weights: dict[str, float]) -> float:
    """The work an option runs again, in the units of ``weights`` (`recompute_options`)."""
    return sum(_share(option, m) * weights.get(m, 1.0) for m in option[0])


def sharded_everywhere(cost: CostModel, plan: Plan) -> Plan | None:
    """The plan with FSDP on every module where it saves memory (`CostModel.fsdp_pays`; None if it has that
    already): as harmonia's runtime runs FSDP (`harmonia.workload.cost`), sharding a trained
    weight's 16 bytes costs one weight gather per step and keeps 6 whole."""
    layouts = {m: replace(lay, fsdp=True) if cost.fsdp_pays(m, lay.dp) else lay
               for m, lay in plan.layouts.items()}
    return replace(plan, layouts=layouts) if layouts != plan.layouts else None


def resharded_llm(layout: Layout) -> Layout:
    """An LLM layout with FSDP resharding per microbatch (ZeRO-3: `Layout.reshard`)."""
    return replace(layout, fsdp=True, reshard=True)


def resharded(cost: CostModel, plan: Plan) -> Plan | None:
    """The plan with FSDP on every module where it saves memory and the LLM's resharding per
    microbatch (None where the LLM has one replica or the schedule splits its backward): every
    state of the LLM sharded, its weights gathered before every forward and backward and its
    gradients reduce-scattered after every backward."""
    llm = plan.layouts["llm"]
    if plan.schedule == "zb" or llm.resharded or not cost.fsdp_pays("llm", llm.dp, reshard=True):
        return None
    base = sharded_everywhere(cost, plan) or plan
    return replace(base, layouts={**base.layouts, "llm": resharded_llm(llm)})


def fitting(found: Iterator[Candidate], cost: CostModel, cluster: ClusterSpec, profile: BatchProfile,
            rejected: Counter | None = None) -> Iterator[Candidate]:
    """The candidates whose estimated peak on every rank (states of every module plus in-flight
    activations under the schedule) fits the device, each with the least recompute
    (`recompute_options`, weighted by the profile's work per module) it needs and with every
    whole-module recompute option that recomputes at least as much: the estimate is for the
    profile's mean microbatch, and a batch with heavier microbatches than the mean may fit only with
    more recompute when simulated. The candidate with FSDP on every module where it saves memory
    (`sharded_everywhere`), then that with the LLM also resharding per microbatch (`resharded`),
    come too where each needs less recompute than the ones before it (or those fit in no way).
    Those that fit in none of these are counted in ``rejected``."""
    cap = cluster.device.mem_bytes * MEMORY_HEADROOM
    weights = profile.mean_costs()
    activations: dict = {}  # every module's activations per layout and share, shared by the candidates
    options_of: dict[tuple, tuple[list[Recompute], list[dict[str, float]]]] = {}  # per what they depend on

    def least(cand: Candidate, below: float = float("inf")) -> tuple[list[Recompute], Recompute | None]:
        """The recompute options and the first that fits, among those of less extra work than ``below``."""
        plan = cand.plan
        okey = (plan.schedule, plan.recompute_key, tuple(plan.layouts))
        if okey not in options_of:
            found = recompute_options(cost, plan, weights)
            options_of[okey] = found, [{m: _share(o, m) for m in plan.layouts} for o in found]
        options, shares = options_of[okey]
        peaks = recompute_peaks(cost, cand.plan, profile, shares, cand.fused, activations)
        if peaks[-1] > cap:  # recomputing everything does not fit: nothing less does
            return options, None
        return options, next((o for o, peak in zip(options, peaks) if _extra(o, weights) < below and peak <= cap),
                             None)

    def with_recompute(cand: Candidate, option: Recompute) -> Candidate:
        return replace(cand, plan=replace(cand.plan, recompute=option[0], recompute_fraction=option[1]))

    for cand in found:
        options, found_least = least(cand)
        yielded = found_least is not None
        if yielded:
            yield with_recompute(cand, found_least)
            yield from (with_recompute(cand, o) for o in options if _covers(o, found_least))
        # each further variant shards more, and matters only where it needs less recompute than
        # the least so far; those of a candidate that fits in no other way come with their covers
        below = _extra(found_least, weights) if yielded else float("inf")
        for variant in (sharded_everywhere(cost, cand.plan), resharded(cost, cand.plan)):
            if variant is None or below <= 0:
                continue
            alt = replace(cand, plan=variant)
            alt_options, alt_least = least(alt, below)
            if alt_least is None:
                continue
            yield with_recompute(alt, alt_least)
            if not yielded:
                yield from (with_recompute(alt, o) for o in alt_options if _covers(o, alt_least))
            yielded, below = True, _extra(alt_least, weights)
        if not yielded and rejected is not None:
            rejected["plan exceeds device memory (estimate)"] += 1


def _recipe_candidates(recipe: str, cost: CostModel, cluster: ClusterSpec, profile: BatchProfile,
                       global_batch: int, model: str, rejected: Counter | None = None) -> Iterator[Candidate]:
    """Every plan a recipe's rules allow whose LLM fits in memory (misfits counted in ``rejected``)."""
    world = cluster.world_size
    encoders = list(cost.mllm.encoders)
    training = {m: t.mode.value for m, t in cost.mllm.training.items()}

    def plan(layouts, placement, schedule, n_mb):
        return Plan(model, layouts, placement, schedule, n_mb, global_batch, training)

    if recipe == "megatron":
        for base, n_mb in _llm_options(cost, cluster, world, 0, global_batch, profile, False, rejected):
            if any(heads_split(cost.mllm.encoders[e].body, base.tp) != base.tp for e in encoders):
                continue  # Megatron-LM splits every encoder over the LLM's TP group, by whole heads
            first = tuple(base.rank_at(pp=0, dp=d, tp=t) for d in range(base.dp) for t in range(base.tp))
            layouts = {e: Layout(tp=base.tp, dp=base.dp, ranks=first) for e in encoders}
            for llm, schedule in _schedules(cost, base, n_mb, ("1f1b", "interleaved")):
                yield Candidate(recipe, plan({**layouts, "llm": llm}, Placement.COLOCATED, schedule, n_mb), fused=True)
    elif recipe == "cornstarch":
        for layouts, n_mb in _encoder_stage_layouts(cost, cluster, profile, global_batch, rejected):
            yield Candidate(recipe, plan(layouts, Placement.DISJOINT, "1f1b", n_mb))
    elif recipe in ("disttrain", "harmonia"):
        schedules = ("1f1b",) if recipe == "disttrain" else ("1f1b", "zb", "interleaved")
        for sizes in disjoint_sizes(profile, encoders, world):
            offset, enc_choices = 0, []
            for e in encoders:
                enc_choices.append(list(encoder_layouts(cost.mllm, e, cluster, sizes[e], offset))[:2])
                offset += sizes[e]
            options = _llm_options(cost, cluster, world - offset, offset, global_batch, profile, True, rejected)
            for base, n_mb in options:
                for combo in _product(enc_choices):
                    load = _microbatch_load(profile, global_batch, base.dp, n_mb)
                    for llm, schedule in _schedules(cost, base, n_mb, schedules, load):
                        layouts = dict(zip(encoders, combo))
                        yield Candidate(recipe, plan({**layouts, "llm": llm}, Placement.DISJOINT, schedule, n_mb))
        if recipe == "harmonia":
            for base, n_mb in _llm_options(cost, cluster, world, 0, global_batch, profile, True, rejected):
                load = _microbatch_load(profile, global_batch, base.dp, n_mb)
                for layouts in _colocated_encoders(cost, cluster, encoders, base.tp):
                    for llm, schedule in _schedules(cost, base, n_mb, schedules, load):
                        yield Candidate(recipe, plan({**layouts, "llm": llm}, Placement.COLOCATED, schedule, n_mb))
            # the other recipes' placements, so harmonia's rules contain theirs
            for layouts, n_mb in _encoder_stage_layouts(cost, cluster, profile, global_batch, rejected):
                load = _microbatch_load(profile, global_batch, layouts["llm"].dp, n_mb)
                for llm, schedule in _schedules(cost, layouts["llm"], n_mb, schedules, load):
                    yield Candidate(recipe, plan({**layouts, "llm": llm}, Placement.DISJOINT, schedule, n_mb))
            yield from _homogeneous(cost, cluster, profile, global_batch, model, rejected)
    else:
        raise ConfigError(f"unknown recipe {recipe!r}; recipes are {RECIPES}")


def _colocated_encoders(cost: CostModel, cluster: ClusterSpec, encoders: list[str],
                        llm_tp: int) -> Iterator[dict[str, Layout]]:
    """Encoders spread over every rank: data parallel, and also each with the LLM's TP degree where
    its heads allow it (a large encoder's states and activations split over its TP group)."""
    world = cluster.world_size
    plain = {e: Layout(dp=world) for e in encoders}
    yield plain
    fits = {e: llm_tp in tp_options(cost.mllm.encoders[e].body, cluster, world) for e in encoders}
    split = {e: Layout(tp=llm_tp, dp=world // llm_tp) if fits[e] else plain[e] for e in encoders}
    if split != plain:
        yield split


def _encoder_stage_layouts(cost: CostModel, cluster: ClusterSpec, profile: BatchProfile, global_batch: int,
                           rejected: Counter | None) -> Iterator[tuple[dict[str, Layout], int]]:
    """Cornstarch's shapes: each encoder on one or two pipeline stages of its own ranks with the
    LLM's tp and dp, then the LLM's stages (frozen-aware split), as (layouts, microbatches)."""
    world = cluster.world_size
    encoders = list(cost.mllm.encoders)
    for tp in sorted({lay.tp for lay in llm_layouts(cost, cluster, world, 0, global_batch, max_cp=1)}):
        for dp in (d for d in range(1, world // tp + 1) if world % (tp * d) == 0):
            group = tp * dp
            for enc_pp in (1, 2):
                llm_ranks = world - len(encoders) * enc_pp * group
                if llm_ranks < group:
                    continue
                offset = len(encoders) * enc_pp * group
                for llm, n_mb in _llm_options(cost, cluster, llm_ranks, offset, global_batch, profile, True, rejected):
                    if llm.tp != tp or llm.dp != dp:
                        continue
                    layouts = {e: _split_by_heads(cost, e, Layout(tp=tp, dp=dp, pp=enc_pp, rank_offset=i * enc_pp * group))
                               for i, e in enumerate(encoders)}
                    yield {**layouts, "llm": llm}, n_mb


def homogeneous_candidates(cost: CostModel, cluster: ClusterSpec, profile: BatchProfile, global_batch: int,
                           model: str, rejected: Counter | None = None) -> Iterator[Candidate]:
    """harmonia's plans restricted to one layout for all modules: every LLM factorisation that fits
    (frozen-aware split), each encoder on the LLM's first pipeline stage with the LLM's tp and dp;
    balanced per iteration, 1F1B or zero-bubble. The baseline that per-module layouts must beat."""
    found = _homogeneous(cost, cluster, profile, global_batch, model, rejected)
    return fitting(found, cost, cluster, profile, rejected)


def _homogeneous(cost: CostModel, cluster: ClusterSpec, profile: BatchProfile, global_batch: int,
                 model: str, rejected: Counter | None = None) -> Iterator[Candidate]:
    encoders = list(cost.mllm.encoders)
    training = {m: t.mode.value for m, t in cost.mllm.training.items()}
    for base, n_mb in _llm_options(cost, cluster, cluster.world_size, 0, global_batch, profile, True, rejected):
        first = tuple(base.rank_at(pp=0, dp=d, cp=c, tp=t) for d in range(base.dp) for c in range(base.cp)
                      for t in range(base.tp))
        layouts = {e: _split_by_heads(cost, e, Layout(tp=base.tp, dp=base.dp * base.cp, ranks=first)) for e in encoders}
        load = _microbatch_load(profile, global_batch, base.dp, n_mb)
        for llm, schedule in _schedules(cost, base, n_mb, ("1f1b", "zb", "interleaved"), load):
            yield Candidate("harmonia", Plan(model, {**layouts, "llm": llm}, Placement.COLOCATED, schedule, n_mb,
                                             global_batch, training))


def _split_by_heads(cost: CostModel, encoder: str, layout: Layout) -> Layout:
    """``layout`` with the encoder's TP degree lowered to what its heads allow (`heads_split`), the
    same ranks holding more data-parallel replicas (rank order: tp fastest, so each replica's ranks
    stay within one of the LLM's TP groups)."""
    tp = heads_split(cost.mllm.encoders[encoder].body, layout.tp)
    if tp == layout.tp:
        return layout
    return replace(layout, tp=tp, dp=layout.dp * layout.tp // tp)


def _product(choices: list[list[Layout]]) -> Iterator[tuple[Layout, ...]]:
    if not choices:
        yield ()
        return
    for first in choices[0]:
        for rest in _product(choices[1:]):
            yield (first, *rest)


def assign(candidate: Candidate, costs: np.ndarray, tokens: np.ndarray, cost: CostModel,
           shapes: Sequence[SampleShape] | None = None, kept: dict | None = None) -> IterationAssignment:
    """The recipe's assignment of a batch (``costs``: (n, modules) rows of its samples, columns
    ``cost.modules``): global microbatches as batch positions, split over the LLM replicas by the
    recipe's rule, and over each encoder's replicas by sample (`assemble_iteration`); harmonia's is
    the trainer's own (`assign_iteration`, then its colocated encoders' items cut evenly over the
    replicas feeding each LLM replica, `cut_encoder_items`, where the batch's ``shapes`` are given).
    ``kept``: what those keep between calls on the same batch and cost model (a search's)."""
    plan = candidate.plan
    dp, n_mb = plan.layouts["llm"].dp, plan.n_microbatches
    encoder_dp = {e: plan.layouts[e].dp for e in plan.encoders}
    feeds = {e: feeding_replicas(plan, e) for e in plan.encoders}
    columns, names = module_columns(costs, cost.modules, plan.encoders)
    positions = np.arange(len(costs))
    if candidate.recipe in ("megatron", "cornstarch", "disttrain"):
        per_replica = (assign_reordered(positions, costs, dp, n_mb) if candidate.recipe == "disttrain"
                       else assign_sequential(positions, dp, n_mb))
        out = assemble_iteration([per_replica[d] for d in range(dp)], columns, names, encoder_dp, feeds=feeds)
    else:
        balanced = assign_iteration(columns, names, dp, encoder_dp, n_mb, tokens=tokens, feeds=feeds, kept=kept)
        out = balanced if shapes is None else cut_encoder_items(balanced, plan, cost, shapes, kept)
    if kept is not None:  # sums of samples' loads, shared by the batch's assignments
        out.memo["batch loads"] = kept.setdefault("batch loads", {})
    return out


def assignment_key(candidate: Candidate) -> tuple:
    """What `assign` depends on besides the batch: two candidates with equal keys assign alike."""
    plan = candidate.plan
    feeds = tuple((e, plan.layouts[e].dp, tuple(map(tuple, feeding_replicas(plan, e)))) for e in plan.encoders)
    return candidate.recipe, plan.layouts["llm"].dp, plan.n_microbatches, feeds


def search_microbatch_order(plan: Plan, cost: CostModel, iw: IterationWork, budget_s: float,
                           rate: ReplayRate | None = None, step: OrderStep | None = None) -> SearchResult:
    """The per-batch search's microbatch order for one iteration's stage work, within ``budget_s``
    (every LLM replica runs it: one schedule serves all of them; `search_batch_order`)."""
    return search_batch_order(plan, cost, iw, budget_s, rate, step)


def simulate(candidate: Candidate, samples: list[SampleShape], batch: np.ndarray, costs: np.ndarray,
             tokens: np.ndarray, cost: CostModel, cluster: ClusterSpec, search_budget_s: float = 0.1,
             sub_options: Sequence[int] = SUB_OPTIONS) -> Timeline:
    """Simulate one iteration of ``batch`` (indices into ``samples``) under a candidate."""
    shapes = [samples[i] for i in batch]
    iw = plan_iteration_work(shapes, candidate.plan, cost, assign(candidate, costs, tokens, cost, shapes))
    return simulate_work(candidate, iw, cost, cluster, search_budget_s, sub_options)


def simulate_work(candidate: Candidate, iw: IterationWork, cost: CostModel, cluster: ClusterSpec,
                  search_budget_s: float = 0.1, sub_options: Sequence[int] = SUB_OPTIONS) -> Timeline:
    """The second half of `simulate`: order an iteration's stage work and time every rank's action list.

    harmonia runs the trainer's per-batch search when ``search_budget_s > 0``: the microbatch order
    within the budget, then each encoder's sub-microbatch count among ``sub_options``, scored by
    this simulator (a fixed number of simulations); the planner's scores (budget 0) and the other
    recipes keep the balancer's order, unsplit.
    """
    plan = candidate.plan

    def schedule_of(order: list[int] | None, work: IterationWork = iw) -> IterationSchedule:
        return candidate_schedule(candidate, cost, work, order)

    if candidate.recipe != "harmonia" or search_budget_s <= 0:
        return simulate_schedule(plan, cost, cluster, iw, schedule_of(None))
    steps = SimulatedOrders(plan, cost, cluster, iw, schedule_of)  # the search's pick only where faster here
    order = search_microbatch_order(plan, cost, iw, search_budget_s, step=steps).order
    if len(sub_options) > 1 and plan.encoders:
        graph = plan_graph(plan, cost)
        iw = search_submicrobatches(graph, plan, cost, iw, order, sub_options,
                                    score=simulated_step(plan, cost, cluster)).work
    if iw is steps.work:
        return steps.timeline(order)
    return simulate_schedule(plan, cost, cluster, iw, schedule_of(order, iw))


def candidate_schedule(candidate: Candidate, cost: CostModel, iw: IterationWork,
                       order: list[int] | None = None) -> IterationSchedule:
    """The schedule a candidate runs an iteration's stage work under: its plan's family in ``order``
    (default: the balancer's), the encoders' actions fused into the LLM's first stage where the
    recipe places them there."""
    schedule = iteration_schedule(candidate.plan, cost, iw, order=order)
    return fuse_encoders(schedule) if candidate.fused else schedule


def with_schedule(candidate: Candidate, schedule: str) -> Candidate:
    return replace(candidate, plan=replace(candidate.plan, schedule=schedule))
