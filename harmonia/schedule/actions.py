"""The action IR: one step of one rank, with a text form that round-trips, and CSV load/dump.

An action names a stage of a module and what happens there for one microbatch::

    llm.s1.F3                 forward of LLM stage 1 for microbatch 3
    vision.s0.F2.1            forward of vision stage 0 for sub-microbatch 1 of microbatch 2
    llm.s2.BW0                fused backward (input and weight gradients)
    llm.s2.B0 / llm.s2.W0     split backward: input gradient, then weight gradient
    llm.s0.RECV_F3@r1         receive microbatch 3's activations of stage s-1 from rank 1
    llm.s1.SEND_B3@r0         send microbatch 3's input gradient to stage s-1 on rank 0
    vision.s1.SEND_F3.1>llm.s0@r2   boundary: encoder output of sub-microbatch 1 to the LLM
    llm.s0.RECV_F3.1<vision.s1@r0   the matching receive on the LLM's first stage
    vision.s1.SEND_F3>llm.s0        a rank's whole boundary transfer of microbatch 3 (its rows go
                                    where the batch's boundary plan says; no single peer rank)
    llm.s1.REDUCE             the stage chunk's gradient reduction over its dp x cp group, started
                              after its last backward of the iteration

Within a module the peer stage of a communication is implicit (``SEND_F``/``RECV_B`` talk to
stage s+1, ``RECV_F``/``SEND_B`` to stage s-1); across a module boundary it is written after
``>`` (send) or ``<`` (receive). ``@rK`` names the peer rank once lowering has placed it.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from harmonia.errors import ScheduleError


class Kind(str, Enum):
    """What an action does."""

    F = "F"  # forward
    B = "B"  # backward, input gradient (and the activation gradients W needs)
    W = "W"  # backward, weight gradient
    BW = "BW"  # fused backward: B and W in one pass
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE = "REDUCE"  # gradient reduction of a stage chunk (a collective; no microbatch)

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_F, Kind.RECV_B)


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})
BACKWARD_KINDS = frozenset({Kind.B, Kind.W, Kind.BW})

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_VALID_MODULES: set[str] = set()  # names already checked against _NAME
_KINDS = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(
    rf"^(?P<module>{_NAME})\.s(?P<stage>\d+)\.(?P<kind>{_KINDS})(?P<mb>\d+)?(?:\.(?P<sub>\d+))?"
    rf"(?:(?P<dir>[<>])(?P<pmod>{_NAME})\.s(?P<pstage>\d+))?(?:@r(?P<prank>\d+))?$"
)


class _computed_once:
    """A property computed on first access and kept on the instance (functools.cached_property
    without its per-access lock, for the hot paths of the schedulers)."""

    def __init__(self, fn) -> None:
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True, order=True)
class StageRef:
    """One stage chunk of one module."""

    module: str
    stage: int

    def __str__(self) -> str:
        return f"{self.module}.s{self.stage}"


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank.

    Attributes:
        module: module name (``llm``, ``vision``, ...).
        stage: stage chunk index inside the module.
        kind: F, B, W, BW or a send/receive.
        microbatch: microbatch index (0 for a REDUCE, which covers every microbatch).
        sub: sub-microbatch index on encoder stages; None when the microbatch is not split.
        peer: for a boundary transfer, the other module's stage; None within a module.
        peer_rank: for a communication, the rank on the other end (set by lowering).
    """

    module: str
    stage: int
    kind: Kind
    microbatch: int
    sub: int | None = None
    peer: StageRef | None = None
    peer_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))
        if self.module not in _VALID_MODULES:
            if not re.fullmatch(_NAME, self.module):
                raise ScheduleError(f"module name {self.module!r} is invalid: use letters, digits, _")
            _VALID_MODULES.add(self.module)
        if self.stage < 0 or self.microbatch < 0 or (self.sub is not None and self.sub < 0):
            raise ScheduleError(f"action {self}: stage, microbatch and sub must be >= 0")
        if (self.kind.is_compute or self.kind is Kind.REDUCE) and (self.peer is not None or self.peer_rank is not None):
            raise ScheduleError(f"compute action {self.module}.s{self.stage}.{self.kind.value} "
                                "cannot name a peer; only sends and receives do")
        if self.kind is Kind.REDUCE and (self.microbatch or self.sub is not None):
            raise ScheduleError(f"{self.module}.s{self.stage}.REDUCE covers the whole iteration; it has no "
                                "microbatch or sub-microbatch")

    @_computed_once
    def stage_ref(self) -> StageRef:
        return StageRef(self.module, self.stage)

    @property
    def unit(self) -> tuple[int, int | None]:
        """(microbatch, sub) — the piece of data the action works on."""
        return self.microbatch, self.sub

    def peer_stage(self) -> StageRef:
        """The stage on the other end of a communication (explicit or the adjacent stage)."""
        if self.kind.is_compute or self.kind is Kind.REDUCE:
            raise ScheduleError(f"{self} is a compute action and has no peer")
        if self.peer is not None:
            return self.peer
        step = 1 if self.kind in (Kind.SEND_F, Kind.RECV_B) else -1
        return StageRef(self.module, self.stage + step)

    def compute(self) -> Action:
        """The same action with no peer fields (identity of the compute step)."""
        return Action(self.module, self.stage, self.kind, self.microbatch, self.sub)

    def __str__(self) -> str:
        if self.kind is Kind.REDUCE:
            return f"{self.module}.s{self.stage}.REDUCE"
        text = f"{self.module}.s{self.stage}.{self.kind.value}{self.microbatch}"
        if self.sub is not None:
            text += f".{self.sub}"
        if self.peer is not None:
            text += (">" if self.kind.is_send else "<") + str(self.peer)
        if self.peer_rank is not None:
            text += f"@r{self.peer_rank}"
        return text

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str(action)``; raises ScheduleError on malformed text."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected e.g. 'llm.s1.F3', 'vision.s0.F2.1', "
                "'llm.s0.RECV_F3@r1' or 'llm.s0.RECV_F3.1<vision.s1@r0'"
            )
        g = match.groupdict()
        kind = Kind(g["kind"])
        if (g["mb"] is None) != (kind is Kind.REDUCE):
            raise ScheduleError(f"cannot parse action {text!r}: every kind but REDUCE names its microbatch")
        peer = StageRef(g["pmod"], int(g["pstage"])) if g["pmod"] else None
        if peer is not None and (kind.is_compute or (g["dir"] == ">") != kind.is_send):
            raise ScheduleError(f"action {text!r}: use '>' after a send and '<' after a receive")
        return Action(g["module"], int(g["stage"]), kind, int(g["mb"] or 0),
                      int(g["sub"]) if g["sub"] is not None else None, peer,
                      int(g["prank"]) if g["prank"] is not None else None)


def dump_csv(orders: dict[int, list[Action]], path: str | Path) -> None:
    """Write one row per rank: the rank, then its actions in order."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(orders):
            writer.writerow([rank, *(str(a) for a in orders[rank])])


def load_csv(path: str | Path) -> dict[int, list[Action]]:
    """Read rows written by `dump_csv`; empty cells are skipped."""
    orders: dict[int, list[Action]] = {}
    with open(path, newline="") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            if not row:
                continue
            try:
                rank = int(row[0])
            except ValueError:
                raise ScheduleError(f"{path}:{line}: first cell {row[0]!r} must be a rank number") from None
            if rank in orders:
                raise ScheduleError(f"{path}:{line}: rank {rank} appears twice; give one row per rank")
            orders[rank] = [Action.parse(cell) for cell in row[1:] if cell.strip()]
    return orders
