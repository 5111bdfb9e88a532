"""Durations and bytes of every stage's work for one iteration, from the cost model.

Given a plan (layouts, stage splits), the cost model and the iteration's assignment
(`harmonia.schedule.iteration.IterationAssignment`: global microbatches, the LLM replicas' and every
encoder's split of them, by sample), this computes for every ``(module, replica, stage, microbatch,
sub-microbatch)`` the F, B and W seconds on one rank of that stage's TP x CP group, the activation
bytes the unit keeps there, the bytes sent to the next stage, and the boundary bytes each encoder
replica sends each LLM replica. A module in ``plan.recompute`` keeps only its blocks' inputs and runs
their forward again in B (`harmonia.workload.cost`).

The work is exactly what the executor runs: LLM replica ``d`` packs its samples of global
microbatch ``m``; encoder replica ``e`` encodes its samples of ``m`` (of every LLM replica it feeds,
at once), cut into the schedule's sub-microbatches as contiguous runs of its items balanced on the
items' cost (`harmonia.schedule.submicrobatch.item_runs`); `IterationWork.sub_runs` records the
runs, which the executor's inputs are cut by (`harmonia.runtime.mllm_inputs.build_rank_batch`).

`cost_table` turns it into the durations the schedule is ordered with: one schedule serves every
LLM replica, so each stage and microbatch takes the slowest replica's work.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from harmonia.schedule.costs import CostTable, PhaseCost
from harmonia.schedule.encoder_slots import movable_encoders
from harmonia.schedule.families import build_schedule
from harmonia.schedule.graph import LLM, IterationSchedule, StageGraph, colocated_holders_by_replica, fused_backward
from harmonia.schedule.item_cuts import cut_item, encoder_items, item_seconds, kept_parts
from harmonia.schedule.iteration import IterationAssignment
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.submicrobatch import item_runs
from harmonia.workload.cost import CostModel, PhaseTimes
from harmonia.workload.shapes import SampleShape, encoder_sequences, llm_tokens_of_item
from harmonia.workload.work import ModuleLoad

NO_WORK = PhaseCost(0.0, 0.0, 0.0)


class StageKey(NamedTuple):
    """One stage chunk of one replica of a module (a named tuple: the key of every unit's work,
    hashed millions of times in a search)."""

    module: str
    replica: int
    stage: int


WorkKey = tuple[StageKey, int, "int | None"]
"""(stage chunk of a replica, global microbatch, sub-microbatch or None)."""


@dataclass(slots=True)
class MicrobatchWork:
    """What a stage does for one microbatch (or encoder sub-microbatch)."""

    times: PhaseTimes
    act_bytes: float = 0.0
    send_bytes: float = 0.0  # activations to the next stage (gradients back are the same size)
    flops: float = 0.0  # useful FLOPs on one rank of the stage's TP x CP group
    tokens: int = 0
    transient: float = 0.0  # bytes held only during the backward: a block's gradients (and recomputed activations)
    f_transient: float = 0.0  # bytes held only during the forward beyond what it keeps: a block's intermediates
    w_held: float = 0.0  # bytes a split backward keeps from B until W beside the activations (`wgrad_bytes`)
    w_transient: float = 0.0  # bytes a split backward's W holds while it runs (`w_transient_bytes`)


@dataclass
class IterationWork:
    """All stage work of one iteration.

    Attributes:
        assignment: the iteration's samples: global microbatches and their replica splits.
        shapes: the batch's sample shapes (the assignment's positions index them).
        n_sub: encoder -> sub-microbatches of each global microbatch (absent: 1).
        work: (stage key, microbatch, sub) -> work, for every unit with something to do (an encoder
            replica without items in a unit has no entry: it does nothing there).
        boundary_bytes: (encoder, encoder replica, LLM replica, microbatch) -> bytes of rows.
        stage_ranks: stage key -> the ranks (TP x CP group) that run it.
        sub_runs: (encoder, encoder replica, microbatch) -> its items' runs ``[a, b)``, one per
            sub-microbatch (only where the microbatch is split).
        llm_slowest: (LLM chunk, microbatch) -> the largest F, B and W seconds over every LLM
            replica, where ``work`` holds some replicas' LLM units alone (`llm_replicas_work`):
            what `cost_table` takes for the LLM (None: from ``work``).
    """

    assignment: IterationAssignment
    shapes: Sequence[SampleShape] = ()
    n_sub: dict[str, tuple[int, ...]] = field(default_factory=dict)
    work: dict[WorkKey, MicrobatchWork] = field(default_factory=dict)
    boundary_bytes: dict[tuple[str, int, int, int], float] = field(default_factory=dict)
    stage_ranks: dict[StageKey, tuple[int, ...]] = field(default_factory=dict)
    sub_runs: dict[tuple[str, int, int], list[tuple[int, int]]] = field(default_factory=dict)
    llm_slowest: dict[tuple[int, int], tuple[float, float, float]] | None = None

    @property
    def n_microbatches(self) -> int:
        return self.assignment.n_microbatches

    def subs(self, module: str, m: int) -> list[int | None]:
        """Sub-microbatch indices of microbatch ``m`` on ``module`` (``[None]`` when not split)."""
        n = self.n_sub.get(module, ())
        count = n[m] if n else 1
        return [None] if count == 1 else list(range(count))

    def unit(self, key: StageKey, m: int, sub: int | None) -> MicrobatchWork | None:
        """The work of one unit, None where the replica has nothing to do."""
        return self.work.get((key, m, sub))


def stage_layer_range(cost: CostModel, plan: Plan, module: str, stage: int) -> tuple[int, int]:
    """Cost-model layer indices [start, stop) of a stage chunk; the front end joins stage 0 and the
    post layer (head, final norm) the last stage."""
    return layout_layer_range(cost, plan.layouts[module], module, stage)


def layout_layer_range(cost: CostModel, layout: Layout, module: str, stage: int) -> tuple[int, int]:
    """`stage_layer_range` of a module's layout."""
    n_blocks = len(cost.layers[module]) - 2
    split = layout.stage_split(n_blocks)
    start = 1 + sum(split[:stage])
    stop = start + split[stage]
    if stage == 0:
        start = 0
    if stage == layout.n_stages - 1:
        stop = len(cost.layers[module])
    return start, stop


