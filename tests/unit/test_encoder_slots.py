"""Colocated encoder work placed per rank by each encoder replica's own costs
(`harmonia.schedule.encoder_slots`), and the TP x CP lockstep of LLM phases that makes it pay
(`harmonia.sim.tasks`)."""

from dataclasses import replace

from harmonia.schedule.actions import Action, Kind
from harmonia.schedule.costs import CostTable, PhaseCost
from harmonia.schedule.encoder_slots import DELAY, LOOKAHEAD, group_members, place_encoder_work
from harmonia.schedule.graph import LLM
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.rank_actions import _Lists, plan_rank_actions
from harmonia.schedule.stagework import iteration_schedule, plan_iteration_work
from harmonia.sim.engine import replay
from harmonia.sim.tasks import build_tasks, simulate_schedule
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.traces import synthesize_trace
from tests.unit.iteration_helpers import assignment
from tests.unit.test_rank_actions import _messages_pair_up, iteration

CLUSTER = cluster_from_string("h100:1x8")
A, B = (("vision", 0),), (("vision", 1),)


def _video_iteration(n_microbatches: int = 4, vision: Layout = Layout(dp=2)):
    """internvl-8b, vision dp2 and llm cp2 colocated on 2 ranks: one LLM group holding two encoder
    replicas; 2 samples per microbatch, videos and short images, so each microbatch's encoder work
    sits mostly on one replica."""
    from harmonia.model.presets import mllm_preset

    cost = CostModel(mllm_preset("internvl-8b"), device_preset("h100"))
    plan = Plan("internvl-8b", {"vision": vision, "llm": Layout(cp=2)}, "colocated", "1f1b",
                n_microbatches=n_microbatches, global_batch=2 * n_microbatches, recompute=("vision",))
    samples = synthesize_trace(2 * n_microbatches, {"long_video": 0.5, "image": 0.5}, seed=11)
    per_replica = [[[2 * i, 2 * i + 1] for i in range(n_microbatches)]]
    iw = plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, per_replica))
    return plan, cost, iw, iteration_schedule(plan, cost, iw)


def _unplaced(schedule):
    """The same schedule without each replica's own costs: every rank keeps the schedule's order."""
    return replace(schedule, costs=replace(schedule.costs, replicas={}), chunk_actions=None, placements=None)


def _slot_of(actions: list[Action], movable: tuple[str, ...]) -> dict[Action, int]:
    """Each movable encoder action's slot: the number of other actions before it."""
    out, j = {}, 0
    for a in actions:
        if a.module in movable:
            out[a] = j
        else:
            j += 1
    return out


def _check_placement(ordered: list[Action], placed: list[Action], movable: tuple[str, ...] = ("vision",)) -> int:
    """A placed list against the schedule's: same actions, the others' and each kind's order kept,
    forwards up to LOOKAHEAD slots earlier, backwards up to DELAY later (or to the last slot).
    Returns how many actions moved."""
    assert sorted(map(str, placed)) == sorted(map(str, ordered))
    assert [a for a in placed if a.module not in movable] == [a for a in ordered if a.module not in movable]
    for forward in (True, False):
        pick = [a for a in ordered if a.module in movable and (a.kind is Kind.F) == forward]
        assert [a for a in placed if a.module in movable and (a.kind is Kind.F) == forward] == pick
    before, after = _slot_of(ordered, movable), _slot_of(placed, movable)
    last = len([a for a in ordered if a.module not in movable])
    for a, j in before.items():
        if a.kind is Kind.F:
            assert j - LOOKAHEAD <= after[a] <= j, a
        else:
            assert j <= after[a] <= j + DELAY or after[a] == last, a
    return sum(before[a] != after[a] for a in before)


def test_equal_replicas_keep_the_schedules_order() -> None:
    ordered = [Action("vision", 0, Kind.F, 0), Action(LLM, 0, Kind.F, 0), Action(LLM, 0, Kind.BW, 0),
               Action("vision", 0, Kind.F, 1), Action("vision", 0, Kind.W, 0), Action(LLM, 0, Kind.F, 1),
               Action(LLM, 0, Kind.BW, 1), Action("vision", 0, Kind.W, 1)]
    graph = _video_iteration()[3].graph
    costs = CostTable(replicas={("vision", e, 0, m, None): PhaseCost(1.0, 2.0, 1.0) for e in (0, 1) for m in (0, 1)})
    assert place_encoder_work(ordered, ("vision",), {A, B}, costs, graph) == {A: ordered, B: ordered}


