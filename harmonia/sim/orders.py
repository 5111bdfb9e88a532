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

from harmonia.schedule import StageGraph, build_schedule, replay
from harmonia.schedule.graph import colocated_holders
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, StageKey, cost_table, encoder_replicas, stage_trainable
from harmonia.sim.tasks import ComputeKey
from harmonia.workload.cost import CostModel


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
                replicas = [d] if a.module == "llm" else encoder_replicas(plan, iw, a.module, d, m)
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
