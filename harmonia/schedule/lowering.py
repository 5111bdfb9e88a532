"""Lowering: add the sends and receives a compute-only schedule needs.

For every compute action whose input was produced on another rank, the producer's rank gets a
send right after the producer, and the consumer's rank a receive right before the consumer:

- ``SEND_F``/``RECV_F`` carry a stage's output activations to the next stage of the module;
- ``SEND_B``/``RECV_B`` carry the input gradient back to the previous stage;
- across a boundary (an encoder's last stage -> the LLM's first stage) the same kinds name the
  other module's stage (``vision.s1.SEND_F3.1>llm.s0@r2``), one message per sub-microbatch, in
  both directions.

Every communication names its peer rank. Sends never block, so a deadlock-free compute order
stays deadlock-free (`harmonia.schedule.validator.validate` checks it). Producer and consumer on
the same rank (colocated modules, a V-shaped layout) exchange nothing. A stage held by several ranks
(a colocated encoder) sends from its primary rank; the executor gathers every holder's share of
the boundary rows itself.
"""

from __future__ import annotations

from dataclasses import replace

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action, Kind
from harmonia.schedule.graph import IterationSchedule
from harmonia.schedule.validator import Checker, Message, data_message


def _comm(message: Message, send: bool, rank_of) -> Action:
    """The send (on the source stage) or receive (on the destination stage) of a message."""
    direction, src, dst, mb, sub = message
    own, other = (src, dst) if send else (dst, src)
    kind = {("F", True): Kind.SEND_F, ("F", False): Kind.RECV_F,
            ("B", True): Kind.SEND_B, ("B", False): Kind.RECV_B}[(direction, send)]
    peer = other if other.module != own.module else None
    return Action(own.module, own.stage, kind, mb, sub, peer, rank_of(other))


def lower(schedule: IterationSchedule) -> IterationSchedule:
    """A copy of a compute-only schedule with sends and receives added.

    Raises:
        ScheduleError: the schedule already has communication actions.
    """
    if schedule.is_lowered():
        raise ScheduleError("schedule already holds sends/receives; lower a compute-only schedule")
    graph = schedule.graph
    checker = Checker(schedule)
    sends_after: dict[Action, list[Action]] = {}
    recvs_before: dict[tuple[int, Action], list[Action]] = {}
    for rank, acts in schedule.orders.items():
        for a in acts:
            for p in graph.producers(a, schedule.subs, checker.grad_kind):
                if rank in graph.holders_of(p.stage_ref):
                    continue
                msg = data_message(p, a)
                sends_after.setdefault(p, []).append(_comm(msg, True, graph.rank_of))
                recvs_before.setdefault((rank, a), []).append(_comm(msg, False, graph.rank_of))
    orders: dict[int, list[Action]] = {}
    for rank, acts in schedule.orders.items():
        out: list[Action] = []
        for a in acts:
            out.extend(recvs_before.get((rank, a), []))
            out.append(a)
            if graph.rank_of(a.stage_ref) == rank:
                out.extend(sends_after.get(a, []))
        orders[rank] = out
    return replace(schedule, orders=orders, chunk_actions=None, placements=None)


def strip_communication(schedule: IterationSchedule) -> IterationSchedule:
    """A copy with only the compute actions (the inverse of `lower`)."""
    return replace(schedule, orders=schedule.compute_orders(), chunk_actions=None, placements=None)


__all__ = ["lower", "strip_communication"]
