"""Validate a schedule: completeness, dependencies, matched communication, no deadlock, memory.

`validate` runs three passes and raises `ScheduleError` with a step x rank table on the first
failing one, the offending cells marked ``>>like this<<``:

1. Static: every action sits on a rank that holds its stage; every stage runs F (and B, W or BW
   where the stage needs them, see `StageGraph`) exactly once per (sub-)microbatch on each of its
   holders; every send has exactly one matching receive on the peer rank.
2. Dry run: all ranks advance in lock-step, one action per step, an action running once what it
   consumes exists (a compute on another rank, or, in a lowered schedule, the local receive; a
   receive once the matching send ran; a shared stage's compute once every holder ran it). Sends
   never block. A rank whose next action can never run is a deadlock.
3. Memory: activations in flight per rank (a stage's (sub-)microbatch counts from its F until its
   last backward action; a sub-microbatch counts as a fraction) stay under ``max_in_flight``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.graph import IterationSchedule

Message = tuple[str, StageRef, StageRef, int, "int | None"]


@dataclass
class DryRun:
    """Result of a successful lock-step dry run.

    Attributes:
        grid: one dict per step, rank -> the action it ran at that step.
        peak_in_flight: rank -> most activations held at once (in microbatch-stage units).
    """

    grid: list[dict[int, Action]] = field(default_factory=list)
    peak_in_flight: dict[int, float] = field(default_factory=dict)

    @property
    def n_steps(self) -> int:
        return len(self.grid)

    def bubbles(self, ranks: list[int] | None = None) -> int:
        """Idle (rank, step) cells between the first and the last step."""
        ranks = ranks if ranks is not None else sorted({r for row in self.grid for r in row})
        return self.n_steps * len(ranks) - sum(len(row) for row in self.grid)

    def table(self) -> str:
        return format_table(_grid_columns(self.grid))


class Checker:
    """Dependency keys of a schedule's actions; shared by the dry run and `replay`."""

    def __init__(self, schedule: IterationSchedule) -> None:
        self.schedule = schedule
        self.graph = schedule.graph
        self.lowered = schedule.is_lowered()
        fused = {a.stage_ref for acts in schedule.orders.values() for a in acts if a.kind is Kind.BW}
        self._grad = {s: (Kind.BW if s in fused else Kind.B) for s in self.graph.stages()}
        known = schedule.producers
        self._known = known[1] if known is not None and not self.lowered and known[0] == self._grad else {}

    def grad_kind(self, ref: StageRef) -> Kind:
        """B or BW: the action producing ``ref``'s input gradient in this schedule."""
        return self._grad[ref]

    def done_key(self, action: Action) -> Hashable:
        """The key under which an action's completion is recorded."""
        return done_key(action)

    def copies(self, action: Action) -> int:
        """How many ranks run the action: every holder of a shared stage's compute, else one."""
        return len(self.graph.holders_of(action.stage_ref)) if action.kind.is_compute else 1

    def producers(self, action: Action) -> list[Hashable]:
        """Keys that must be done before ``action`` can run."""
        if action.kind.is_send:
            return [self._send_source(action)]
        if action.kind.is_recv:
            return [("send", message(action))]
        if not self.lowered and action in self._known:
            return self._known[action]
        rank = self.graph.rank_of(action.stage_ref)
        keys: list[Hashable] = []
        for p in self.graph.producers(action, self.schedule.subs, self.grad_kind):
            if not self.lowered or self.graph.rank_of(p.stage_ref) == rank:
                keys.append(p)
            else:
                keys.append(("recv", data_message(p, action)))
        return keys

    def _send_source(self, send: Action) -> Action:
        """The local compute whose output a send carries."""
        ref, mb, sub = send.stage_ref, send.microbatch, send.sub
        if send.kind is Kind.SEND_F:
            return Action(ref.module, ref.stage, Kind.F, mb, sub)
        crosses = send.peer is not None and send.peer.module != ref.module
        return Action(ref.module, ref.stage, self.grad_kind(ref), mb, None if crosses else sub)

    def final_backward(self, ref: StageRef) -> Kind | None:
        """The action after which a stage frees a (sub-)microbatch's activations."""
        if not self.graph.needs_backward(ref):
            return None
        if self.graph.needs_w(ref):
            return Kind.BW if self._grad[ref] is Kind.BW and self.graph.needs_b(ref) else Kind.W
        return Kind.B


