"""What a plan search keys its caches and shared results by: the parts of a candidate its
simulation (`simulation_key`), its work bound but for recomputation (`family_key`) and its
layouts' placement of work (`layouts_key`) depend on."""

from __future__ import annotations

from harmonia.plan.recipes import Candidate
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import plan_graph
from harmonia.workload.cost import CostModel


def simulation_key(cand: Candidate, cost: CostModel) -> tuple:
    """What the simulator's result depends on: two candidates with equal keys simulate alike.

    Zero-bubble differs from 1F1B only on stages that split a backward into B and W (both an
    input gradient and trainable weights); where none does, a ``zb`` plan runs as ``1f1b``.
    """
    plan = cand.plan
    schedule = plan.schedule
    if schedule == "zb":
        graph = plan_graph(plan, cost)
        if not any(graph.needs_b(ref) and graph.needs_w(ref) for ref in graph.stages()):
            schedule = "1f1b"
    return (cand.recipe, cand.fused, plan.placement.value, schedule, plan.n_microbatches, layouts_key(plan, cost),
            plan.recompute_key)


def family_key(cand: Candidate, cost: CostModel) -> tuple:
    """A candidate as its work bound sees it, but for what it recomputes (`harmonia.plan.search._Scorer.twin_bound`)."""
    plan = cand.plan
    return cand.recipe, cand.fused, plan.placement.value, plan.schedule, plan.n_microbatches, layouts_key(plan, cost)


def recompute_shares(plan: Plan) -> dict[str, float]:
    """Every module's share of its blocks recomputed (0 for none)."""
    return {m: plan.recompute_share(m) for m in plan.layouts}


def layouts_key(plan: Plan, cost: CostModel) -> tuple:
    """Every module's layout as it places and splits work: ranks listed or by offset alike, a stage
    split given or even alike (two plans that differ only there simulate alike)."""
    return tuple((m, lay.tp, lay.cp, lay.dp, lay.pp, lay.rank_list(), lay.virtual_stages, lay.fsdp, lay.reshard,
                  tuple(lay.stage_split(len(cost.layers[m]) - 2))) for m, lay in sorted(plan.layouts.items()))
