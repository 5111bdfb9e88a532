"""Action IR: text form round trip, parse errors, CSV load/dump."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmonia.errors import ScheduleError
from harmonia.schedule import Action, Kind, StageRef, dump_csv, load_csv

NAMES = st.sampled_from(["llm", "vision", "audio", "vision_proj"])


@st.composite
def actions(draw):
    kind = draw(st.sampled_from(list(Kind)))
    if kind is Kind.REDUCE:  # a stage chunk's collective: no microbatch, no peer
        return Action(draw(NAMES), draw(st.integers(0, 12)), kind, 0)
    sub = draw(st.none() | st.integers(0, 9))
    peer = peer_rank = None
    if not kind.is_compute:
        peer = draw(st.none() | st.builds(StageRef, NAMES, st.integers(0, 5)))
        peer_rank = draw(st.none() | st.integers(0, 63))
    return Action(draw(NAMES), draw(st.integers(0, 12)), kind, draw(st.integers(0, 99)), sub, peer, peer_rank)


@given(actions())
@settings(max_examples=200, deadline=None)
def test_text_round_trips(action):
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["llm.s1.F3", "vision.s0.F2.1", "llm.s0.RECV_F3", "llm.s2.BW0",
                                  "vision.s1.SEND_F3.1>llm.s0@r2", "llm.s0.RECV_F3.1<vision.s1@r0",
                                  "llm.s1.SEND_B3@r0", "vision.s1.SEND_F3>llm.s0", "llm.s1.REDUCE"])
def test_documented_examples(text):
    assert str(Action.parse(text)) == text


def test_fields_of_a_boundary_receive():
    a = Action.parse("llm.s0.RECV_F3.1<vision.s1@r0")
    assert (a.module, a.stage, a.kind, a.microbatch, a.sub) == ("llm", 0, Kind.RECV_F, 3, 1)
    assert a.peer_stage() == StageRef("vision", 1) and a.peer_rank == 0
    assert Action.parse("llm.s1.SEND_F2").peer_stage() == StageRef("llm", 2)
    assert Action.parse("llm.s1.SEND_B2").peer_stage() == StageRef("llm", 0)


@pytest.mark.parametrize("text", ["llm.F3", "llm.s1.X3", "llm.s1.F", "1llm.s0.F0", "llm.s0.F0>vision.s1",
                                  "llm.s0.SEND_F0<vision.s1"])
def test_malformed_text_raises(text):
    with pytest.raises(ScheduleError):
        Action.parse(text)


def test_compute_action_cannot_name_a_peer():
    with pytest.raises(ScheduleError, match="peer"):
        Action("llm", 0, Kind.F, 0, peer_rank=1)


def test_csv_round_trip(tmp_path):
    orders = {0: [Action.parse("vision.s0.F0.1"), Action.parse("vision.s0.SEND_F0.1>llm.s0@r1")],
              1: [Action.parse("llm.s0.RECV_F0.1<vision.s0@r0"), Action.parse("llm.s0.F0")], 2: []}
    path = tmp_path / "schedule.csv"
    dump_csv(orders, path)
    assert load_csv(path) == orders


def test_csv_rejects_bad_rank(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("zero,llm.s0.F0\n")
    with pytest.raises(ScheduleError, match="rank number"):
        load_csv(path)
