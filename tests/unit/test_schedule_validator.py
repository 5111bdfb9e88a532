"""Validator: completeness, frozen-awareness, dependencies, matched sends, deadlock, memory, table."""

import pytest

from harmonia.errors import ScheduleError
from harmonia.schedule import (Action, IterationSchedule, ModuleStages, StageGraph, build_1f1b,
                               format_table, lower, validate)


def llm_graph(pp=2, trainable=True):
    return StageGraph((ModuleStages("llm", tuple(range(pp)), (trainable,) * pp),))


def schedule(graph, n, orders):
    return IterationSchedule(graph, n, {}, {r: [Action.parse(t) for t in ts] for r, ts in orders.items()})


def test_hand_written_gpipe_validates():
    s = schedule(llm_graph(), 2, {0: ["llm.s0.F0", "llm.s0.F1", "llm.s0.W0", "llm.s0.W1"],
                                  1: ["llm.s1.F0", "llm.s1.F1", "llm.s1.BW0", "llm.s1.BW1"]})
    run = validate(s)
    assert run.n_steps == 6 and run.bubbles() == 4
    assert run.peak_in_flight == {0: 2.0, 1: 2.0}


def test_missing_and_duplicate_actions_are_marked():
    s = schedule(llm_graph(), 1, {0: ["llm.s0.F0", "llm.s0.F0", "llm.s0.W0"], 1: ["llm.s1.F0"]})
    with pytest.raises(ScheduleError) as err:
        validate(s)
    text = str(err.value)
    assert "llm.s0.F0 appears twice" in text
    assert "llm.s1.mb0 runs {F}; expected {BW,F} or {B,F,W}" in text
    assert ">>llm.s0.F0<<" in text


def test_frozen_awareness_rejects_needless_backward():
    frozen_first = StageGraph((ModuleStages("llm", (0, 1), (False, True)),))
    # stage 0 is frozen with nothing upstream: no backward at all; stage 1 trains but has nothing
    # trainable upstream: W only
    ok = schedule(frozen_first, 1, {0: ["llm.s0.F0"], 1: ["llm.s1.F0", "llm.s1.W0"]})
    validate(ok)
    bad = schedule(frozen_first, 1, {0: ["llm.s0.F0", "llm.s0.B0"], 1: ["llm.s1.F0", "llm.s1.BW0"]})
    with pytest.raises(ScheduleError, match="frozen-aware"):
        validate(bad)


def test_action_on_the_wrong_rank():
    s = schedule(llm_graph(), 1, {0: ["llm.s0.F0", "llm.s1.F0", "llm.s1.BW0", "llm.s0.W0"], 1: []})
    with pytest.raises(ScheduleError, match="lives on rank 1"):
        validate(s)


def test_deadlock_marks_the_waiting_cells():
    # rank 1 runs its backward before the forward it depends on
    s = schedule(llm_graph(), 1, {0: ["llm.s0.F0", "llm.s0.W0"], 1: ["llm.s1.BW0", "llm.s1.F0"]})
    with pytest.raises(ScheduleError) as err:
        validate(s)
    text = str(err.value)
    assert "deadlocks at step 1" in text
    assert "rank 1: llm.s1.BW0 waits for llm.s1.F0" in text
    assert ">>llm.s1.BW0<<" in text and ">>llm.s0.W0<<" in text


def test_memory_bound():
    s = build_1f1b(llm_graph(4), 8)
    assert validate(s, max_in_flight=4).peak_in_flight[0] == 4
    with pytest.raises(ScheduleError, match="above the bound 3"):
        validate(s, max_in_flight={0: 3})


def test_unmatched_send_and_missing_receive():
    lowered = lower(build_1f1b(llm_graph(), 2))
    validate(lowered)
    no_recv = IterationSchedule(lowered.graph, 2, {}, {r: list(a) for r, a in lowered.orders.items()})
    no_recv.orders[1] = [a for a in no_recv.orders[1] if str(a) != "llm.s1.RECV_F0@r0"]
    with pytest.raises(ScheduleError, match="has no matching recv"):
        validate(no_recv)


def test_wrong_peer_rank():
    s = schedule(llm_graph(), 1, {0: ["llm.s0.F0", "llm.s0.SEND_F0@r5", "llm.s0.RECV_B0@r1", "llm.s0.W0"],
                                  1: ["llm.s1.RECV_F0@r0", "llm.s1.F0", "llm.s1.BW0", "llm.s1.SEND_B0@r0"]})
    with pytest.raises(ScheduleError, match="peer rank 5"):
        validate(s)


def test_format_table_marks_cells():
    text = format_table({0: ["a", "b"], 3: ["", "c"]}, {(1, 3)})
    lines = text.splitlines()
    assert lines[0].split() == ["step", "|", "rank", "0", "rank", "3"]
    assert lines[2].split() == ["0", "|", "a", "."]
    assert lines[3].split() == ["1", "|", "b", ">>c<<"]
