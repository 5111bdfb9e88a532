"""Per-microbatch stage durations that generators use to order work.

Costs come from the cost model (``harmonia.workload.cost``) one iteration ahead; here they are plain
numbers: for each stage and microbatch (optionally each sub-microbatch) the seconds of F, B and W.
A fused BW lasts B + W. `harmonia.schedule.replay` times a schedule with them (communication free);
the simulator (``harmonia.sim``) adds transfers, collectives and memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action, Kind


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
    replicas: Mapping[tuple[str, int, int, int, int | None], PhaseCost] = field(default_factory=dict)
    """``(encoder, replica, stage, microbatch, sub)`` -> that encoder replica's own durations, where it
    has data, for the encoders each rank places its forwards by (`harmonia.schedule.encoder_slots`);
    empty: every rank keeps the schedule's order."""

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