def stage_ranks(plan: Plan, module: str, replica: int, chunk: int) -> tuple[int, ...]:
    """The TP x CP group running a replica's stage chunk (chunk ``c`` on pipeline rank ``c % pp``)."""
    return _layout_stage_ranks(plan.layouts[module], replica, chunk % plan.layouts[module].pp)


@functools.lru_cache(maxsize=1 << 16)
def _layout_stage_ranks(layout: Layout, replica: int, pp: int) -> tuple[int, ...]:
    """`stage_ranks` of a layout (kept: a pure function every stage work and task asks again)."""
    return tuple(layout.rank_at(pp=pp, dp=replica, cp=c, tp=t) for c in range(layout.cp) for t in range(layout.tp))


def _replica_items(iw: IterationWork, cost: CostModel, encoder: str, m: int, replica: int,
                   positions: Sequence[int]) -> list:
    """The items one encoder replica runs in microbatch ``m``, in order: each sample's items of the
    encoder, or the part of them its share keeps (`harmonia.schedule.item_cuts`)."""
    memo = _memo(iw, cost, encoder)
    key = ("items", m, replica, tuple(positions))
    if key not in memo:
        spec, samples = cost.mllm.encoders[encoder], iw.assignment.microbatches[m]
        out = []
        for p in positions:
            items = encoder_items(iw.shapes[samples[p]], spec)
            share = iw.assignment.cut(encoder, m, replica, p)
            out += [cut_item(items[k], spec, a, b) for k, a, b in kept_parts(len(items), share)]
        memo[key] = out
    return memo[key]


def _memo(iw: IterationWork, cost: CostModel, encoder: str) -> dict:
    """The assignment's kept items and loads of one encoder (`IterationAssignment.memo`), started
    afresh when another encoder spec prices it (items and loads depend on the spec alone)."""
    spec = cost.mllm.encoders[encoder]
    kept = iw.assignment.memo.get(encoder)
    if kept is None or kept[0] is not spec:
        kept = iw.assignment.memo[encoder] = (spec, {})
    return kept[1]