def done_key(action: Action) -> Hashable:
    """Identity of an action's completion: the compute action, or ("send"/"recv", message)."""
    if action.kind.is_compute:
        return action.compute()
    return ("send" if action.kind.is_send else "recv", message(action))


def message(action: Action) -> Message:
    """(direction, source stage, destination stage, microbatch, sub) of a send or receive."""
    direction = "F" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "B"
    own, other = action.stage_ref, action.peer_stage()
    src, dst = (own, other) if action.kind.is_send else (other, own)
    return direction, src, dst, action.microbatch, action.sub


def data_message(producer: Action, consumer: Action) -> Message:
    """The message carrying ``producer``'s output to ``consumer`` (encoder-side sub index)."""
    direction = "F" if producer.kind is Kind.F else "B"
    sub = producer.sub if direction == "F" else consumer.sub
    return direction, producer.stage_ref, consumer.stage_ref, consumer.microbatch, sub


def expected_compute(schedule: IterationSchedule, ref: StageRef, microbatch: int,
                     sub: int | None) -> list[set[Kind]]:
    """Accepted sets of compute kinds of one stage and (sub-)microbatch (one set must match)."""
    g = schedule.graph
    b, w = g.needs_b(ref), g.needs_w(ref)
    if b and w:
        return [{Kind.F, Kind.BW}, {Kind.F, Kind.B, Kind.W}]
    return [{Kind.F} | ({Kind.B} if b else set()) | ({Kind.W} if w else set())]


# -- pass 1: static checks ---------------------------------------------------------------------
def static_problems(schedule: IterationSchedule) -> list[tuple[str, list[tuple[int, int]]]]:
    """Problems found without running: (message, cells as (rank, position))."""
    g = schedule.graph
    problems: list[tuple[str, list[tuple[int, int]]]] = []
    seen: dict[Hashable, tuple[int, int]] = {}
    kinds: dict[tuple[StageRef, int, int | None], set[Kind]] = {}
    for rank, acts in schedule.orders.items():
        for i, a in enumerate(acts):
            cell = [(rank, i)]
            if not g.has_stage(a.stage_ref):
                problems.append((f"{a}: stage {a.stage_ref} is not in the stage graph", cell))
                continue
            if rank not in g.holders_of(a.stage_ref):
                problems.append((f"{a} is on rank {rank}, but {a.stage_ref} lives on rank "
                                 f"{'/'.join(map(str, g.holders_of(a.stage_ref)))}", cell))
            if not a.kind.is_compute:
                problems.extend(_comm_problems(schedule, a, cell))
            elif not _unit_exists(schedule, a):
                problems.append((f"{a}: no such (sub-)microbatch (n_microbatches="
                                 f"{schedule.n_microbatches}, n_sub {schedule.n_sub.get(a.module)})", cell))
                continue
            key = done_key(a)
            if (key, rank) in seen:
                problems.append((f"{a} appears twice", [seen[(key, rank)], (rank, i)]))
            seen[(key, rank)] = (rank, i)
            if a.kind.is_compute:
                kinds.setdefault((a.stage_ref, a.microbatch, a.sub, rank), set()).add(a.kind)
    problems.extend(_coverage_problems(schedule, kinds, seen))
    return problems


def _unit_exists(schedule: IterationSchedule, a: Action) -> bool:
    return a.microbatch < schedule.n_microbatches and a.sub in schedule.subs(a.module, a.microbatch)


