"""The one message order both ends derive: replayed under NCCL's rules, every schedule's messages run.

`plan_message_order` is checked against `harmonia.sim.nccl_replay` directly: each rank's issue order
(its sends at their steps, its receives posted where the order puts them, each waited at its step)
becomes the events a process would record, and the replay must find no deadlock, under per-pair and
per-communicator streams. The naive order (every receive posted first, what gloo's tags allowed)
must deadlock on the same programs, so the check can fail.
"""

from __future__ import annotations

import pytest

from harmonia.errors import ScheduleError
from harmonia.runtime.message_program import lone_transfer_programs, rank_programs
from harmonia.runtime.boundary_plan import plan_boundary
from harmonia.schedule.families import build_schedule
from harmonia.schedule.graph import LLM, StageGraph
from harmonia.schedule.layout import Layout
from harmonia.schedule.message_order import Step, plan_message_order
from harmonia.sim.nccl_replay import Issue, P2POp, Wait, replay_nccl

GROUP = tuple(range(8))


def _events(order) -> list:
    """What a rank issuing ``order`` records: posts and sends as they go, a wait at each receive."""
    events, ids, n = [], {}, 0
    for j, step in enumerate(order.steps):
        for key in order.posts[j]:
            peer = next(s.peer for s in order.steps if s.key == key)
            events.append(Issue((P2POp(GROUP, peer, False, 4, "float32"),), False))
            ids[key], n = n, n + 1
        if step.send:
            events.append(Issue((P2POp(GROUP, step.peer, True, 4, "float32"),), False))
            n += 1
        else:
            events.append(Wait(ids[step.key]))
    return events


def _naive(steps: list[Step]) -> list:
    """Every receive posted first, then sends at their steps (what tags made safe on gloo)."""
    events = [Issue((P2POp(GROUP, s.peer, False, 4, "float32"),), False) for s in steps if not s.send]
    n = len(events)
    waits = iter(range(n))
    for s in steps:
        if s.send:
            events.append(Issue((P2POp(GROUP, s.peer, True, 4, "float32"),), False))
        else:
            events.append(Wait(next(waits)))
    return events


def _replays(programs) -> None:
    orders = plan_message_order(programs)
    for streams in ("pair", "group"):
        replay_nccl({r: _events(o) for r, o in orders.items()}, streams=streams)


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "interleaved", "zb"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 6)])
def test_pipelines_order_under_nccl(family: str, pp: int, m: int) -> None:
    chunks = 2 if family == "interleaved" else 1
    llm = Layout(pp=pp, virtual_stages=chunks)
    graph = StageGraph.from_layouts({LLM: llm}, {LLM: True})
    schedule = build_schedule(graph, m, family)
    programs = rank_programs({LLM: llm}, schedule, {})
    assert any(programs.values())
    _replays(programs)
    with pytest.raises(ScheduleError, match="deadlock under NCCL"):
        replay_nccl({r: _naive(p) for r, p in programs.items()})


def test_one_f_one_b_steady_state_is_ordered_by_send_time() -> None:
    """Stage 0 sends F(m) while stage 1 sends B(j): both ends put the earlier send first."""
    programs = {0: [Step("f0", True, 1), Step("f1", True, 1), Step("b0", False, 1), Step("b1", False, 1)],
                1: [Step("f0", False, 0), Step("b0", True, 0), Step("f1", False, 0), Step("b1", True, 0)]}
    orders = plan_message_order(programs)
    assert "f1" in orders[1].posts[0] + orders[1].posts[1]  # posted before b0 is sent: f1 was sent first
    _replays(programs)


def test_lists_that_cannot_run_are_refused() -> None:
    programs = {0: [Step("a", False, 1), Step("b", True, 1)], 1: [Step("b", False, 0), Step("a", True, 0)]}
    with pytest.raises(ScheduleError, match="cannot run"):
        plan_message_order(programs)


def test_unmatched_message_is_refused() -> None:
    with pytest.raises(ScheduleError, match="no matching receive"):
        plan_message_order({0: [Step("a", True, 1)], 1: []})


def test_boundary_relay_orders_under_nccl() -> None:
    """One source -> an LLM tp4 on another node: rows relayed inside it, gradients partial over TP."""
    items = [[5], [3], [8]]
    plan = plan_boundary(Layout(), Layout(tp=4, rank_offset=4), items, [[0, 1, 2]], [[0, 1, 2]],
                         dst_tp_grads="partial", gpus_per_node=4)
    assert plan.relays
    programs = lone_transfer_programs([plan, plan], "vision", backward=True)
    _replays(programs)