def _item_load(cost: CostModel, encoder: str, items: list) -> tuple[ModuleLoad, ModuleLoad]:
    spec = cost.mllm.encoders[encoder]
    enc, proj = ModuleLoad(), ModuleLoad()
    for item in items:
        seqs = encoder_sequences(item, spec)
        enc += ModuleLoad(sum(seqs), sum(n * n for n in seqs), len(seqs))
        proj += ModuleLoad(llm_tokens_of_item(item, spec), 0, 1)
    return enc, proj


def plan_iteration_work(shapes: Sequence[SampleShape], plan: Plan, cost: CostModel, assignment: IterationAssignment,
                        n_sub: Mapping[str, Sequence[int]] | None = None,
                        sub_runs: Mapping[tuple[str, int, int], list[tuple[int, int]]] | None = None,
                        replicas: Mapping[str, Collection[int]] | None = None) -> IterationWork:
    """Stage work of every module for an iteration (see the module docstring).

    Args:
        shapes: the batch's sample shapes; the assignment's positions index them.
        plan: layouts and recompute.
        cost: the cost model.
        assignment: global microbatches and their LLM and encoder replica splits.
        n_sub: encoder -> sub-microbatches per microbatch (the schedule's ``n_sub``; default 1).
        sub_runs: the split items' runs to use (another cost model's `IterationWork.sub_runs`, so a
            calibrated simulation prices the cut the executor runs); default: cut by ``cost``.
        replicas: per module, the replicas whose units are priced (default, or a module left out:
            every one; the boundary bytes are always whole). A bound on the work of some replicas
            is a bound on the whole (`harmonia.plan.bounds.work_bound_busy`), found without pricing
            the thousands of units of a large cluster's other replicas.
    """
    out = IterationWork(assignment, shapes, {e: tuple(v) for e, v in (n_sub or {}).items()})
    llm_chunks = _module_chunks(cost, plan, LLM)
    loads = [cost.sample_loads(s) for s in shapes]  # per module, of each sample of the batch
    llm_loads = _llm_loads(assignment, cost, loads)
    _add_llm_work(out, plan, cost, llm_chunks, [
        (d, m, load) for m, per_replica in enumerate(llm_loads) for d, load in enumerate(per_replica)
        if replicas is None or LLM not in replicas or d in replicas[LLM]])
    key = ("boundary bytes", cost, tuple(plan.encoders))  # the assignment's alone: kept for the next plan
    if key not in assignment.memo:
        assignment.memo[key] = _boundary_bytes(assignment, plan, cost, loads)
    out.boundary_bytes.update(assignment.memo[key])
    for enc in plan.encoders:
        if sub_runs:
            _add_encoder_work(out, plan, cost, enc, sub_runs, loads)
        else:
            _kept_encoder_work(out, plan, cost, enc, loads, None if replicas is None else replicas.get(enc))
    return out


def llm_replicas_work(shapes: Sequence[SampleShape], plan: Plan, cost: CostModel, assignment: IterationAssignment,
                      replicas: Collection[int]) -> IterationWork:
    """`plan_iteration_work` with the LLM units of ``replicas`` alone (every encoder's whole) and
    every LLM replica's times in `IterationWork.llm_slowest`: the same schedule (`cost_table`) and
    the same work on those replicas' ranks, without a unit object for each of the thousands of LLM
    units of a large cluster's other replicas (a search simulates a busiest column this way)."""
    out = plan_iteration_work(shapes, plan, cost, assignment, replicas={LLM: replicas})
    out.llm_slowest = _llm_slowest(plan, cost, _llm_loads(assignment, cost, ()))  # kept by the call above
    return out


