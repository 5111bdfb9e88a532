"""Durations and bytes of every stage's work for one iteration's microbatches.

Given a plan (layouts, stage splits), the cost model and the iteration's assignment — for each LLM
DP replica, its microbatches as lists of sample indices — this computes, for every
``(module, replica, stage, microbatch)``, the F, B and W seconds on one rank of that stage's TP x CP
group, the activation bytes the microbatch keeps there, the bytes sent to the next stage, and the
boundary bytes an encoder's last stage sends to the LLM's first stage. A module in
``plan.recompute`` keeps only its blocks' inputs and runs their forward again in B
(`harmonia.workload.cost`).

Encoder replicas and LLM replicas are matched by rank when every encoder replica lies inside one
LLM replica's ranks (colocated encoders): LLM replica ``d`` is fed by the encoder replicas on its
own ranks, so its pipeline never waits for encoder work queued behind another replica's LLM work,
and boundary rows stay on the replica's ranks. Otherwise they are matched round-robin: with
``enc_dp >= llm_dp`` LLM replica ``d`` is fed by encoder replicas ``{e : e % llm_dp == d}``; with
``enc_dp < llm_dp`` encoder replica ``e`` serves LLM replicas ``{d : d % enc_dp == e}`` one
microbatch after another. The replicas feeding one microbatch split its items largest first onto
the replica least loaded so far this iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harmonia.schedule.costs import CostTable, PhaseCost
from harmonia.schedule.graph import LLM, colocated_holders
from harmonia.schedule.plan import Plan
from harmonia.workload.cost import CostModel, PhaseTimes
from harmonia.workload.shapes import SampleShape, encoder_sequences, llm_tokens_of_item
from harmonia.workload.work import ModuleLoad


@dataclass(frozen=True)
class StageKey:
    """One stage chunk of one replica of a module."""

    module: str
    replica: int
    stage: int


@dataclass
class MicrobatchWork:
    """What a stage does for one microbatch (or encoder sub-microbatch)."""

    times: PhaseTimes
    act_bytes: float = 0.0
    send_bytes: float = 0.0  # activations to the next stage (gradients back are the same size)
    flops: float = 0.0  # useful FLOPs on one rank of the stage's TP x CP group
    tokens: int = 0
    transient: float = 0.0  # bytes held only during the backward: a recomputed block's activations


@dataclass
class IterationWork:
    """All stage work of one iteration.

    Attributes:
        work: (stage key, microbatch id) -> work. Microbatch ids are ``(llm_replica, index)``.
        encoder_feeds: (encoder, llm_replica, index) -> encoder replicas that hold part of it.
        boundary_bytes: (encoder, encoder_replica, llm_replica, index) -> bytes to the LLM.
        stage_ranks: stage key -> the ranks (TP x CP group) that run it.
        microbatches: llm replica -> list of sample-index lists.
    """

    work: dict[tuple[StageKey, tuple[int, int]], MicrobatchWork] = field(default_factory=dict)
    encoder_feeds: dict[tuple[str, int, int], list[int]] = field(default_factory=dict)
    boundary_bytes: dict[tuple[str, int, int, int], float] = field(default_factory=dict)
    stage_ranks: dict[StageKey, tuple[int, ...]] = field(default_factory=dict)
    microbatches: dict[int, list[list[int]]] = field(default_factory=dict)


def stage_layer_range(cost: CostModel, plan: Plan, module: str, stage: int) -> tuple[int, int]:
    """Cost-model layer indices [start, stop) of a stage chunk; the front end joins stage 0 and the
    post layer (head, final norm) the last stage."""
    layout = plan.layouts[module]
    n_blocks = len(cost.layers[module]) - 2
    split = layout.stage_split(n_blocks)
    start = 1 + sum(split[:stage])
    stop = start + split[stage]
    if stage == 0:
        start = 0
    if stage == layout.n_stages - 1:
        stop = len(cost.layers[module])
    return start, stop


def stage_of_chunk(plan: Plan, module: str, chunk: int) -> tuple[int, int]:
    """(pp rank, virtual index) holding a stage chunk: chunks go round-robin over pp ranks."""
    pp = plan.layouts[module].pp
    return chunk % pp, chunk // pp


def _ranks_of(plan: Plan, module: str, replica: int, chunk: int) -> tuple[int, ...]:
    layout = plan.layouts[module]
    pp_rank, _ = stage_of_chunk(plan, module, chunk)
    return tuple(layout.rank_at(pp=pp_rank, dp=replica, cp=c, tp=t)
                 for c in range(layout.cp) for t in range(layout.tp))


def _encoder_shares(samples: list[SampleShape], cost: CostModel, encoder: str, idx: list[int],
                    replicas: list[int], loads: list[float]) -> list[list[tuple[int, int]]]:
    """Split the items of ``encoder`` in samples ``idx`` over ``replicas``: largest item first onto
    the replica with the smallest running load (``loads[e]``: FLOPs so far this iteration).

    The loads carry over from one microbatch to the next, so replicas that got the heaviest items of
    one microbatch get lighter ones in the next; restarting from zero every microbatch would hand
    the heaviest item of every microbatch to the same replica, and none at all to the replicas
    beyond a microbatch's item count.

    Returns per replica (in ``replicas`` order) a list of (sample index, item index) pairs;
    ``loads`` is updated in place.
    """
    spec = cost.mllm.encoders[encoder]
    items = []
    for i in idx:
        for j, item in enumerate(samples[i].items):
            if item.modality in spec.modalities:
                seqs = encoder_sequences(item, spec)
                flops = float(cost.flops(encoder, ModuleLoad(sum(seqs), sum(n * n for n in seqs), len(seqs))).sum())
                items.append((flops, i, j))
    shares: list[list[tuple[int, int]]] = [[] for _ in replicas]
    for flops, i, j in sorted(items, reverse=True):
        k = min(range(len(replicas)), key=lambda k: loads[replicas[k]])
        shares[k].append((i, j))
        loads[replicas[k]] += flops
    return shares


def _item_load(samples: list[SampleShape], cost: CostModel, encoder: str, pairs: list[tuple[int, int]]):
    spec = cost.mllm.encoders[encoder]
    enc, proj = ModuleLoad(), ModuleLoad()
    for i, j in pairs:
        seqs = encoder_sequences(samples[i].items[j], spec)
        enc += ModuleLoad(sum(seqs), sum(n * n for n in seqs), len(seqs))
        proj += ModuleLoad(llm_tokens_of_item(samples[i].items[j], spec), 0, 1)
    return enc, proj


def plan_iteration_work(samples: list[SampleShape], plan: Plan, cost: CostModel,
                        microbatches: dict[int, list[list[int]]]) -> IterationWork:
    """Stage work of every module for an iteration's microbatches (see module docstring)."""
    out = IterationWork(microbatches=microbatches)
    h_llm = cost.mllm.llm.hidden
    llm = plan.layouts["llm"]
    feeds = {enc: feeding_replicas(plan, enc) for enc in plan.encoders}
    loads = {enc: [0.0] * plan.layouts[enc].dp for enc in plan.encoders}  # FLOPs per encoder replica so far
    for d, mbs in microbatches.items():
        for m, idx in enumerate(mbs):
            load = ModuleLoad()
            for i in idx:
                load += cost.sample_loads(samples[i])["llm"]
            _add_module_work(out, plan, cost, "llm", d, (d, m), load, ModuleLoad(), h_llm, llm.tp, llm.cp)
            for enc in plan.encoders:
                _add_encoder_work(out, samples, plan, cost, enc, d, m, idx, h_llm, feeds[enc][d], loads[enc])
    return out


