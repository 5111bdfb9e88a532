"""A cheap replay of a schedule: every action's start and end, each rank running its list in order.

The generators' costs (`harmonia.schedule.costs.CostTable`) time the compute; communication is free.
It orders work (the per-batch search scores orders by the makespan) and gives the schedule's own
timeline, by which every rank merges the actions of the stage chunks it holds
(`harmonia.schedule.rank_actions`); the simulator (``harmonia.sim``) times transfers, collectives
and memory on top.
"""

from __future__ import annotations

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action
from harmonia.schedule.costs import CostTable
from harmonia.schedule.graph import IterationSchedule
from harmonia.schedule.validator import Checker


def replay(schedule: IterationSchedule, costs: CostTable | None = None) -> dict[tuple[int, int], tuple[float, float]]:
    """Start and end time of every action, each rank running its list in order.

    A compute action starts when its rank is free and its producers have ended; communication
    takes no time (a receive ends when the matching compute on the peer ends). An action of a
    stage held by several ranks has ended when every holder's share has.

    Returns:
        ``(rank, position in the rank's list)`` -> ``(start, end)``.

    Raises:
        ScheduleError: the orders deadlock (run `validate` for the step x rank table).
    """
    costs = costs or CostTable.uniform()
    checker = Checker(schedule)
    ends: dict[Action, float] = {}
    shares: dict[Action, list[float]] = {}  # ends of a shared stage's action on its holders so far
    times: dict[tuple[int, int], tuple[float, float]] = {}
    pos = {r: 0 for r in schedule.orders}
    free = {r: 0.0 for r in schedule.orders}
    progress = True
    while progress:
        progress = False
        for rank, acts in schedule.orders.items():
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                deps = checker.producers(a)
                if any(d not in ends for d in deps):
                    break
                start = max([free[rank], *(ends[d] for d in deps)])
                end = start + costs.duration(a, len(schedule.subs(a.module, a.microbatch)), rank)
                key = checker.done_key(a)
                copies = checker.copies(a)
                if copies > 1:
                    shares.setdefault(key, []).append(end)
                    if len(shares[key]) == copies:
                        ends[key] = max(shares[key])
                else:
                    ends[key] = end
                times[(rank, pos[rank])] = (start, end)
                free[rank] = end
                pos[rank] += 1
                progress = True
    stuck = {r: str(acts[pos[r]]) for r, acts in schedule.orders.items() if pos[r] < len(acts)}
    if stuck:
        raise ScheduleError(f"schedule deadlocks; ranks wait forever at {stuck}. "
                            "Run harmonia.schedule.validate() for the step x rank table")
    return times


def makespan(schedule: IterationSchedule, costs: CostTable | None = None) -> float:
    """End time of the last action under `replay`."""
    times = replay(schedule, costs)
    return max((end for _, end in times.values()), default=0.0)
