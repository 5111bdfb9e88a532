"""Assignments of hand-made microbatches, for tests of the stage work and the simulator."""

from __future__ import annotations

from collections.abc import Sequence

from harmonia.schedule.iteration import IterationAssignment, assemble_iteration, balancer_costs, feeding_replicas
from harmonia.schedule.plan import Plan
from harmonia.workload.cost import CostModel
from harmonia.workload.shapes import SampleShape


def assignment(plan: Plan, cost: CostModel, shapes: Sequence[SampleShape],
               per_replica: Sequence[Sequence[Sequence[int]]]) -> IterationAssignment:
    """Global microbatches of the given LLM replicas' microbatches (positions into ``shapes``), each
    encoder's samples dealt to its replicas as the trainer deals them."""
    costs, columns, _ = balancer_costs(cost, shapes, plan.encoders)
    return assemble_iteration(per_replica, costs, columns, {e: plan.layouts[e].dp for e in plan.encoders},
                              feeds={e: feeding_replicas(plan, e) for e in plan.encoders})
