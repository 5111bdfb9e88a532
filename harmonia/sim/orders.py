"""From a plan to per-rank compute orders: run the schedule generators per LLM replica, then
expand each stage's representative rank to its whole TP x CP group and to every encoder replica.

The generators (`harmonia.schedule`) order one LLM replica's pipeline with the iteration's real
per-microbatch costs. Each LLM DP replica gets its own schedule. An encoder colocated with the LLM
is held by every LLM rank of the replica that holds one of its replicas feeding it
(`StageGraph.holders_of`): each holder's copy of an action stands for the encoder replicas on that
holder's TP x CP group, so their work lands in the order the generator gave that rank. A rank that
serves several replicas (an encoder replica feeding several LLM replicas) merges its actions by
their start times in the generators' replay, so its order follows the time at which each piece of
work is ready.
"""

from __future__ import annotations

from collections import defaultdict

from harmonia.plan.plan import Plan
from harmonia.schedule import CostTable, PhaseCost, StageGraph, build_schedule, replay
from harmonia.schedule.graph import colocated_holders
from harmonia.sim.stagework import IterationWork, StageKey, stage_layer_range
from harmonia.sim.tasks import ComputeKey
from harmonia.workload.cost import CostModel


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


def _encoder_replicas(plan: Plan, iw: IterationWork, enc: str, d: int, m: int) -> list[int]:
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
            replicas = [d] if module == "llm" else _encoder_replicas(plan, iw, module, d, m)
            for chunk in range(layout.n_stages):
                works = [iw.work[(StageKey(module, e, chunk), (d, m))] for e in replicas
                         if (StageKey(module, e, chunk), (d, m)) in iw.work]
                if not works:
                    entries[(module, chunk, m, None)] = PhaseCost(0.0, 0.0, 0.0)
                    continue
                entries[(module, chunk, m, None)] = _slowest(works)
    return entries


def plan_orders(plan: Plan, cost: CostModel, iw: IterationWork, family: str | None = None,
                order: dict[int, list[int]] | None = None) -> dict[int, list[ComputeKey]]:
    """Per-rank compute orders for every rank of the plan.

    Args:
        plan: layouts and schedule family.
        cost: the cost model (for stage trainability).
        iw: the iteration's stage work.
        family: schedule family; default ``plan.schedule``.
        order: per LLM replica, the pipeline order of its microbatches; default as numbered.
    """
    family = family or plan.schedule
    trainable = stage_trainable(plan, cost)
    # per rank: (source replica, source rank, position, key); a rank fed by one source keeps its
    # order, a rank fed by several merges them by start time in each source's replay
    placed: dict[int, list[tuple[int, int, int, ComputeKey]]] = defaultdict(list)
    sources: dict[int, set[tuple[int, int]]] = defaultdict(set)
    built: dict[int, tuple] = {}
    for d, mbs in iw.microbatches.items():
        graph = StageGraph.from_layouts(plan.layouts, trainable, replica=d)
        table = cost_table(plan, iw, d)
        schedule = build_schedule(graph, len(mbs), family, order=(order or {}).get(d), costs=table)
        built[d] = (schedule, table)
        shares = {ref: colocated_holders(plan.layouts, ref.module, ref.stage, d)
                  for ref in graph.stages() if graph.is_shared(ref)}
        for rep_rank, actions in schedule.orders.items():
            for pos, a in enumerate(actions):
                if not a.kind.is_compute:
                    continue
                m = a.microbatch
                replicas = [d] if a.module == "llm" else _encoder_replicas(plan, iw, a.module, d, m)
                if a.stage_ref in shares:  # this holder's copy: the encoder replicas on its ranks
                    replicas = [e for e in replicas if e in shares[a.stage_ref][rep_rank]]
                for e in replicas:
                    skey = StageKey(a.module, e, a.stage)
                    if (skey, (d, m)) not in iw.work:
                        continue
                    key: ComputeKey = (a.module, e, a.stage, a.kind.value, (d, m))
                    for rank in iw.stage_ranks[skey]:
                        placed[rank].append((d, rep_rank, pos, key))
                        sources[rank].add((d, rep_rank))
    times: dict[int, dict] = {}
    out = {}
    for rank, items in placed.items():
        if len(sources[rank]) == 1:
            out[rank] = [k for *_, k in items]
            continue
        for d in {d for d, _ in sources[rank]} - set(times):
            times[d] = replay(*built[d])
        out[rank] = [k for *_, k in sorted((times[d][(r, pos)][0], d, pos, k) for d, r, pos, k in items)]
    return out


def fuse_encoders_into_first_stage(orders: dict[int, list[ComputeKey]]) -> dict[int, list[ComputeKey]]:
    """Megatron-style: an encoder's forward runs right before the LLM's first-stage forward of the
    same microbatch, and its backward right after that stage's backward, on the same rank."""
    out = {}
    for rank, keys in orders.items():
        enc_f = defaultdict(list)
        enc_b = defaultdict(list)
        rest = []
        for k in keys:
            if k[0] != "llm":
                (enc_f if k[3] == "F" else enc_b)[k[4]].append(k)
            else:
                rest.append(k)
        fused = []
        for k in rest:
            if k[2] == 0 and k[3] == "F":
                fused.extend(enc_f.pop(k[4], []))
            fused.append(k)
            if k[2] == 0 and k[3] in ("BW", "W"):
                fused.extend(enc_b.pop(k[4], []))
        for leftovers in (*enc_f.values(), *enc_b.values()):
            fused.extend(leftovers)
        out[rank] = fused
    return out