def test_a_rank_runs_its_next_forward_while_its_group_waits_for_another_replica() -> None:
    """Replica 0 encodes microbatch 1 (4 s) while replica 1 has nothing; replica 1 encodes
    microbatch 2 (4 s): it runs it beside replica 0's, and the two slots take 4 s, not 8. Units a
    replica has no data in take no time and move wherever they fit."""
    graph = _video_iteration()[3].graph
    v = [Action("vision", 0, Kind.F, m) for m in range(3)]
    llm = [Action(LLM, 0, k, m) for m in range(3) for k in (Kind.F, Kind.BW)]
    ordered = [v[0], llm[0], llm[1], v[1], llm[2], llm[3], v[2], llm[4], llm[5]]
    costs = CostTable(replicas={("vision", 0, 0, 1, None): PhaseCost(4.0, 0.0, 0.0),
                                ("vision", 1, 0, 2, None): PhaseCost(4.0, 0.0, 0.0)})
    out = place_encoder_work(ordered, ("vision",), {A, B}, costs, graph)
    assert out[A] == [v[0], llm[0], llm[1], v[1], v[2], llm[2], llm[3], llm[4], llm[5]]
    assert out[B] == [v[0], v[1], llm[0], llm[1], v[2], llm[2], llm[3], llm[4], llm[5]]
    assert _check_placement(ordered, out[A]) == 1 and _check_placement(ordered, out[B]) == 2


def test_placement_on_a_video_iteration_moves_work_and_shortens_the_step() -> None:
    plan, cost, iw, schedule = _video_iteration(8)
    placed = plan_rank_actions(plan.layouts, schedule)
    ordered = plan_rank_actions(plan.layouts, _unplaced(schedule))
    compute = {r: [a for a in acts if a.kind.is_compute] for r, acts in placed.items()}
    moved = sum(_check_placement([a for a in ordered[r] if a.kind.is_compute], compute[r]) for r in placed)
    assert moved > 0
    _messages_pair_up(placed)
    for rank in placed:  # the executor's own call gives the same list
        assert plan_rank_actions(plan.layouts, schedule, [rank])[rank] == placed[rank]
    with_placement = simulate_schedule(plan, cost, CLUSTER, iw, schedule).iteration_s
    without = simulate_schedule(plan, cost, CLUSTER, iw, _unplaced(schedule)).iteration_s
    assert with_placement < 0.97 * without


def test_the_llm_groups_phases_run_in_lockstep_where_its_ranks_hold_different_encoder_replicas() -> None:
    """The LLM's TP x CP collectives meet once every rank of the group has finished what it ran
    before: each LLM phase starts at once on both ranks, and the rank with less encoder work waits."""
    plan, cost, iw, schedule = _video_iteration()
    schedule = _unplaced(schedule)
    tasks, queue, comm = build_tasks(plan, cost, iw, plan_rank_actions(plan.layouts, schedule), schedule.graph,
                                     CLUSTER)
    timeline = replay(tasks, queue, comm)
    starts: dict[Action, list[float]] = {}
    for rank in (0, 1):
        for i in queue[rank]:
            a = tasks[i].action
            if a is not None and a.module == LLM and a.kind.is_compute:
                starts.setdefault(a, []).append(timeline.start[i])
    assert starts and all(len(s) == 2 and abs(s[0] - s[1]) < 1e-12 for s in starts.values())
    assert any(t.name.startswith("tp x cp sync") for t in tasks)
    same, cost, iw, schedule = _video_iteration(vision=Layout(tp=2))  # one replica on both ranks
    tasks = build_tasks(same, cost, iw, plan_rank_actions(same.layouts, schedule), schedule.graph, CLUSTER)[0]
    assert not any(" sync " in t.name for t in tasks)


def test_a_group_keeps_the_order_where_an_encoder_replica_reaches_past_it() -> None:
    layouts = {"vision": Layout(tp=4), "audio": Layout(dp=4), "llm": Layout(tp=2, dp=2)}
    assert group_members(layouts, ("vision", "audio"), (0, 1)) is None  # vision's replica spans ranks 0-3
    layouts = {"vision": Layout(tp=2, dp=2), "llm": Layout(tp=2, dp=2)}
    assert group_members(layouts, ("vision",), (0, 1)) is None  # one replica per group: nothing to balance
    layouts = {"vision": Layout(dp=4), "llm": Layout(tp=2, dp=2)}
    assert group_members(layouts, ("vision",), (0, 1)) == {0: A, 1: B}


def test_random_plans_place_within_bounds_without_deadlock() -> None:
    """The property suite's random plans (`tests.unit.test_rank_actions.iteration`): wherever some
    rank's list moved, every list keeps the bounds, messages pair up and the replay ends."""
    from tests.unit.test_rank_actions import CLUSTER as RANDOM_CLUSTER, COST

    placed = 0
    for seed in range(200):
        plan, iw, schedule = iteration(seed)
        lists = _Lists(plan.layouts, schedule)
        ranks = sorted({r for lay in plan.layouts.values() for r in lay.rank_list()})
        if all(lists.placed(r) == lists.ordered_list(r) for r in ranks):
            continue
        placed += 1
        for r in ranks:
            _check_placement(lists.ordered_list(r), lists.placed(r), lists.movable)
        actions = plan_rank_actions(plan.layouts, schedule)
        _messages_pair_up(actions)
        replay(*build_tasks(plan, COST, iw, actions, schedule.graph, RANDOM_CLUSTER))  # raises on a deadlock
    assert placed >= 5