def _llm_slowest(plan: Plan, cost: CostModel,
                 llm_loads: list[list[ModuleLoad]]) -> dict[tuple[int, int], tuple[float, float, float]]:
    """(chunk, microbatch) -> the largest F, B and W seconds of the LLM replicas' units, priced as
    `_add_llm_work` prices them (`CostModel.unit_times`: the same floats) over every replica at once."""
    layout = plan.layouts[LLM]
    recompute, n_m = plan.recompute_share(LLM), len(llm_loads)
    loads = [load for per_replica in llm_loads for load in per_replica]  # microbatch-major
    ends = np.cumsum([len(per_replica) for per_replica in llm_loads])
    out = {}
    for chunk, (start, stop, _) in enumerate(_module_chunks(cost, plan, LLM)):
        phases = cost.unit_times(LLM, loads, start, stop, layout.tp, layout.cp, recompute)
        per_m = [np.split(np.asarray(t, dtype=float), ends[:-1]) for t in phases]  # per phase, per microbatch
        for m in range(n_m):
            if len(per_m[0][m]):
                out[(chunk, m)] = (float(per_m[0][m].max()), float(per_m[1][m].max()), float(per_m[2][m].max()))
    return out


def _llm_loads(assignment: IterationAssignment, cost: CostModel,
               loads: Sequence[dict[str, ModuleLoad]]) -> list[list[ModuleLoad]]:
    """Per microbatch, each LLM replica's load (kept on the assignment: every plan sharing it asks)."""
    key = ("llm loads", cost)
    if key not in assignment.memo:
        assignment.memo[key] = [[ModuleLoad.total(loads[samples[p]][LLM] for p in positions)
                                 for positions in assignment.llm_split[m]]
                                for m, samples in enumerate(assignment.microbatches)]
    return assignment.memo[key]


def _boundary_bytes(assignment: IterationAssignment, plan: Plan, cost: CostModel,
                    loads: Sequence[dict[str, ModuleLoad]]) -> dict[tuple[str, int, int, int], float]:
    """(encoder, encoder replica, LLM replica, microbatch) -> bytes of the rows the encoder replica
    sends the LLM replica packing each of its samples (or shares of them) in the microbatch."""
    out: dict[tuple[str, int, int, int], float] = {}
    h_llm = cost.mllm.llm.hidden
    for m, samples in enumerate(assignment.microbatches):
        owner = {p: d for d, positions in enumerate(assignment.llm_split[m]) for p in positions}
        for enc in plan.encoders:
            every = assignment.encoder_cuts.get(enc)
            cuts = every[m] if every else {}
            for e, positions in enumerate(assignment.encoder_split[enc][m]):
                for p in positions:  # this replica's samples (or shares), to the replica packing each
                    share = cuts.get((e, p)) if cuts else None
                    rows = loads[samples[p]][f"{enc}_proj"].tokens if share is None else share[2]
                    if rows:  # each row: an LLM token, and its DeepStack features where the projector adds them
                        key = (enc, e, owner[p], m)
                        width = h_llm * (1 + cost.mllm.projectors[f"{enc}_proj"].deepstack)
                        out[key] = out.get(key, 0.0) + rows * width * cost.act_bytes
    return out


def _kept_encoder_work(out: IterationWork, plan: Plan, cost: CostModel, enc: str,
                       loads: Sequence[dict[str, ModuleLoad]], replicas: Collection[int] | None = None) -> None:
    """`_add_encoder_work`, or its entries kept on the assignment from an earlier plan with the same
    encoder layout, recomputation and sub-microbatches priced by the same cost model (plans that
    differ in the LLM's layout alone share an assignment and so every encoder unit); only those of
    ``replicas`` where given."""
    key = ("encoder work", cost, enc, plan.layouts[enc], plan.recompute_share(enc), out.n_sub.get(enc))
    kept = out.assignment.memo.get(key)
    if kept is None and replicas is not None:  # a few replicas' units: priced, not kept
        _add_encoder_work(out, plan, cost, enc, {}, loads, replicas)
        return
    if kept is None:
        part = IterationWork(out.assignment, out.shapes, out.n_sub)
        _add_encoder_work(part, plan, cost, enc, {}, loads)
        by_replica: dict[int, dict[WorkKey, MicrobatchWork]] = {}
        for unit, w in part.work.items():
            by_replica.setdefault(unit[0].replica, {})[unit] = w
        kept = out.assignment.memo[key] = (part.work, part.stage_ranks, part.sub_runs, by_replica)
    work, ranks, runs, by_replica = kept
    if replicas is None:
        out.work.update(work)
    else:
        for e in replicas:
            out.work.update(by_replica.get(e, {}))
    out.stage_ranks.update(ranks)
    out.sub_runs.update(runs)


