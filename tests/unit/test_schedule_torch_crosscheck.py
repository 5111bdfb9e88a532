"""Cross-check single-module schedules against torch.distributed.pipelining (no process group).

torch's per-rank orders come from ``get_schedule_ops`` (mock stages, no communication). They are
converted to harmonia actions (torch ``B`` = our fused ``BW``, ``I`` = our ``B``) and both sides
are checked by our validator and compared in lock-step steps (one action per step). Deliberate
differences, each asserted below:

- Frozen-awareness: torch's first stage computes an input gradient nobody consumes; ours runs
  W only. The conversion drops that input gradient (``I``) and turns a full ``B`` into ``W``.
- torch 2.13's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards 1..n instead of
  0..n-1 (it is only used for visualisation); the validator catches it and the test shifts them.
- Zero bubble: torch's ZB1P / ZBV orders are hand-derived for equal F, B, W; ours place W by
  replaying the given costs, and gate memory per stage, so the step counts differ by a little.
"""

import warnings

import pytest

pipelining = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")

from harmonia.errors import ScheduleError  # noqa: E402
from harmonia.schedule import (Action, CostTable, IterationSchedule, ModuleStages, StageGraph,  # noqa: E402
                               StageRef, build_1f1b, build_gpipe, build_interleaved_1f1b,
                               build_zero_bubble, lower, validate)

TORCH_KIND = {"F": "F", "B": "BW", "I": "B", "W": "W"}
#: step semantics: BW is one step, so the list scheduler must see B + W == F
STEP_COSTS = CostTable.uniform(1, 0.5, 0.5)


def torch_ops(name: str, pp: int, n: int, v: int | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipelining.get_schedule_ops(name, pp, n, v)


def llm_graph(pp: int, v: int = 1, v_shape: bool = False) -> StageGraph:
    ranks = tuple(range(pp)) + tuple(reversed(range(pp))) if v_shape else tuple(range(pp)) * v
    return StageGraph((ModuleStages("llm", ranks, (True,) * len(ranks)),))


def from_torch(ops, graph: StageGraph, n: int, shift_last_forward: bool = False) -> IterationSchedule:
    """torch per-rank actions -> a harmonia schedule (compute only, frozen-aware)."""
    orders = {r: [] for r in graph.ranks()}
    last = graph.llm.n_stages - 1
    for acts in ops:
        for a in acts:
            if a is None or a.computation_type.value not in TORCH_KIND:
                continue  # idle slots and REDUCE_GRAD
            kind = TORCH_KIND[a.computation_type.value]
            if not graph.needs_b(StageRef("llm", a.stage_index)):
                if kind == "B":
                    continue
                kind = "W" if kind == "BW" else kind
            mb = a.microbatch_index - (shift_last_forward and kind == "F" and a.stage_index == last)
            orders[graph.llm.ranks[a.stage_index]].append(Action("llm", a.stage_index, kind, mb))
    return IterationSchedule(graph, n, {}, orders, "torch")


@pytest.mark.parametrize("pp,n", [(2, 4), (4, 4), (4, 8), (3, 7)])
@pytest.mark.parametrize("name,build", [("GPipe", build_gpipe), ("1F1B", build_1f1b)])
def test_single_stage_schedules_are_identical(name, build, pp, n):
    graph = llm_graph(pp)
    theirs = from_torch(torch_ops(name, pp, n), graph, n, shift_last_forward=name == "1F1B")
    ours = build(graph, n, costs=STEP_COSTS)
    assert ours.orders == theirs.orders
    assert validate(theirs).n_steps == validate(ours).n_steps
    validate(lower(ours))


def test_validator_catches_torch_1f1b_visualisation_numbering():
    graph = llm_graph(4)
    with pytest.raises(ScheduleError, match="llm.s3.F8: no such"):
        validate(from_torch(torch_ops("1F1B", 4, 8), graph, 8))


@pytest.mark.parametrize("pp,n,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 2), (4, 3, 2), (2, 4, 3)])
def test_interleaved_1f1b_same_steps_and_memory(pp, n, v):
    graph = llm_graph(pp, v)
    theirs = validate(from_torch(torch_ops("Interleaved1F1B", pp, n, v), graph, n))
    schedule = build_interleaved_1f1b(graph, n, costs=STEP_COSTS)
    ours = validate(schedule)
    assert ours.n_steps == theirs.n_steps and ours.bubbles() == theirs.bubbles()
    assert ours.peak_in_flight == theirs.peak_in_flight
    validate(lower(schedule))


@pytest.mark.parametrize("pp,n", [(2, 4), (4, 4), (4, 8), (4, 12)])
def test_interleaved_zero_bubble_within_two_steps(pp, n):
    graph = llm_graph(pp, 2)
    theirs = validate(from_torch(torch_ops("InterleavedZeroBubble", pp, n, 2), graph, n))
    ours = validate(build_interleaved_1f1b(graph, n, split=True))
    assert theirs.n_steps <= ours.n_steps <= theirs.n_steps + 2


@pytest.mark.parametrize("pp,n", [(2, 4), (4, 8), (4, 12), (3, 7), (4, 4)])
def test_zbv_same_steps_or_fewer(pp, n):
    graph = llm_graph(pp, v_shape=True)  # chunk pp-1-r and pp+r on rank r ("V")
    theirs = validate(from_torch(torch_ops("ZBVZeroBubble", pp, n, 2), graph, n))
    ours = validate(build_zero_bubble(graph, n))
    assert ours.n_steps <= theirs.n_steps
    assert ours.bubbles() <= theirs.bubbles()
    # our per-stage 1F1B gates let the V's first chunk run further ahead: more memory, bounded
    assert max(ours.peak_in_flight.values()) <= 2 * max(theirs.peak_in_flight.values())
