"""Generators on multi-module stage graphs: families, frozen-awareness, sub-microbatches, costs."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmonia.errors import ScheduleError
from harmonia.schedule import (CostTable, Kind, ModuleStages, StageGraph, build_1f1b, build_gpipe,
                               build_interleaved_1f1b, build_schedule, build_zero_bubble, lower, makespan, replay,
                               strip_communication, validate)
from harmonia.schedule.actions import StageRef
from harmonia.schedule.costs import PhaseCost
from harmonia.schedule.layout import Layout

FAMILIES = ("gpipe", "1f1b", "zb")


def llm_only(pp=4, v=1):
    return StageGraph((ModuleStages("llm", tuple(range(pp)) * v, (True,) * (pp * v)),))


def disjoint_vlm(vision_trains=(False, True)):
    return StageGraph((ModuleStages("vision", (4, 5), vision_trains), ModuleStages("audio", (6,), (False,)),
                       ModuleStages("llm", (0, 1, 2, 3), (True,) * 4)))


def kinds_of(schedule, ref):
    return {a.kind for acts in schedule.orders.values() for a in acts if a.stage_ref == ref}


def test_1f1b_matches_the_textbook_order():
    s = build_1f1b(llm_only(4), 6)
    assert [str(a) for a in s.orders[1]] == [
        "llm.s1.F0", "llm.s1.F1", "llm.s1.F2", "llm.s1.BW0", "llm.s1.F3", "llm.s1.BW1", "llm.s1.F4",
        "llm.s1.BW2", "llm.s1.F5", "llm.s1.BW3", "llm.s1.BW4", "llm.s1.BW5"]
    # stage 0 has nothing upstream to pass gradients to: weight gradients only
    assert kinds_of(s, StageRef("llm", 0)) == {Kind.F, Kind.W}


def test_1f1b_holds_no_more_than_its_depth():
    s = build_1f1b(llm_only(4), 8)
    assert validate(s).peak_in_flight == {0: 4, 1: 3, 2: 2, 3: 1}
    assert validate(build_gpipe(llm_only(4), 8)).peak_in_flight[3] == 8


def test_zero_bubble_beats_1f1b_with_bounded_deferral():
    g, costs = llm_only(4), CostTable.uniform(1, 1, 1)
    zb, ob = build_zero_bubble(g, 8, costs=costs), build_1f1b(g, 8, costs=costs)
    assert makespan(zb, costs) < makespan(ob, costs)
    # activations waiting for B stay within 1F1B's depth; deferred W add at most as many again
    peaks = validate(zb).peak_in_flight
    assert all(peaks[r] <= 2 * (4 - r) for r in range(4))
    assert validate(build_zero_bubble(g, 8, max_deferred_w=0.5)).peak_in_flight == validate(ob).peak_in_flight


def test_zero_bubble_places_w_by_cost():
    g = llm_only(3)
    uniform = CostTable.uniform(1, 1, 1)
    slow_first = CostTable.from_microbatches([{("llm", 0): (3, 3, 3)}] * 4)
    a, b = build_zero_bubble(g, 4, costs=uniform), build_zero_bubble(g, 4, costs=slow_first)
    assert [str(x) for x in b.orders[1]][:4] == ["llm.s1.F0", "llm.s1.B0", "llm.s1.F1", "llm.s1.W0"]
    assert a.orders[1] != b.orders[1]  # rank 1 fills the wait for the slow stage 0 with W0
    for s, c in ((a, uniform), (b, slow_first)):
        validate(s)
        assert makespan(s, c) < makespan(build_1f1b(g, 4, costs=c), c)


def test_microbatch_order_is_followed():
    s = build_1f1b(llm_only(2), 4, order=[2, 0, 3, 1])
    assert [a.microbatch for a in s.orders[0] if a.kind is Kind.F] == [2, 0, 3, 1]
    with pytest.raises(ScheduleError, match="permutation"):
        build_1f1b(llm_only(2), 4, order=[0, 0, 1, 2])


def test_disjoint_encoders_feed_the_llm_with_sub_microbatches():
    g = disjoint_vlm()
    s = build_1f1b(g, 6, n_sub={"vision": [1, 2, 3, 1, 2, 1]})
    validate(s)
    vision_f = [a for a in s.orders[4] if a.kind is Kind.F]
    assert len(vision_f) == 10 and vision_f[1].sub == 0 and vision_f[2].sub == 1
    # vision.s0 is frozen with nothing upstream: no backward; vision.s1 trains: W only
    assert kinds_of(s, StageRef("vision", 0)) == {Kind.F}
    assert kinds_of(s, StageRef("vision", 1)) == {Kind.F, Kind.W}
    assert kinds_of(s, StageRef("audio", 0)) == {Kind.F}
    # llm.s0 must pass gradients back to the trainable projector stage: full backward
    assert kinds_of(s, StageRef("llm", 0)) == {Kind.F, Kind.BW}


def test_frozen_encoder_frees_the_llm_first_stage_from_input_gradients():
    g = disjoint_vlm(vision_trains=(False, False))
    s = build_zero_bubble(g, 4)
    assert kinds_of(s, StageRef("llm", 0)) == {Kind.F, Kind.W}
    assert kinds_of(s, StageRef("llm", 1)) == {Kind.F, Kind.B, Kind.W}
    validate(lower(s))


def test_colocated_encoder_forwards_just_ahead_and_backwards_late():
    g = StageGraph((ModuleStages("vision", (0, 1), (True, True)), ModuleStages("llm", (0, 1, 2, 3), (True,) * 4)))
    s = build_1f1b(g, 4)
    rank0 = [str(a) for a in s.orders[0]]
    # the LLM's first stage starts as soon as its first microbatch's encoder work is done
    assert rank0.index("llm.s0.F0") < rank0.index("vision.s0.F3")
    for m in range(4):
        assert rank0.index(f"vision.s0.F{m}") < rank0.index(f"llm.s0.F{m}")
        assert rank0.index(f"vision.s0.W{m}") > rank0.index(f"llm.s0.BW{m}")
    lowered = lower(s)
    validate(lowered)
    # colocated stages exchange nothing; vision.s0 -> vision.s1 crosses ranks 0 -> 1
    assert not any(a.peer is not None and a.peer_rank == 0 for a in lowered.orders[0])
    assert "vision.s0.SEND_F0@r1" in [str(a) for a in lowered.orders[0]]


def test_lowering_adds_boundary_transfers():
    s = lower(build_1f1b(disjoint_vlm(), 2, n_sub={"vision": 2}))
    validate(s)
    rank0 = [str(a) for a in s.orders[0]]
    assert rank0[:4] == ["llm.s0.RECV_F0.0<vision.s1@r5", "llm.s0.RECV_F0.1<vision.s1@r5",
                         "llm.s0.RECV_F0<audio.s0@r6", "llm.s0.F0"]
    assert "llm.s0.SEND_B0.1>vision.s1@r5" in rank0
    assert "vision.s1.RECV_B0.1<llm.s0@r0" in [str(a) for a in s.orders[5]]
    assert strip_communication(s).orders == build_1f1b(disjoint_vlm(), 2, n_sub={"vision": 2}).orders
    with pytest.raises(ScheduleError, match="already"):
        lower(s)


def test_interleaved_requires_round_robin_chunks():
    validate(build_interleaved_1f1b(llm_only(4, v=2), 8))
    with pytest.raises(ScheduleError, match="round-robin"):
        build_interleaved_1f1b(StageGraph((ModuleStages("llm", (0, 0, 1, 1), (True,) * 4),)), 4)
    with pytest.raises(ScheduleError, match="divisible"):
        build_interleaved_1f1b(llm_only(4, v=2), 9)  # 2 rounds of 4 do not divide 9


def test_replay_times_follow_costs():
    s = build_gpipe(llm_only(2), 2)
    times = replay(s, CostTable.uniform(1, 2, 0))
    assert times[(1, 0)] == (1.0, 2.0)  # llm.s1.F0 after llm.s0.F0
    # F 0-1, 1-2 on rank 0; rank 1 F 1-2, 2-3, BW 3-5, 5-7; stage 0 has W only, costing 0
    assert makespan(s, CostTable.uniform(1, 2, 0)) == 7.0


def test_graph_from_layouts():
    layouts = {"vision": Layout(pp=2, dp=2, rank_offset=8), "llm": Layout(tp=2, pp=2, virtual_stages=2)}
    g = StageGraph.from_layouts(layouts, {"vision": (False, True), "llm": True}, replica=1)
    assert g.module("vision").ranks == (9, 11) and g.llm.ranks == (0, 2, 0, 2)
    validate(build_interleaved_1f1b(g, 4))


def test_bad_inputs_raise_schedule_errors():
    with pytest.raises(ScheduleError, match="not an encoder"):
        build_1f1b(llm_only(2), 2, n_sub={"llm": 2})
    with pytest.raises(ScheduleError, match="unknown"):
        build_schedule(llm_only(2), 2, "dualpipe")
    with pytest.raises(ScheduleError, match="exactly one 'llm'"):
        StageGraph((ModuleStages("vision", (0,), (True,)),))


# -- property tests: every generated schedule validates ------------------------------------------
@st.composite
def problems(draw):
    llm_pp = draw(st.integers(1, 4))
    next_rank = llm_pp
    modules = []
    for name in draw(st.lists(st.sampled_from(["vision", "audio"]), max_size=2, unique=True)):
        pp = draw(st.integers(1, 2))
        if draw(st.booleans()):  # colocated on the LLM's ranks
            ranks = tuple(draw(st.integers(0, llm_pp - 1)) for _ in range(pp))
        else:
            ranks = tuple(range(next_rank, next_rank + pp))
            next_rank += pp
        modules.append(ModuleStages(name, ranks, tuple(draw(st.booleans()) for _ in range(pp))))
    modules.append(ModuleStages("llm", tuple(range(llm_pp)), tuple(draw(st.booleans()) for _ in range(llm_pp))))
    graph = StageGraph(tuple(modules))
    n = draw(st.integers(1, 6))
    n_sub = {m.name: [draw(st.integers(1, 3)) for _ in range(n)] for m in modules[:-1] if draw(st.booleans())}
    order = draw(st.permutations(range(n)))
    entries = {}
    for ref in graph.stages():
        for mb in range(n):
            entries[(ref.module, ref.stage, mb, None)] = tuple(draw(st.floats(0.1, 5)) for _ in range(3))
    from harmonia.schedule.costs import PhaseCost
    costs = CostTable({k: PhaseCost(*v) for k, v in entries.items()})
    return graph, n, n_sub, order, costs


@given(problems(), st.sampled_from(FAMILIES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_generated_schedule_validates(problem, family):
    graph, n, n_sub, order, costs = problem
    s = build_schedule(graph, n, family, order=order, n_sub=n_sub, costs=costs)
    run = validate(s)
    validate(lower(s))
    makespan(s, costs)
    for ref in graph.stages():  # frozen-aware: B only where needed, W only on trainable stages
        kinds = kinds_of(s, ref)
        assert (Kind.W in kinds or Kind.BW in kinds) == graph.needs_w(ref)
        assert (Kind.B in kinds or Kind.BW in kinds) == graph.needs_b(ref)
    if family != "gpipe":  # 1F1B gates bound every rank's memory, encoders' included
        factor = 2 if family == "zb" else 1  # zb: plus as many deferred weight gradients
        for rank in graph.ranks():
            gated = [ref for ref in graph.stages_on(rank) if graph.needs_backward(ref)]
            assert run.peak_in_flight[rank] <= factor * sum(graph.depth_to_end(r) for r in gated) + 1e-9


@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 8), st.booleans())
@settings(max_examples=30, deadline=None)
def test_interleaved_validates(pp, v, rounds_mb, split):
    n = pp * rounds_mb if rounds_mb > 1 else min(pp, 3)
    validate(lower(build_interleaved_1f1b(llm_only(pp, v), n, split=split)))


def shared_vision(trains: bool) -> StageGraph:
    """A one-stage encoder colocated on both ranks of an LLM pp2 pipeline: each rank encodes a share."""
    return StageGraph((ModuleStages("vision", (0,), (trains,), ((0, 1),)), ModuleStages("llm", (0, 1), (True, True))))


def test_shared_encoder_runs_on_every_holder_before_the_llm_consumes_it():
    # vision F = 1 per share, LLM F = B = W = 2; frozen vision: llm.s0 runs W only, llm.s1 BW.
    # rank 0: vF0 [0,1] F0 [1,3] vF1 [3,4] F1 [4,6] W0 [9,11] W1 [15,17]
    # rank 1: vF0 [0,1] vF1 [1,2] F0 [3,5] BW0 [5,9] F1 [9,11] BW1 [11,15]
    costs = CostTable({("vision", 0, m, None): PhaseCost(1, 0, 0) for m in range(2)}, PhaseCost(2, 2, 2))
    s = build_1f1b(shared_vision(False), 2, costs=costs)
    assert [str(a) for a in s.orders[0]] == ["vision.s0.F0", "llm.s0.F0", "vision.s0.F1", "llm.s0.F1",
                                             "llm.s0.W0", "llm.s0.W1"]
    assert [str(a) for a in s.orders[1]] == ["vision.s0.F0", "vision.s0.F1", "llm.s1.F0", "llm.s1.BW0",
                                             "llm.s1.F1", "llm.s1.BW1"]
    assert makespan(s, costs) == 17.0
    validate(s)
    validate(lower(s))


def test_shared_encoder_waits_for_its_slowest_holder():
    # rank 1's share of microbatch 0 takes 3 s: the LLM's first forward starts at 3, not 1
    costs = CostTable({("vision", 0, m, None): PhaseCost(1, 0, 0) for m in range(2)}, PhaseCost(2, 2, 2),
                      shares={(1, "vision", 0, 0): PhaseCost(3, 0, 0)})
    s = build_1f1b(shared_vision(False), 2, costs=costs)
    times = replay(s, costs)
    f0 = s.orders[0].index(next(a for a in s.orders[0] if str(a) == "llm.s0.F0"))
    assert times[(0, f0)] == (3.0, 5.0)


def test_shared_encoder_backwards_fill_bubbles_after_the_llm_gradient():
    s = build_zero_bubble(shared_vision(True), 4)
    validate(lower(s))
    for rank in (0, 1):
        order = [str(a) for a in s.orders[rank]]
        assert sum(a.startswith("vision.s0.F") for a in order) == 4
        for m in range(4):
            assert order.index(f"vision.s0.W{m}") > order.index(f"vision.s0.F{m}")
        assert order.index("vision.s0.W0") > order.index("llm.s0.B0") if rank == 0 else True


def test_from_layouts_holds_a_colocated_encoder_on_every_llm_rank_of_the_replica():
    # llm tp2 pp2 dp2 on ranks 0-7 (grid pp, dp, tp): replica 1 is ranks 2, 3 (pp0) and 6, 7 (pp1)
    layouts = {"vision": Layout(dp=8), "llm": Layout(tp=2, pp=2, dp=2)}
    g = StageGraph.from_layouts(layouts, {"vision": False, "llm": True}, replica=1)
    assert g.llm.ranks == (2, 6)
    assert g.holders_of(StageRef("vision", 0)) == (2, 6)
    assert g.rank_of(StageRef("vision", 0)) == 2
    # an encoder on ranks of its own is not shared
    disjoint = {"vision": Layout(dp=2, rank_offset=8), "llm": Layout(tp=2, pp=2, dp=2)}
    g = StageGraph.from_layouts(disjoint, {"vision": False, "llm": True}, replica=1)
    assert g.holders_of(StageRef("vision", 0)) == (9,)


# -- encoders never run arbitrarily far ahead of the LLM -----------------------------------------
def fast_encoder_costs(n: int) -> CostTable:
    """An encoder 20x faster than each LLM stage: ungated, it would run every forward at once."""
    entries = {("vision", 0, m, None): PhaseCost(0.1, 0.1, 0.1) for m in range(n)}
    return CostTable(entries, PhaseCost(2, 2, 2))


@pytest.mark.parametrize("family", ["1f1b", "zb", "interleaved"])
def test_disjoint_trainable_encoder_keeps_its_warm_up_depth_in_flight(family):
    g = StageGraph((ModuleStages("vision", (2,), (True,)), ModuleStages("llm", (0, 1), (True, True))))
    n = 16
    s = build_schedule(g, n, family, costs=fast_encoder_costs(n))
    depth = g.depth_to_end(StageRef("vision", 0))  # 3: its own stage and the LLM's two
    factor = 2 if family == "zb" else 1  # zb: plus as many deferred weight gradients
    assert validate(lower(s)).peak_in_flight[2] <= factor * depth
    # forward m + depth waits for the backward of m on the encoder's rank
    order = [str(a) for a in s.orders[2]]
    for m in range(n - factor * depth):  # a first stage's whole backward is its weight gradient
        assert order.index(f"vision.s0.W{m}") < order.index(f"vision.s0.F{m + factor * depth}")


def test_frozen_encoder_sends_no_more_rows_than_the_llm_has_taken():
    # a frozen encoder colocated on both ranks of an LLM pp2 pipeline: no backward, so nothing but
    # the LLM's first forwards taking its rows bounds it; rank 0 holds both, so its order shows it
    graph = shared_vision(False)
    n = 12
    s = build_1f1b(graph, n, costs=fast_encoder_costs(n))
    assert kinds_of(s, StageRef("vision", 0)) == {Kind.F}
    depth = graph.depth_to_end(StageRef("vision", 0))
    order = [str(a) for a in s.orders[0]]
    for m in range(n - depth):  # the forward of m + depth waits until the LLM took the rows of m
        assert order.index(f"llm.s0.F{m}") < order.index(f"vision.s0.F{m + depth}")
    validate(lower(s))


def test_colocated_encoder_forwards_wait_for_their_backwards():
    s = build_zero_bubble(shared_vision(True), 12, costs=fast_encoder_costs(12))
    depth = shared_vision(True).depth_to_end(StageRef("vision", 0))
    for rank in (0, 1):
        held, peak = 0, 0
        for a in s.orders[rank]:
            if a.stage_ref == StageRef("vision", 0):
                held += 1 if a.kind is Kind.F else -1
                peak = max(peak, held)
        assert peak <= 2 * depth  # zero bubble: the 1F1B depth plus as many deferred W
    validate(lower(s))