def _comm_problems(schedule: IterationSchedule, a: Action, cell) -> list:
    g = schedule.graph
    peer = a.peer_stage()
    if not g.has_stage(peer):
        return [(f"{a}: peer stage {peer} is not in the stage graph", cell)]
    if a.peer_rank is not None and a.peer_rank != g.rank_of(peer):
        return [(f"{a}: peer rank {a.peer_rank}, but {peer} lives on rank {g.rank_of(peer)}", cell)]
    return []


def _coverage_problems(schedule: IterationSchedule, kinds, seen) -> list:
    problems = []
    for ref in schedule.graph.stages():
        for mb in range(schedule.n_microbatches):
            for sub in schedule.subs(ref.module, mb):
                accepted = expected_compute(schedule, ref, mb, sub)
                holders = schedule.graph.holders_of(ref)
                for rank in holders:
                    got = kinds.get((ref, mb, sub, rank), set())
                    if got not in accepted:
                        name = f"{ref}.mb{mb}" + (f".{sub}" if sub is not None else "")
                        name += f" on rank {rank}" if len(holders) > 1 else ""
                        want = " or ".join("{" + ",".join(sorted(k.value for k in s)) + "}" for s in accepted)
                        cells = [seen[(Action(ref.module, ref.stage, k, mb, sub), rank)] for k in got]
                        problems.append((f"{name} runs {{{','.join(sorted(k.value for k in got))}}}; "
                                         f"expected {want} (frozen-aware)", cells))
    messages = {key for key, _ in seen if isinstance(key, tuple) and key[0] in ("send", "recv")}
    for (key, _), cell in seen.items():
        if key in messages:
            other = ("recv" if key[0] == "send" else "send", key[1])
            if other not in messages:
                problems.append((f"{key[0]} of message {_fmt_message(key[1])} has no matching {other[0]}",
                                 [cell]))
    return problems


def _fmt_message(m: Message) -> str:
    direction, src, dst, mb, sub = m
    return f"{direction}{mb}{'' if sub is None else f'.{sub}'} {src}->{dst}"


# -- pass 2 and 3: dry run ---------------------------------------------------------------------
def dry_run(schedule: IterationSchedule, max_in_flight: float | Mapping[int, float] | None = None) -> DryRun:
    """Run all ranks in lock-step; raises ScheduleError on deadlock or a memory bound breach."""
    checker = Checker(schedule)
    orders = schedule.orders
    done: set[Hashable] = set()
    ran: dict[Hashable, int] = {}  # compute key -> holders that ran it so far
    pos = {r: 0 for r in orders}
    held = {r: 0.0 for r in orders}
    result = DryRun(peak_in_flight={r: 0.0 for r in orders})
    while any(pos[r] < len(orders[r]) for r in orders):
        row = {r: orders[r][pos[r]] for r in orders if pos[r] < len(orders[r])
               and all(k in done for k in checker.producers(orders[r][pos[r]]))}
        if not row:
            stuck = {r: orders[r][pos[r]] for r in orders if pos[r] < len(orders[r])}
            raise ScheduleError(_deadlock_message(result, stuck, checker, done))
        result.grid.append(row)
        for rank, a in row.items():
            key = checker.done_key(a)
            ran[key] = ran.get(key, 0) + 1
            if ran[key] == checker.copies(a):
                done.add(key)
            pos[rank] += 1
            held[rank] += _memory_delta(schedule, checker, a)
            result.peak_in_flight[rank] = max(result.peak_in_flight[rank], held[rank])
            bound = max_in_flight.get(rank) if isinstance(max_in_flight, Mapping) else max_in_flight
            if bound is not None and held[rank] > bound + 1e-9:
                raise ScheduleError(
                    f"rank {rank} holds {held[rank]:g} microbatches of activations after {a}, above "
                    f"the bound {bound:g}; lower the warm-up depth or raise max_in_flight\n"
                    + format_table(_grid_columns(result.grid), {(len(result.grid) - 1, rank)}))
    return result


