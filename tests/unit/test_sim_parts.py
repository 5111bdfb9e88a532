"""Independent parts of a simulated iteration replay exactly as the whole iteration does.

The planner simulates a candidate one part at a time (sets of ranks no message crosses) and takes
the longest part as the iteration's time, so a part's tasks must start and end exactly when they
do in the whole simulation: checked on every recipe's placements (colocated, disjoint with an
encoder replica feeding several LLM replicas, encoders fused into the LLM's first stage), pp 1/2/4,
1F1B, zero-bubble and interleaved schedules, with and without recomputation. On the same plans,
each rank's activation peak found from its action order alone (`harmonia.sim.memory`, what the
search rejects plans by before timing them) is exactly the simulation's, and the bound of any
order (`activation_bound`, what a training step's memory check tries first) is never below it. A part's busiest column,
simulated with its messages from other ranks free, starts every task no later than the whole
simulation does (the bound the search drops candidates by before simulating their busiest part);
parts that the lockstep of a resharded chunk joins replay exactly too.
"""

from harmonia.plan.bounds import work_bound_busy
from harmonia.plan.recipes import candidate_schedule, simulate_work
from harmonia.plan.scenario import ScenarioRun
from harmonia.schedule.graph import LLM
from harmonia.sim.memory import activation_bound, activation_peaks
from harmonia.sim.parts import busiest_column, independent_parts, simulate_part
from tests.unit.test_plan_bounds import _describe, _scenario, _spread


def test_parts_replay_exactly_as_the_whole_iteration(shared_traces) -> None:
    from dataclasses import replace

    from harmonia.plan.recipes import resharded

    run = ScenarioRun(_scenario("llava-siglip-8b trainable, 16 GPUs", shared_traces))
    picked = _spread(run, per_family=1)
    twins = [replace(c, plan=twin) for c in picked if (twin := resharded(run.cost, c.plan)) is not None]
    several, shared_encoder, columns, locked = 0, 0, 0, 0
    for cand in picked + twins:  # the twins' LLM reshards per microbatch: its replicas run in lockstep
        plan = cand.plan
        iw = run.iteration_work(cand, 1)
        whole = simulate_work(cand, iw, run.cost, run.cluster, 0.0)
        parts = independent_parts(plan, run.cost, iw, work_bound_busy(plan, run.cost, run.cluster, iw)[1])
        ranks = [r for p in parts for r in p]
        assert sorted(ranks) == sorted({r for lay in plan.layouts.values() for r in lay.rank_list()}), _describe(cand)
        schedule = candidate_schedule(cand, run.cost, iw)
        timelines = [simulate_part(plan, run.cost, run.cluster, iw, schedule, p) for p in parts]
        assert max(t.iteration_s for t in timelines) == whole.iteration_s, _describe(cand)
        assert {r: v for t in timelines for r, v in t.peak_mem.items()} == whole.peak_mem, _describe(cand)
        assert _ends(timelines) == _ends([whole]), _describe(cand)
        assert activation_peaks(plan, iw, schedule) == whole.peak_mem, _describe(cand)
        bound = activation_bound(iw)  # any order's bound: never under the schedule's own peak
        assert all(bound.get(r, 0.0) >= peak * (1 - 1e-12) for r, peak in whole.peak_mem.items()), _describe(cand)
        assert activation_peaks(plan, iw, schedule, parts[0]) == timelines[0].peak_mem, _describe(cand)
        columns += _column_starts_no_later(cand, iw, schedule, parts[0], run, whole)
        locked += any(t.name.startswith("dp sync") for t in whole.tasks)
        several += len(parts) > 1
        llm = plan.layouts[LLM]
        shared_encoder += len(parts) < llm.dp  # some part joins LLM replicas through an encoder replica
    assert several and shared_encoder and columns and locked, (several, shared_encoder, columns, locked)


def _column_starts_no_later(cand, iw, schedule, part, run, whole) -> int:
    """Check the busiest column of ``part`` against the whole simulation ``whole``; 1 if the part
    has a column narrower than itself, else 0."""
    plan = cand.plan
    busy = work_bound_busy(plan, run.cost, run.cluster, iw)[1]
    column = busiest_column(plan, part, busy)
    if column is None:
        return 0
    llm = plan.layouts[LLM]
    assert len(column) == llm.pp and set(column) < set(part), _describe(cand)
    assert len({tuple(llm.coords(r)[a] for a in ("dp", "cp", "tp")) for r in column}) == 1, _describe(cand)
    timeline = simulate_part(plan, run.cost, run.cluster, iw, schedule, column, closed=False)
    starts = _starts([whole])
    for (rank, name), at in _starts([timeline]).items():
        assert all(a <= b + 1e-12 for a, b in zip(at, starts[(rank, name)], strict=True)), (_describe(cand), name)
    assert timeline.iteration_s <= whole.iteration_s + 1e-12, _describe(cand)
    return 1


def _starts(timelines) -> dict[tuple[int, str], list[float]]:
    return _times(timelines, "start")


def _ends(timelines) -> dict[tuple[int, str], list[float]]:
    return _times(timelines, "end")


def _times(timelines, which: str) -> dict[tuple[int, str], list[float]]:
    """Every task's start or end (``which``), by rank and name (a name may repeat on a rank: its
    times in order)."""
    out: dict[tuple[int, str], list[float]] = {}
    for tl in timelines:
        for task, at in zip(tl.tasks, getattr(tl, which)):
            out.setdefault((task.rank, task.name), []).append(float(at))
    return out


def test_ranks_that_share_a_nodes_cores_are_one_part_and_replay_as_the_whole() -> None:
    """Four ranks on two cores compute at a rate set by how many compute at once: split into data-parallel
    parts, each would have the cores to itself and replay faster than the whole iteration does."""
    from harmonia.plan.recipes import candidates
    from harmonia.plan.scenario import Scenario

    run = ScenarioRun(Scenario("cores", "tiny-vlm", "cpu:1x4@2", "synthetic:image=0.7,text=0.3", 32,
                               {"vision": "frozen"}, iterations=1, search_batches=1))
    args = (run.cost, run.cluster, run.profile, 32, "tiny-vlm")
    cand = next(c for c in candidates("harmonia", *args) if c.plan.layouts[LLM].dp == 4)
    iw = run.iteration_work(cand, 1)
    whole = simulate_work(cand, iw, run.cost, run.cluster, 0.0)
    apart = independent_parts(cand.plan, run.cost, iw)
    assert len(apart) == 4  # no message crosses the replicas
    assert independent_parts(cand.plan, run.cost, iw, cluster=run.cluster) == [(0, 1, 2, 3)]
    schedule = candidate_schedule(cand, run.cost, iw)
    alone = max(simulate_part(cand.plan, run.cost, run.cluster, iw, schedule, p).iteration_s for p in apart)
    assert alone < 0.9 * whole.iteration_s  # what the search took for the iteration before
    together = simulate_part(cand.plan, run.cost, run.cluster, iw, schedule, (0, 1, 2, 3)).iteration_s
    assert together == whole.iteration_s