def with_submicrobatches(iw: IterationWork, plan: Plan, cost: CostModel, encoder: str,
                         counts: Sequence[int]) -> IterationWork:
    """A copy of ``iw`` with ``encoder``'s microbatches split into ``counts[m]`` sub-microbatches (its
    work priced again; every other module's shared)."""
    out = replace(iw, n_sub={**iw.n_sub, encoder: tuple(counts)},
                  work={k: w for k, w in iw.work.items() if k[0].module != encoder},
                  sub_runs={k: r for k, r in iw.sub_runs.items() if k[0] != encoder})
    _add_encoder_work(out, plan, cost, encoder, {}, [cost.sample_loads(s) for s in iw.shapes])
    return out


def _add_encoder_work(out: IterationWork, plan: Plan, cost: CostModel, enc: str,
                      sub_runs: Mapping[tuple[str, int, int], list[tuple[int, int]]],
                      loads: Sequence[dict[str, ModuleLoad]], replicas: Collection[int] | None = None) -> None:
    """Each replica's (or each of ``replicas``') items of every microbatch, cut into the microbatch's
    sub-microbatches by cost; ``loads``: the batch's `CostModel.sample_loads`, in sample order."""
    assignment, chunks = out.assignment, _module_chunks(cost, plan, enc)
    every = assignment.encoder_cuts.get(enc)
    for m, samples in enumerate(assignment.microbatches):
        subs = out.subs(enc, m)
        cuts = every[m] if every else {}
        for e, positions in enumerate(assignment.encoder_split[enc][m]):
            if replicas is not None and e not in replicas:
                continue
            if len(subs) == 1:  # the samples' loads summed (what their items' loads sum to), and the shares'
                if not positions:  # nothing to encode (most replicas of a wide encoder, per microbatch)
                    continue
                enc_load, proj_load = _replica_load(out, cost, enc, loads, m, e, cuts)
                if proj_load.sequences:  # one per item
                    _add_module_work(out, plan, cost, enc, chunks, e, m, None, enc_load, proj_load)
                continue
            items = _replica_items(out, cost, enc, m, e, positions)
            runs = sub_runs.get((enc, e, m)) or item_runs(item_seconds(cost, enc, items), len(subs))
            out.sub_runs[(enc, e, m)] = list(runs)
            for sub, (a, b) in zip(subs, runs):
                if a < b:
                    enc_load, proj_load = _item_load(cost, enc, items[a:b])
                    _add_module_work(out, plan, cost, enc, chunks, e, m, sub, enc_load, proj_load)


def _replica_load(out: IterationWork, cost: CostModel, enc: str, loads: Sequence[dict[str, ModuleLoad]], m: int,
                  e: int, cuts: Mapping) -> tuple[ModuleLoad, ModuleLoad]:
    """An encoder replica's load and its projector's in microbatch ``m``: its whole samples' loads
    summed, and its shares' (each sample's share priced from the items it keeps). Both are kept for
    the batch (`IterationAssignment.memo`'s ``batch loads``, shared by a search's assignments of one
    batch; else the assignment's own): the sums of whole samples per set of samples, and each
    (sample, share)'s load. Assignments of one batch deal the same samples together and cut the same
    shares again and again (1.0M replicas' loads of an omni-72b search on 1,024 GPUs, 48k distinct).
    Loads are integer counts, so the sums are those of the items in any order."""
    positions, samples = out.assignment.encoder_split[enc][m][e], out.assignment.microbatches[m]
    whole = [p for p in positions if (e, p) not in cuts] if cuts else positions
    spec = cost.mllm.encoders[enc]
    batch = out.assignment.memo.get("batch loads")
    batch = batch if batch is not None else out.assignment.memo
    found = batch.get(("sample sums", enc))
    if found is None or found[0] is not spec:  # sums of another spec's loads are not these
        found = batch[("sample sums", enc)] = (spec, {})
        batch[("share loads", enc)] = (spec, {})
    kept = found[1]
    key = tuple(samples[p] for p in whole)
    if key not in kept:
        mine = [loads[i] for i in key]
        kept[key] = (ModuleLoad.total(load[enc] for load in mine),
                     ModuleLoad.total(load[f"{enc}_proj"] for load in mine))
    enc_load, proj_load = kept[key]
    if len(whole) < len(positions):
        shares = batch[("share loads", enc)][1]
        for p in positions:
            if (e, p) not in cuts:
                continue
            share = (samples[p], cuts[(e, p)])
            if share not in shares:
                items = encoder_items(out.shapes[samples[p]], spec)
                shares[share] = _item_load(cost, enc, [cut_item(items[k], spec, a, b)
                                                       for k, a, b in kept_parts(len(items), cuts[(e, p)])])
            enc_load, proj_load = enc_load + shares[share][0], proj_load + shares[share][1]
    return enc_load, proj_load