def _memory_delta(schedule: IterationSchedule, checker: Checker, a: Action) -> float:
    if not a.kind.is_compute or not checker.graph.needs_backward(a.stage_ref):
        return 0.0
    share = 1.0 / len(schedule.subs(a.module, a.microbatch))
    if a.kind is Kind.F:
        return share
    return -share if a.kind is checker.final_backward(a.stage_ref) else 0.0


def _deadlock_message(result: DryRun, stuck: dict[int, Action], checker: Checker,
                      done: set[Hashable]) -> str:
    columns = _grid_columns(result.grid, ranks=sorted(checker.schedule.orders))
    row = len(result.grid)
    for rank, a in stuck.items():
        columns[rank].append(str(a))
    lines = [f"schedule deadlocks at step {row}: no rank can run its next action"]
    for rank, a in sorted(stuck.items()):
        waits = [k for k in checker.producers(a) if k not in done]
        lines.append(f"  rank {rank}: {a} waits for {', '.join(_fmt_key(k) for k in waits)}")
    lines.append("Reorder the actions so every producer runs before its consumer.")
    return "\n".join(lines) + "\n" + format_table(columns, {(row, r) for r in stuck})


def _fmt_key(key: Hashable) -> str:
    if isinstance(key, Action):
        return str(key)
    return f"{key[0]} of {_fmt_message(key[1])}"


# -- the step x rank table ---------------------------------------------------------------------
def _grid_columns(grid: list[dict[int, Action]], ranks: list[int] | None = None) -> dict[int, list[str]]:
    ranks = ranks if ranks is not None else sorted({r for row in grid for r in row})
    return {r: [str(row[r]) if r in row else "" for row in grid] for r in ranks}


def format_table(columns: Mapping[int, list[str]], marks: set[tuple[int, int]] = frozenset()) -> str:
    """A step x rank table; cells in ``marks`` (as ``(step, rank)``) print as ``>>cell<<``.

    Args:
        columns: rank -> one cell text per step (empty string for idle).
        marks: cells to highlight.
    """
    ranks = sorted(columns)
    n_rows = max((len(c) for c in columns.values()), default=0)

    def cell(step: int, rank: int) -> str:
        text = columns[rank][step] if step < len(columns[rank]) else ""
        return f">>{text or '?'}<<" if (step, rank) in marks else (text or ".")

    cells = [[cell(s, r) for r in ranks] for s in range(n_rows)]
    width = max([len(c) for row in cells for c in row] + [len(f"rank {r}") for r in ranks] + [1])
    head = "step | " + " ".join(f"rank {r}".ljust(width) for r in ranks)
    body = [f"{s:>4} | " + " ".join(c.ljust(width) for c in row) for s, row in enumerate(cells)]
    return "\n".join([head, "-" * len(head), *body])


def validate(schedule: IterationSchedule,
             max_in_flight: float | Mapping[int, float] | None = None) -> DryRun:
    """Check a schedule; return its dry run or raise ScheduleError with a marked step x rank table.

    Args:
        schedule: the schedule to check (compute-only or lowered).
        max_in_flight: bound on activations held per rank (one number, or per rank).
    """
    unknown = set(schedule.orders) - set(schedule.graph.ranks())
    problems = [(f"rank {r} holds actions but no stage of the graph", [(r, 0)]) for r in sorted(unknown)]
    problems += static_problems(schedule)
    if problems:
        columns = {r: [str(a) for a in acts] for r, acts in schedule.orders.items()}
        marks = {(i, r) for _, cells in problems for r, i in cells}
        text = "\n".join(f"  - {msg}" for msg, _ in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ScheduleError(f"invalid schedule ({len(problems)} problems):\n{text}{more}\n"
                            + format_table(columns, marks))
    return dry_run(schedule, max_in_flight)


__all__ = ["Checker", "DryRun", "data_message", "done_key", "dry_run", "format_table", "message", "validate"]