def feeding_replicas(plan: Plan, enc: str) -> list[list[int]]:
    """Per LLM replica, the encoder replicas that feed it (see the module docstring): those on its
    own ranks when every encoder replica lies inside one LLM replica, else round-robin."""
    enc_layout, llm = plan.layouts[enc], plan.layouts["llm"]
    enc_dp, llm_dp = enc_layout.dp, llm.dp
    owner = {r: llm.coords(r)["dp"] for r in llm.rank_list()}
    inside: list[list[int]] = [[] for _ in range(llm_dp)]
    for e in range(enc_dp):
        ranks = [enc_layout.rank_at(pp=p, dp=e, cp=c, tp=t) for p in range(enc_layout.pp)
                 for c in range(enc_layout.cp) for t in range(enc_layout.tp)]
        replicas = {owner.get(r) for r in ranks}
        if len(replicas) != 1 or None in replicas:
            break
        inside[replicas.pop()].append(e)
    else:
        if all(inside):
            return inside
    if enc_dp >= llm_dp:
        return [[e for e in range(enc_dp) if e % llm_dp == d] for d in range(llm_dp)]
    return [[d % enc_dp] for d in range(llm_dp)]


def _add_encoder_work(out: IterationWork, samples, plan: Plan, cost: CostModel, enc: str, d: int, m: int,
                      idx: list[int], h_llm: int, replicas: list[int], loads: list[float]) -> None:
    shares = _encoder_shares(samples, cost, enc, idx, replicas, loads)
    feeds = []
    layout = plan.layouts[enc]
    for e, share in zip(replicas, shares):
        if not share:
            continue
        enc_load, proj_load = _item_load(samples, cost, enc, share)
        _add_module_work(out, plan, cost, enc, e, (d, m), enc_load, proj_load, cost.mllm.encoders[enc].out_dim,
                         layout.tp, layout.cp)
        out.boundary_bytes[(enc, e, d, m)] = proj_load.tokens * h_llm * cost.act_bytes
        feeds.append(e)
    out.encoder_feeds[(enc, d, m)] = feeds


