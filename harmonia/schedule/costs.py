"""Per-microbatch stage durations that generators use to order work, and a cheap replay.

Costs come from the cost model (``harmonia.workload.cost``) one iteration ahead; here they are plain
numbers: for each stage and microbatch (optionally each sub-microbatch) the seconds of F, B and W.
A fused BW lasts B + W. Communication is free in `replay`, which only orders work; the simulator
(``harmonia.sim``) adds transfers, collectives and memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action, Kind
from harmonia.schedule.graph import IterationSchedule
from harmonia.schedule.validator import Checker


@dataclass(frozen=True)
class PhaseCost:
    """Seconds of forward, input-gradient and weight-gradient work."""

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0

    def __post_init__(self) -> None:
        if min(self.F, self.B, self.W) < 0:
            raise ScheduleError(f"costs {self} must be non-negative seconds")

    def of(self, kind: Kind) -> float:
        if kind is Kind.BW:
            return self.B + self.W
        return {Kind.F: self.F, Kind.B: self.B, Kind.W: self.W}.get(kind, 0.0)


CostKey = tuple[str, int, int, "int | None"]


@dataclass(frozen=True)
class CostTable:
    """Durations per ``(module, stage, microbatch, sub)``; missing entries use ``default``.

    A sub-microbatch with no entry of its own takes its microbatch's entry divided by the number
    of sub-microbatches (``split``), so a table given per microbatch also serves split encoders.
    """

    entries: Mapping[CostKey, PhaseCost] = field(default_factory=dict)
    default: PhaseCost = PhaseCost()
    shares: Mapping[tuple[int, str, int, int], PhaseCost] = field(default_factory=dict)
    """``(rank, module, stage, microbatch)`` -> one holder's share of a stage held by several ranks
    (split over sub-microbatches like ``entries``); holders without one take ``entries``."""

    @staticmethod
    def uniform(F: float = 1.0, B: float = 1.0, W: float = 1.0) -> CostTable:
        """Every stage and microbatch costs the same."""
        return CostTable({}, PhaseCost(F, B, W))

    @staticmethod
    def from_microbatches(per_mb: Sequence[Mapping[tuple[str, int], tuple[float, float, float]]],
                          default: PhaseCost = PhaseCost()) -> CostTable:
        """From a list (one per microbatch) of ``{(module, stage): (F, B, W)}``."""
        entries = {(mod, st, m, None): PhaseCost(*fbw)
                   for m, stages in enumerate(per_mb) for (mod, st), fbw in stages.items()}
        return CostTable(entries, default)

    def phase(self, module: str, stage: int, microbatch: int, sub: int | None = None,
              split: int = 1) -> PhaseCost:
        """Durations of one stage for one (sub-)microbatch."""
        if sub is not None and (module, stage, microbatch, sub) in self.entries:
            return self.entries[(module, stage, microbatch, sub)]
        whole = self.entries.get((module, stage, microbatch, None), self.default)
        if sub is None or split <= 1:
            return whole
        return PhaseCost(whole.F / split, whole.B / split, whole.W / split)

    def duration(self, action: Action, split: int = 1, rank: int | None = None) -> float:
        """Seconds of a compute action (zero for communication), on ``rank`` when it has a share."""
        if not action.kind.is_compute:
            return 0.0
        share = self.shares.get((rank, action.module, action.stage, action.microbatch)) if self.shares else None
        if share is not None:
            return share.of(action.kind) / (split if action.sub is not None else 1)
        return self.phase(action.module, action.stage, action.microbatch, action.sub,
                          split).of(action.kind)


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