def chunk_ranges(cost: CostModel, plan: Plan, module: str) -> list[tuple[int, int]]:
    """`stage_layer_range` of every stage chunk of a module."""
    return [stage_layer_range(cost, plan, module, c) for c in range(plan.layouts[module].n_stages)]


def _module_chunks(cost: CostModel, plan: Plan, module: str) -> list[tuple[int, int, float]]:
    """Per stage chunk of a module: its layer range (`chunk_ranges`) and the bytes per token it sends
    to the next chunk, which the TP x CP group's ranks share (0 for the last)."""
    ranges = chunk_ranges(cost, plan, module)
    # cost-model layer ``stop`` is block ``stop - 1`` (the front end is layer 0): the next chunk's first block
    return [(start, stop, 0.0 if c == len(ranges) - 1 else _send_width(cost, module, stop - 1) * cost.act_bytes)
            for c, (start, stop) in enumerate(ranges)]


def _add_module_work(out: IterationWork, plan: Plan, cost: CostModel, module: str,
                     chunks: list[tuple[int, int, float]], replica: int, m: int, sub: int | None, load: ModuleLoad,
                     proj_load: ModuleLoad) -> None:
    """One replica's unit of microbatch ``m`` (sub-microbatch ``sub``) on every stage chunk of a
    module; ``chunks``: its chunks' layer ranges and sends (`_module_chunks`)."""
    layout = plan.layouts[module]
    tp, cp = layout.tp, layout.cp
    recompute = plan.recompute_share(module)
    tokens, group = load.tokens, tp * cp
    for chunk, (start, stop, send_bytes) in enumerate(chunks):
        last = chunk == len(chunks) - 1
        # the projector runs on the encoder's last stage
        times, flops, act, transient, f_transient = cost.unit_cost(
            module, load, start, stop, tp, cp, recompute, proj_load if last and module != LLM else None)
        key = StageKey(module, replica, chunk)
        if key not in out.stage_ranks:
            out.stage_ranks[key] = stage_ranks(plan, module, replica, chunk)
        held = cost.wgrad_bytes(module, tokens, start, stop, tp, cp)  # what a split B keeps for W
        w_made = cost.w_transient_bytes(module, start, stop, tp)  # what W holds while it runs
        if last and module != LLM and f"{module}_proj" in cost.layers:
            held += cost.wgrad_bytes(f"{module}_proj", proj_load.tokens, cp=cp)  # whole per TP rank
            w_made = max(w_made, cost.w_transient_bytes(f"{module}_proj"))
        out.work[(key, m, sub)] = MicrobatchWork(times, act, tokens * send_bytes / group, flops / group, tokens,
                                                 transient, f_transient, held, w_made)


