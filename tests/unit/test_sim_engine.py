"""The replay engine against hand-computed timelines."""

import pytest

from harmonia.errors import ScheduleError
from harmonia.sim.engine import Task, replay


def two_stage_gpipe(f: float, b: float, delay: float) -> tuple[list[Task], dict[int, list[int]]]:
    """Two stages, two microbatches, GPipe: F0 F1 | B0 B1 on each stage."""
    tasks = [
        Task("s0.F0", 0, f), Task("s0.F1", 0, f),
        Task("s1.F0", 1, f, [(0, delay)]), Task("s1.F1", 1, f, [(1, delay)]),
        Task("s1.B0", 1, b, [(2, 0)]), Task("s1.B1", 1, b, [(3, 0)]),
        Task("s0.B0", 0, b, [(4, delay)]), Task("s0.B1", 0, b, [(5, delay)]),
    ]
    return tasks, {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}


def test_gpipe_two_stages_exact_times() -> None:
    tasks, order = two_stage_gpipe(f=1.0, b=2.0, delay=0.5)
    tl = replay(tasks, order)
    # stage 1: F0 at 1.5-2.5, F1 2.5-3.5, B0 3.5-5.5, B1 5.5-7.5; stage 0: B0 at 6-8, B1 8-10
    assert list(tl.start) == [0, 1, 1.5, 2.5, 3.5, 5.5, 6, 8]
    assert tl.iteration_s == 10
    assert tl.busy_s == {0: 6, 1: 6}
    assert tl.bubble_frac == pytest.approx(1 - 12 / 20)


def test_memory_peak_counts_in_flight_activations() -> None:
    tasks, order = two_stage_gpipe(1.0, 2.0, 0.0)
    for t in tasks:
        t.mem_delta = 10.0 if ".F" in t.name else -10.0
    assert replay(tasks, order).peak_mem == {0: 20.0, 1: 20.0}


def test_communication_stream_overlaps_compute() -> None:
    tasks = [Task("F", 0, 1.0), Task("W", 0, 1.0, [(0, 0)]), Task("allreduce", 0, 3.0, [(0, 0)], kind="C"),
             Task("F2", 0, 1.0, [(1, 0)])]
    tl = replay(tasks, {0: [0, 1, 3]}, {0: [2]})
    assert tl.end[3] == 3.0 and tl.iteration_s == 4.0 and tl.busy_s[0] == 3.0


def test_deadlock_names_the_blocked_tasks() -> None:
    tasks = [Task("a", 0, 1.0, [(1, 0)]), Task("b", 1, 1.0, [(0, 0)])]
    with pytest.raises(ScheduleError, match="rank 0 at a waits for b"):
        replay(tasks, {0: [0], 1: [1]})


def test_hundred_thousand_tasks_replay_exactly() -> None:
    ranks, per_rank = 100, 1000
    tasks, order = [], {r: [] for r in range(ranks)}
    for r in range(ranks):
        for k in range(per_rank):
            deps = [(len(tasks) - per_rank, 1e-5)] if r > 0 else []
            order[r].append(len(tasks))
            tasks.append(Task(f"r{r}.{k}", r, 1e-3, deps))
    tl = replay(tasks, order)
    assert tl.iteration_s == pytest.approx(per_rank * 1e-3 + 99 * (1e-3 + 1e-5))
