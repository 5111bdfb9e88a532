"""From a plan to per-rank compute orders: run the schedule generators per LLM replica, then
expand each stage's representative rank to its whole TP x CP group and to every encoder replica.

The generators (`harmonia.schedule`) order one LLM replica's pipeline with the iteration's real
per-microbatch costs. Each LLM DP replica gets its own schedule. A rank that serves several
replicas (an encoder replica feeding several LLM replicas, or encoders colocated on LLM ranks)
merges its actions by their start times in the generators' replay, so its order follows the
time at which each piece of work is ready.
"""

from __future__ import annotations

from collections import defaultdict

from harmonia.plan.plan import Plan
from harmonia.schedule import CostTable, PhaseCost, StageGraph, build_schedule, replay
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
    """Per-microbatch stage durations of LLM replica ``d`` (encoders: the slowest feeding replica)."""
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
                entries[(module, chunk, m, None)] = PhaseCost(max(w.times.F for w in works),
                                                              max(w.times.B for w in works),
                                                              max(w.times.W for w in works))
    return CostTable(entries)


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
    timed: dict[int, list[tuple[float, int, int, ComputeKey]]] = defaultdict(list)
    for d, mbs in iw.microbatches.items():
        graph = StageGraph.from_layouts(plan.layouts, trainable, replica=d)
        table = cost_table(plan, iw, d)
        schedule = build_schedule(graph, len(mbs), family, order=(order or {}).get(d), costs=table)
        times = replay(schedule, table)
        for rep_rank, actions in schedule.orders.items():
            for pos, a in enumerate(actions):
                if not a.kind.is_compute:
                    continue
                m = a.microbatch
                replicas = [d] if a.module == "llm" else _encoder_replicas(plan, iw, a.module, d, m)
                for e in replicas:
                    skey = StageKey(a.module, e, a.stage)
                    if (skey, (d, m)) not in iw.work:
                        continue
                    key: ComputeKey = (a.module, e, a.stage, a.kind.value, (d, m))
                    for rank in iw.stage_ranks[skey]:
                        timed[rank].append((times[(rep_rank, pos)][0], d, pos, key))
    return {rank: [k for *_, k in sorted(items)] for rank, items in timed.items()}


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