def _add_llm_work(out: IterationWork, plan: Plan, cost: CostModel, chunks: list[tuple[int, int, float]],
                  units: list[tuple[int, int, ModuleLoad]]) -> None:
    """`_add_module_work` of the LLM's (replica, microbatch, load) units, in that order: each chunk's
    units priced in one pass (`CostModel.unit_costs`, the same numbers)."""
    layout = plan.layouts[LLM]
    tp, cp = layout.tp, layout.cp
    recompute, group = plan.recompute_share(LLM), tp * cp
    loads = [load for _, _, load in units]
    priced = [cost.unit_costs(LLM, loads, start, stop, tp, cp, recompute) for start, stop, _ in chunks]
    # kept for W per token (linear in the tokens) and W's transient, per chunk
    w_terms = [(cost.wgrad_bytes(LLM, 1, start, stop, tp, cp), cost.w_transient_bytes(LLM, start, stop, tp))
               for start, stop, _ in chunks]
    keys: dict[int, list[StageKey]] = {}  # replica -> its chunks' keys, their ranks recorded once
    sends = [send_bytes for _, _, send_bytes in chunks]
    work = out.work
    for i, (replica, m, load) in enumerate(units):
        mine = keys.get(replica)
        if mine is None:
            mine = keys[replica] = [StageKey(LLM, replica, chunk) for chunk in range(len(chunks))]
            for chunk, key in enumerate(mine):
                if key not in out.stage_ranks:
                    out.stage_ranks[key] = stage_ranks(plan, LLM, replica, chunk)
        tokens = load.tokens
        for chunk, key in enumerate(mine):
            times, flops, act, transient, f_transient = priced[chunk][i]
            per_token, w_made = w_terms[chunk]
            work[(key, m, None)] = MicrobatchWork(times, act, tokens * sends[chunk] / group, flops / group, tokens,
                                                  transient, f_transient, per_token * tokens, w_made)


def _send_width(cost: CostModel, module: str, next_block: int) -> int:
    """Values per token an inner stage chunk sends to the chunk starting at block ``next_block``: the
    LLM's hidden state, or an encoder's with the earlier blocks' outputs its later stages still need
    (`harmonia.model.spec.EncoderSpec.carried_taps`)."""
    if module == LLM:
        return cost.mllm.llm.hidden
    spec = cost.mllm.encoders[module]
    return spec.body.hidden * (1 + len(spec.carried_taps(next_block)))


def plan_graph(plan: Plan, cost: CostModel) -> StageGraph:
    """One LLM replica's stage graph of ``plan`` as the runtime builds it (`harmonia.train.rank.schedule_graph`):
    trainable chunks from the cost model's spec, fused backwards by `fused_backward`."""
    return StageGraph.from_layouts(plan.layouts, stage_trainable(plan, cost),
                                   fused=fused_backward(plan.layouts, cost.mllm.llm.tie_embeddings))


def stage_trainable(plan: Plan, cost: CostModel) -> dict[str, tuple[bool, ...]]:
    """Per module, whether each stage chunk has trainable weights (projectors count on the encoder's
    last chunk)."""
    out = {}
    for module, layout in plan.layouts.items():
        flags = []
        for chunk in range(layout.n_stages):
            start, stop = stage_layer_range(cost, plan, module, chunk)
            trains = cost.param_count(module, start, stop)[1] > 0
            if module != LLM and chunk == layout.n_stages - 1:
                trains = trains or cost.param_count(f"{module}_proj")[1] > 0
            flags.append(trains)
        out[module] = tuple(flags)
    return out


def cost_table(plan: Plan, iw: IterationWork) -> CostTable:
    """The durations one schedule for every LLM replica is ordered with: per stage, microbatch and
    sub-microbatch, the slowest replica's work (every replica runs the schedule's order, so the
    slowest one sets each step); a colocated encoder stage held by several LLM ranks, on each
    holder, the slowest encoder replica on the ranks of that holder's pipeline position in any
    LLM replica."""
    slowest = _slowest_units(iw)
    entries = {}
    for m in range(iw.n_microbatches):
        for module, layout in plan.layouts.items():
            for chunk in range(layout.n_stages):
                for sub in iw.subs(module, m):
                    phases = slowest.get((module, chunk, m, sub))
                    entries[(module, chunk, m, sub)] = NO_WORK if phases is None else PhaseCost(*phases)
    return CostTable(entries, shares=_share_costs(plan, iw), replicas=_replica_costs(plan, iw))


