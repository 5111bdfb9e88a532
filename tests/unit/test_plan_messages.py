"""Before any process starts, a plan's messages must go in one order both ends derive: every schedule
family and placement the runtime runs passes; lists whose messages wait on each other are refused
naming the modules and ranks."""

from __future__ import annotations

import pytest

from harmonia.errors import LayoutError
from harmonia.runtime import message_program
from harmonia.runtime.message_program import check_layout_messages, nominal_boundary_plan
from harmonia.schedule.families import build_schedule
from harmonia.schedule.graph import LLM, StageGraph
from harmonia.schedule.layout import Layout
from harmonia.schedule.message_order import Step

LAYOUTS = {
    "colocated": {"vision": Layout(dp=2, pp=2), LLM: Layout(pp=2, cp=2)},
    "disjoint": {"vision": Layout(dp=2, rank_offset=4), LLM: Layout(pp=2, dp=2)},
    "tp": {"vision": Layout(tp=2, dp=2), LLM: Layout(pp=2, tp=2)},
}


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_runnable_layouts_pass(name: str, family: str) -> None:
    layouts = LAYOUTS[name]
    graph = StageGraph.from_layouts(layouts, {"vision": True, LLM: True})
    check_layout_messages(layouts, build_schedule(graph, 4, family))


def test_nominal_boundary_joins_every_pair_of_replicas() -> None:
    src, dst = Layout(dp=2, rank_offset=4), Layout(dp=2, cp=2)
    plan = nominal_boundary_plan(src, dst)
    pairs = {(m.src, m.dst) for m in plan.forward}
    assert pairs == {(s, d) for s in (4, 5) for d in range(4)}


def test_messages_that_wait_on_each_other_are_refused(monkeypatch) -> None:
    layouts = LAYOUTS["disjoint"]
    graph = StageGraph.from_layouts(layouts, {"vision": True, LLM: True})
    cycle = {0: [Step("a", False, 1), Step("b", True, 1)], 1: [Step("b", False, 0), Step("a", True, 0)]}
    monkeypatch.setattr(message_program, "rank_programs", lambda *args: cycle)  # lists that cannot run
    with pytest.raises(LayoutError, match=r"(?s)cannot be put in one order .*vision on ranks \[4, 5\].*"
                                          r"rank 0 waits to receive a from rank 1"):
        check_layout_messages(layouts, build_schedule(graph, 4, "1f1b"))