def _add_module_work(out: IterationWork, plan: Plan, cost: CostModel, module: str, replica: int,
                     mb: tuple[int, int], load: ModuleLoad, proj_load: ModuleLoad, hidden: int,
                     tp: int, cp: int) -> None:
    layout = plan.layouts[module]
    recompute = module in plan.recompute
    for chunk in range(layout.n_stages):
        start, stop = stage_layer_range(cost, plan, module, chunk)
        times = cost.stage_times(module, load, start, stop, tp, cp, recompute)
        flops = sum(cost.phase_flops(module, load, start, stop))
        act = cost.activation_bytes(module, load.tokens, start, stop, tp, cp, recompute)
        transient = cost.recompute_transient_bytes(module, load.tokens, start, stop, tp, cp) if recompute else 0.0
        last = chunk == layout.n_stages - 1
        if last and module != "llm":  # the projector runs on the encoder's last stage
            proj = f"{module}_proj"
            times = times + cost.stage_times(proj, proj_load, tp=tp, cp=cp)
            flops += sum(cost.phase_flops(proj, proj_load))
            act += cost.activation_bytes(proj, proj_load.tokens, tp=tp, cp=cp)
        key = StageKey(module, replica, chunk)
        if key not in out.stage_ranks:
            out.stage_ranks[key] = _ranks_of(plan, module, replica, chunk)
        send = 0.0 if last else load.tokens * hidden * cost.act_bytes / (tp * cp)
        out.work[(key, mb)] = MicrobatchWork(times, act, send, flops / (tp * cp), load.tokens, transient)


def stage_trainable(plan: Plan, cost: CostModel) -> dict[str, tuple[bool, ...]]:
    """Per module, whether each stage chunk has trainable weights (projectors count on the encoder's
    last chunk)."""
    out = {}
    for module, layout in plan.layouts.items():
        flags = []
        for chunk in range(layout.n_stages):
            start, stop = stage_layer_range(cost, plan, module, chunk)
            trains = cost.param_count(module, start, stop)[1] > 0
            if module != "llm" and chunk == layout.n_stages - 1:
                trains = trains or cost.param_count(f"{module}_proj")[1] > 0
            flags.append(trains)
        out[module] = tuple(flags)
    return out


def encoder_replicas(plan: Plan, iw: IterationWork, enc: str, d: int, m: int) -> list[int]:
    """The encoder replicas holding part of microbatch ``m`` of LLM replica ``d``."""
    return iw.encoder_feeds.get((enc, d, m), [])


def cost_table(plan: Plan, iw: IterationWork, d: int) -> CostTable:
    """Per-microbatch stage durations of LLM replica ``d`` (encoders: the slowest feeding replica;
    a colocated encoder on each holder: the slowest of the encoder replicas on its ranks)."""
    return CostTable(_stage_costs(plan, iw, d), shares=_share_costs(plan, iw, d))


def _slowest(works: list) -> PhaseCost:
    return PhaseCost(max(w.times.F for w in works), max(w.times.B for w in works), max(w.times.W for w in works))


def _share_costs(plan: Plan, iw: IterationWork, d: int) -> dict:
    out = {}
    for enc in plan.encoders:
        for chunk in range(plan.layouts[enc].n_stages):
            held = colocated_holders(plan.layouts, enc, chunk, d)
            if held is None or len(held) < 2:
                continue
            for m in range(len(iw.microbatches[d])):
                for rank, replicas in held.items():
                    works = [iw.work[(StageKey(enc, e, chunk), (d, m))] for e in replicas
                             if (StageKey(enc, e, chunk), (d, m)) in iw.work]
                    out[(rank, enc, chunk, m)] = _slowest(works) if works else PhaseCost(0.0, 0.0, 0.0)
    return out


def _stage_costs(plan: Plan, iw: IterationWork, d: int) -> dict:
    entries = {}
    for m in range(len(iw.microbatches[d])):
        for module, layout in plan.layouts.items():
            replicas = [d] if module == "llm" else encoder_replicas(plan, iw, module, d, m)
            for chunk in range(layout.n_stages):
                works = [iw.work[(StageKey(module, e, chunk), (d, m))] for e in replicas
                         if (StageKey(module, e, chunk), (d, m)) in iw.work]
                if not works:
                    entries[(module, chunk, m, None)] = PhaseCost(0.0, 0.0, 0.0)
                    continue
                entries[(module, chunk, m, None)] = _slowest(works)
    return entries