def _slowest_units(iw: IterationWork) -> dict[tuple[str, int, int, int | None], list[float]]:
    """(module, chunk, microbatch, sub) -> the largest F, B and W seconds over the replicas with
    work there: one pass over the units (a replica with nothing to do has no unit; an encoder of
    thousands of replicas has work on few of them per microbatch), the LLM's from
    `IterationWork.llm_slowest` where that holds them."""
    out: dict[tuple[str, int, int, int | None], list[float]] = {}
    for (chunk, m), phases in (iw.llm_slowest or {}).items():  # every replica's, some of whose units follow
        out[(LLM, chunk, m, None)] = list(phases)
    for (key, m, sub), w in iw.work.items():
        t = w.times
        phases = out.get((key.module, key.stage, m, sub))
        if phases is None:
            out[(key.module, key.stage, m, sub)] = [t.F, t.B, t.W]
            continue
        if t.F > phases[0]:
            phases[0] = t.F
        if t.B > phases[1]:
            phases[1] = t.B
        if t.W > phases[2]:
            phases[2] = t.W
    return out


def _replica_costs(plan: Plan, iw: IterationWork) -> dict:
    """Each unit's own durations on the encoders whose forwards every rank places by them."""
    movable = set(movable_encoders(plan.layouts, plan.encoders))
    return {(key.module, key.replica, key.stage, m, sub): PhaseCost(w.times.F, w.times.B, w.times.W)
            for (key, m, sub), w in iw.work.items() if key.module in movable}


def _share_costs(plan: Plan, iw: IterationWork) -> dict:
    """(holder rank, encoder, chunk, microbatch) -> the holder's share, for colocated encoder stages
    held by several LLM ranks of replica 0's graph (a holder stands for its pipeline position)."""
    llm = plan.layouts[LLM]
    out = {}
    for enc in plan.encoders:
        for chunk in range(plan.layouts[enc].n_stages):
            every = colocated_holders_by_replica(plan.layouts, enc, chunk) or {}
            if len(every.get(0, ())) < 2:
                continue
            by_position: dict[int, list[int]] = {}
            for d in range(llm.dp):
                for rank, replicas in every.get(d, {}).items():
                    by_position.setdefault(llm.coords(rank)["pp"], []).extend(replicas)
            totals = _whole_units(iw, enc, chunk)
            for pp, replicas in by_position.items():
                holder = llm.rank_at(pp=pp, dp=0)
                order = {e: i for i, e in enumerate(replicas)}
                for m in range(iw.n_microbatches):
                    out[(holder, enc, chunk, m)] = _whole_slowest(totals.get(m, {}), order)
    return out


def _whole_units(iw: IterationWork, enc: str, chunk: int) -> dict[int, dict[int, tuple[float, float, float]]]:
    """Microbatch -> encoder replica -> its whole microbatch's F, B and W seconds on ``chunk`` (its
    sub-microbatches summed in order), for the replicas with work there: one pass over the units."""
    parts: dict[int, dict[int, list]] = {}
    for (key, m, _), w in iw.work.items():  # a replica's sub-microbatches in order
        if key.module == enc and key.stage == chunk:
            parts.setdefault(m, {}).setdefault(key.replica, []).append(w.times)
    return {m: {e: (sum(t.F for t in ts), sum(t.B for t in ts), sum(t.W for t in ts)) for e, ts in per_e.items()}
            for m, per_e in parts.items()}


def _whole_slowest(totals: Mapping[int, tuple[float, float, float]], order: Mapping[int, int]) -> PhaseCost:
    """The slowest of ``order``'s replicas' whole microbatches in ``totals`` (the first in ``order``
    among equals; none with work: no work): a holder's share is split over the sub-microbatches
    like a microbatch entry."""
    best, most, first = (0.0, 0.0, 0.0), 0.0, len(order)
    for e, total in totals.items():
        i = order.get(e)
        if i is None:
            continue
        seconds = total[0] + total[1] + total[2]
        if seconds > most or (seconds == most and seconds > 0 and i < first):
            best, most, first = total, seconds, i
    return PhaseCost(*best)


def iteration_schedule(plan: Plan, cost: CostModel, iw: IterationWork, family: str | None = None,
                       order: Sequence[int] | None = None) -> IterationSchedule:
    """The schedule an iteration's stage work runs under: the plan's family (or ``family``) on replica
    0's stage graph (trainability from the cost model), ordered with `cost_table`."""
    graph = plan_graph(plan, cost)
    return build_schedule(graph, iw.n_microbatches, family or plan.schedule, order=order, costs=cost_table(plan, iw),
                          n_sub=iw.n_sub or None)
