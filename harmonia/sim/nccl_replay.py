"""Replay every rank's point-to-point traffic under NCCL's rules, without a GPU.

Gloo forgives what NCCL does not: gloo matches messages by tag and lets a send finish on its own,
NCCL has no tags and a send waits for its receive. A schedule that runs on CPU can still hang, or
silently pair the wrong buffers, on GPUs. `replay_nccl` takes what each rank issued, in order (as
`harmonia.runtime.comm_record` records it, or written by hand), and replays it under NCCL's model:

- **Streams.** A rank runs its p2p ops on in-order streams: one per (group, peer) with
  ``streams="pair"`` (PyTorch's per-pair p2p communicators), one per group with
  ``streams="group"`` (p2p on the group's own communicator: every op of a rank on a group is
  serialised). A ``batch_isend_irecv`` call is one unit that sits on every stream its ops touch.
  Collectives run on one stream per group (in ``"group"`` mode the group's p2p stream).
- **No tags.** Per group, the i-th send from A to B is received by B's i-th receive from A; both
  must have the same size and dtype.
- **Rendezvous.** A unit starts once it heads each of its streams and every op its rank waited for
  (`Wait`) before issuing it has completed; the ops of a started batch are active together. A send
  and its receive complete together once both are active. A unit leaves its streams when all its
  ops have completed. A collective completes once every recorded member has started it; a
  blocking one (``async_op=False``) orders every later op of its rank after it, as a `Wait` does.
- **Collectives** on a group are called in the same order, with the same sizes, by every member
  (only the recorded ranks are compared).

The replay is event driven: each unit is tried when it reaches the head of a stream or when the
last op its rank waited for completes, so a replay costs O(ops log ops). If ops remain and none can
start, the schedule deadlocks on GPUs; the error names each stuck stream head and what its peer is
at.

Events of a rank serialise to JSON lines (`to_json`, `from_json`, `read_record`), one event per
line with a ``"kind"`` field; `replay_dir` replays a directory of ``rank<N>.jsonl`` files.
"""

from __future__ import annotations

import heapq
import json
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harmonia.errors import ScheduleError, TraceError

STREAM_MODES = ("pair", "group")
MAX_DEADLOCK_LINES = 8


@dataclass(frozen=True)
class P2POp:
    """One send or receive.

    Attributes:
        group: the sorted global ranks of the process group (the communicator).
        peer: the other end, a global rank.
        send: True for a send, False for a receive.
        numel: elements of the buffer.
        dtype: the buffer's dtype, e.g. ``"bfloat16"``.
        comm: the process group's name (two groups over the same ranks are two communicators);
            "" where only the ranks identify it.
    """

    group: tuple[int, ...]
    peer: int
    send: bool
    numel: int
    dtype: str
    comm: str = ""


@dataclass(frozen=True)
class Issue:
    """One ``isend``/``irecv`` (one op, ``batched=False``) or one ``batch_isend_irecv`` call.

    Every p2p op gets a per-rank id in issue order (0, 1, 2, ... across all `Issue` events).
    """

    ops: tuple[P2POp, ...]
    batched: bool


@dataclass(frozen=True)
class Wait:
    """The rank waited for its p2p op ``op`` (an id); every op issued after depends on it."""

    op: int


@dataclass(frozen=True)
class Collective:
    """One collective call on ``group`` (sorted global ranks).

    ``blocking`` is False for ``async_op=True`` calls: those order nothing after them. ``comm`` is
    the process group's name, as `P2POp.comm`.
    """

    group: tuple[int, ...]
    name: str
    numel: int
    dtype: str
    blocking: bool = True
    comm: str = ""


Event = Issue | Wait | Collective


def _comm_text(comm: tuple[str, tuple[int, ...]]) -> str:
    """``(name, ranks)`` as a message names it: the ranks, and the group's name where it has one."""
    name, group = comm
    return f"{group}" if not name else f"{group} (group {name!r})"


# ---- JSON lines -------------------------------------------------------------------------------


def event_to_dict(event: Event) -> dict[str, Any]:
    """A JSON-friendly dict of ``event`` with a ``"kind"`` field."""
    if isinstance(event, Issue):
        ops = [{"group": list(o.group), "comm": o.comm, "peer": o.peer, "send": o.send, "numel": o.numel,
                "dtype": o.dtype} for o in event.ops]
        return {"kind": "issue", "batched": event.batched, "ops": ops}
    if isinstance(event, Wait):
        return {"kind": "wait", "op": event.op}
    return {"kind": "collective", "group": list(event.group), "comm": event.comm, "name": event.name,
            "numel": event.numel, "dtype": event.dtype, "blocking": event.blocking}


def event_from_dict(data: Mapping[str, Any]) -> Event:
    """The event that `event_to_dict` wrote.

    Raises:
        TraceError: ``data`` is no event.
    """
    try:
        kind = data["kind"]
        if kind == "issue":
            ops = tuple(P2POp(tuple(o["group"]), int(o["peer"]), bool(o["send"]), int(o["numel"]),
                              str(o["dtype"]), str(o.get("comm", ""))) for o in data["ops"])
            return Issue(ops, bool(data["batched"]))
        if kind == "wait":
            return Wait(int(data["op"]))
        if kind == "collective":
            return Collective(tuple(data["group"]), str(data["name"]), int(data["numel"]),
                              str(data["dtype"]), bool(data.get("blocking", True)), str(data.get("comm", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"malformed comm event {dict(data)!r}: {e!r}") from e
    raise TraceError(f"comm event of unknown kind {kind!r}: expected issue, wait or collective")


def to_json(events: list[Event]) -> str:
    """One rank's events as JSON lines (one event per line)."""
    return "".join(json.dumps(event_to_dict(e)) + "\n" for e in events)


def from_json(text: str) -> list[Event]:
    """The events of `to_json`'s text.

    Raises:
        TraceError: a line is not JSON or no event.
    """
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"comm record line {number} is not JSON: {e}") from e
        events.append(event_from_dict(data))
    return events


def read_record(path: str | Path) -> list[Event]:
    """The events of one rank's record file (`harmonia.runtime.comm_record.write_record`)."""
    return from_json(Path(path).read_text())


RANK_FILE = re.compile(r"rank(\d+)\.jsonl")


def read_record_dir(path: str | Path) -> dict[int, list[Event]]:
    """Every rank's events from the ``rank<N>.jsonl`` files of directory ``path``.

    Raises:
        TraceError: ``path`` holds no rank file.
    """
    files = {int(m.group(1)): f for f in Path(path).iterdir() if (m := RANK_FILE.fullmatch(f.name))}
    if not files:
        raise TraceError(f"no rank<N>.jsonl comm records in {path}: run with HARMONIA_COMM_RECORD={path}")
    return {rank: read_record(files[rank]) for rank in sorted(files)}


def replay_dir(path: str | Path, streams: str = "pair") -> ReplayReport:
    """`replay_nccl` of the rank files of directory ``path`` (`read_record_dir`)."""
    return replay_nccl(read_record_dir(path), streams)


# ---- the replay ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayReport:
    """What a clean replay saw.

    Attributes:
        ranks: ranks replayed.
        p2p_ops: sends and receives, over all ranks.
        batched_ops: those issued inside a ``batch_isend_irecv``.
        batches: ``batch_isend_irecv`` calls.
        collectives: collective calls, over all ranks.
        streams: in-order streams used, over all ranks.
        max_in_flight: most p2p ops one rank had started and not completed at once (in this
            replay's order, which starts every op as early as the rules allow).
        mode: the stream model, ``"pair"`` or ``"group"``.
    """

    ranks: int
    p2p_ops: int
    batched_ops: int
    batches: int
    collectives: int
    streams: int
    max_in_flight: int
    mode: str

    def __str__(self) -> str:
        return (f"{self.ranks} ranks, {self.p2p_ops} p2p ops ({self.batched_ops} batched), "
                f"{self.collectives} collectives: no deadlock, sizes match")


@dataclass(frozen=True)
class _Node:
    """One p2p op or collective call of one rank, as the replay sees it."""

    rank: int
    unit: int
    index: int
    """The op's index among its pair's sends (receives), or the call's among its group's calls."""
    op: P2POp | None = None
    call: Collective | None = None
    local_id: int = -1
    """A p2p op's per-rank id (`Issue`)."""


class _Replay:
    """The state of one replay: nodes, units, streams and what each rank waits for."""

    def __init__(self, events: Mapping[int, list[Event]], mode: str) -> None:
        self.mode = mode
        self.recorded = set(events)
        self.nodes: list[_Node] = []
        self.unit_nodes: list[list[int]] = []
        self.unit_streams: list[list[int]] = []
        self.unit_frontier: list[int] = []
        self.stream_keys: list[tuple] = []
        self.stream_ids: dict[tuple, int] = {}
        self.queues: list[deque[int]] = []
        self.gates: dict[int, list[int]] = {}
        self.sends: dict[tuple, list[int]] = {}
        self.recvs: dict[tuple, list[int]] = {}
        self.calls: dict[tuple, dict[int, list[int]]] = {}  # (comm, group) -> rank -> its calls
        self.batches = self.batched_ops = 0
        for rank in sorted(events):
            self._parse_rank(rank, events[rank])

    # -- parsing --

    def _stream(self, key: tuple) -> int:
        if key not in self.stream_ids:
            self.stream_ids[key] = len(self.stream_keys)
            self.stream_keys.append(key)
            self.queues.append(deque())
        return self.stream_ids[key]

    def _new_unit(self, rank: int, stream_keys: list[tuple]) -> int:
        unit = len(self.unit_nodes)
        streams = list(dict.fromkeys(self._stream(k) for k in stream_keys))
        for s in streams:
            self.queues[s].append(unit)
        self.unit_nodes.append([])
        self.unit_streams.append(streams)
        self.unit_frontier.append(len(self.gates[rank]))
        return unit

    def _p2p_stream(self, rank: int, op: P2POp) -> tuple:
        comm = (op.comm, op.group)
        return (rank, comm, op.peer) if self.mode == "pair" else (rank, comm)

    def _call_stream(self, rank: int, comm: tuple) -> tuple:
        return (rank, comm, "collectives") if self.mode == "pair" else (rank, comm)

    def _parse_rank(self, rank: int, events: list[Event]) -> None:
        self.gates[rank] = []
        local: list[int] = []  # per-rank op id -> node
        for position, event in enumerate(events):
            if isinstance(event, Issue):
                self._parse_issue(rank, event, local)
            elif isinstance(event, Wait):
                if not 0 <= event.op < len(local):
                    raise ScheduleError(
                        f"rank {rank}'s event {position} waits for its p2p op {event.op}, but it has "
                        f"issued only {len(local)} ops by then (ids 0..{len(local) - 1})")
                self.gates[rank].append(local[event.op])
            elif isinstance(event, Collective):
                self._parse_collective(rank, event)
            else:
                raise ScheduleError(f"rank {rank}'s event {position} is no Issue, Wait or "
                                    f"Collective: {event!r}")

    def _parse_issue(self, rank: int, issue: Issue, local: list[int]) -> None:
        if not issue.ops or (len(issue.ops) > 1 and not issue.batched):
            raise ScheduleError(f"rank {rank} issues {len(issue.ops)} ops unbatched: an unbatched "
                                "Issue holds exactly one op, a batch at least one")
        for op in issue.ops:
            if rank not in op.group or op.peer not in op.group:
                raise ScheduleError(
                    f"rank {rank} {_verb(op)} rank {op.peer} on group {op.group}, but "
                    f"{'it' if rank not in op.group else 'the peer'} is not in that group")
        if issue.batched:
            self.batches += 1
            self.batched_ops += len(issue.ops)
        unit = self._new_unit(rank, [self._p2p_stream(rank, op) for op in issue.ops])
        for op in issue.ops:
            key = ((op.comm, op.group), rank, op.peer) if op.send else ((op.comm, op.group), op.peer, rank)
            pair = (self.sends if op.send else self.recvs).setdefault(key, [])
            node = len(self.nodes)
            self.nodes.append(_Node(rank, unit, len(pair), op=op, local_id=len(local)))
            pair.append(node)
            local.append(node)
            self.unit_nodes[unit].append(node)

    def _parse_collective(self, rank: int, call: Collective) -> None:
        if rank not in call.group:
            raise ScheduleError(f"rank {rank} calls {call.name} on group {call.group}, which it is "
                                "not in")
        comm = (call.comm, call.group)
        unit = self._new_unit(rank, [self._call_stream(rank, comm)])
        mine = self.calls.setdefault(comm, {}).setdefault(rank, [])
        node = len(self.nodes)
        self.nodes.append(_Node(rank, unit, len(mine), call=call))
        mine.append(node)
        self.unit_nodes[unit].append(node)
        if call.blocking:
            self.gates[rank].append(node)

    # -- static checks --

    def match_p2p(self) -> list[int]:
        """Each node's partner (-1 for collectives), after checking counts, sizes and dtypes."""
        partner = [-1] * len(self.nodes)
        for key in sorted(set(self.sends) | set(self.recvs)):
            comm, src, dst = key
            group = _comm_text(comm)
            sends, recvs = self.sends.get(key, []), self.recvs.get(key, [])
            for have, missing in ((dst, src), (src, dst)):
                if missing not in self.recorded:
                    raise ScheduleError(
                        f"rank {have} has p2p ops with rank {missing} on group {group}, but rank "
                        f"{missing} has no record: record every rank, or every peer of those recorded")
            if len(sends) != len(recvs):
                raise ScheduleError(
                    f"p2p count mismatch on group {group}: rank {src} sends {len(sends)} messages "
                    f"to rank {dst}, rank {dst} receives {len(recvs)} from rank {src}\n"
                    f"  (NCCL pairs the i-th send with the i-th receive; the extra ones hang)")
            for i, (s, r) in enumerate(zip(sends, recvs)):
                a, b = self.nodes[s].op, self.nodes[r].op
                if (a.numel, a.dtype) != (b.numel, b.dtype):
                    raise ScheduleError(
                        f"p2p size mismatch on group {group}, message #{i} from rank {src} to rank "
                        f"{dst}:\n  rank {src}'s send #{i} is {a.numel} x {a.dtype}\n"
                        f"  rank {dst}'s recv #{i} is {b.numel} x {b.dtype}\n"
                        "  (NCCL has no tags: the i-th send meets the i-th receive of the pair)")
                partner[s], partner[r] = r, s
        return partner

    def check_collectives(self) -> None:
        """Every recorded member of a group calls the same collectives in the same order."""
        for comm in sorted(self.calls):
            group = comm[1]
            text = _comm_text(comm)
            seqs = {rank: [self._signature(n) for n in nodes]
                    for rank, nodes in sorted(self.calls[comm].items())}
            for rank in self.recorded & set(group):
                seqs.setdefault(rank, [])
            reference = seqs[min(seqs)]
            differences = [d for s in seqs.values() if (d := _first_difference(reference, s)) is not None]
            if not differences:
                continue
            first = min(differences)
            lines = [f"  rank {r}: {s[first] if first < len(s) else f'nothing (it calls only {len(s)})'}"
                     for r, s in sorted(seqs.items())]
            shown = lines[:MAX_DEADLOCK_LINES] + (
                [f"  ... and {len(lines) - MAX_DEADLOCK_LINES} more ranks"]
                if len(lines) > MAX_DEADLOCK_LINES else [])
            raise ScheduleError(f"collective mismatch on group {text} at call #{first}:\n"
                                + "\n".join(shown))

    def _signature(self, node: int) -> str:
        call = self.nodes[node].call
        return f"{call.name}({call.numel} x {call.dtype})" if call.dtype else f"{call.name}()"

    # -- progress --

    def run(self, partner: list[int]) -> int:
        """Replay to the end; the peak of in-flight p2p ops on one rank.

        Raises:
            ScheduleError: no op can start while some remain (a deadlock).
        """
        n = len(self.nodes)
        self.partner = partner
        self.active = [False] * n
        self.done = [False] * n
        self.started = [False] * len(self.unit_nodes)
        self.remaining = [len(nodes) for nodes in self.unit_nodes]
        self.prefix = dict.fromkeys(self.gates, 0)
        self.gate_heaps: dict[int, list[tuple[int, int]]] = {rank: [] for rank in self.gates}
        self.call_active = {(g, i): 0 for g, by_rank in self.calls.items()
                            for nodes in by_rank.values() for i in range(len(nodes))}
        self.in_flight = dict.fromkeys(self.gates, 0)
        self.peak = 0
        self.todo = [q[0] for q in self.queues if q]
        while self.todo:
            self._try_start(self.todo.pop())
        if not all(self.done):
            raise ScheduleError(self._deadlock_message())
        return self.peak

    def _blocker(self, unit: int) -> int | None:
        """A stream of ``unit`` it does not head yet, else None."""
        for s in self.unit_streams[unit]:
            if self.queues[s][0] != unit:
                return s
        return None

    def _try_start(self, unit: int) -> None:
        if self.started[unit] or self._blocker(unit) is not None:
            return
        rank = self.nodes[self.unit_nodes[unit][0]].rank
        if self.prefix[rank] < self.unit_frontier[unit]:
            heapq.heappush(self.gate_heaps[rank], (self.unit_frontier[unit], unit))
            return
        self.started[unit] = True
        for node in self.unit_nodes[unit]:
            self._activate(node)

    def _activate(self, node: int) -> None:
        self.active[node] = True
        info = self.nodes[node]
        if info.op is not None:
            self.in_flight[info.rank] += 1
            self.peak = max(self.peak, self.in_flight[info.rank])
            other = self.partner[node]
            if self.active[other]:
                self._complete(node)
                self._complete(other)
            return
        comm = (info.call.comm, info.call.group)
        key = (comm, info.index)
        self.call_active[key] += 1
        members = self.calls[comm]
        if self.call_active[key] == len(members):
            for nodes in members.values():
                self._complete(nodes[info.index])

    def _complete(self, node: int) -> None:
        self.done[node] = True
        info = self.nodes[node]
        if info.op is not None:
            self.in_flight[info.rank] -= 1
        unit = info.unit
        self.remaining[unit] -= 1
        if self.remaining[unit] == 0:
            for s in self.unit_streams[unit]:
                queue = self.queues[s]
                queue.popleft()
                if queue:
                    self.todo.append(queue[0])
        self._advance_gate(info.rank)

    def _advance_gate(self, rank: int) -> None:
        gate, prefix = self.gates[rank], self.prefix[rank]
        while prefix < len(gate) and self.done[gate[prefix]]:
            prefix += 1
        self.prefix[rank] = prefix
        heap = self.gate_heaps[rank]
        while heap and heap[0][0] <= prefix:
            self.todo.append(heapq.heappop(heap)[1])

    # -- the deadlock message --

    def _describe(self, node: int) -> str:
        info = self.nodes[node]
        if info.op is None:
            return f"{info.call.name} #{info.index} on group {_comm_text((info.call.comm, info.call.group))}"
        op = info.op
        kind, where = ("send", "to") if op.send else ("recv", "from")
        return (f"{kind} #{info.index} {where} rank {op.peer} (op {info.local_id}, group {_comm_text((op.comm, op.group))},"
                f" {op.numel} x {op.dtype})")

    def _unit_state(self, unit: int, depth: int = 0) -> str:
        """Why ``unit`` has not completed: posted, or what it waits behind (``depth`` levels)."""
        if self.started[unit]:
            return "posted"
        blocker = self._blocker(unit)
        if blocker is not None:
            head = self.queues[blocker][0]
            behind = f"not posted: queued behind its {self._describe(self._pending(head))}"
            return behind + (f" ({self._unit_state(head, depth + 1)})" if depth < 1 else "")
        rank = self.nodes[self.unit_nodes[unit][0]].rank
        waited = self.gates[rank][self.prefix[rank]]
        return f"not posted: rank {rank} first waits for its {self._describe(waited)}"

    def _pending(self, unit: int) -> int:
        return next(n for n in self.unit_nodes[unit] if not self.done[n])

    def _peer_state(self, node: int) -> str:
        info = self.nodes[node]
        if info.op is None:
            group_nodes = self.calls[(info.call.comm, info.call.group)]
            late = [r for r, nodes in sorted(group_nodes.items()) if not self.active[nodes[info.index]]]
            return f"not yet reached by ranks {late}"
        other = self.partner[node]
        kind = "recv" if info.op.send else "send"
        return (f"rank {info.op.peer}'s matching {kind} #{info.index} is "
                f"{self._unit_state(self.nodes[other].unit)}")

    def _deadlock_message(self) -> str:
        heads = sorted({q[0] for q in self.queues if q})
        lines = []
        for unit in heads:
            node = self._pending(unit)
            rank = self.nodes[node].rank
            state = self._unit_state(unit)
            line = f"  rank {rank}: {self._describe(node)} {state}"
            if self.started[unit]:
                line += f"; {self._peer_state(node)}"
            lines.append(line)
        ops_left = sum(1 for n, info in enumerate(self.nodes) if info.op is not None and not self.done[n])
        ops = sum(1 for info in self.nodes if info.op is not None)
        more = len(lines) - MAX_DEADLOCK_LINES
        return "\n".join(
            [f"deadlock under NCCL's rules (streams={self.mode!r}): {ops_left} of {ops} p2p ops never "
             f"complete; stuck stream heads:"]
            + lines[:MAX_DEADLOCK_LINES] + ([f"  ... and {more} more"] if more > 0 else [])
            + ["  (a send waits for its receive: batch a step's sends and receives together, or "
               "order them so each send meets its receive)"])


def _verb(op: P2POp) -> str:
    return "sends to" if op.send else "receives from"


def _first_difference(a: list[str], b: list[str]) -> int | None:
    """The first position where ``a`` and ``b`` differ (one may end there), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def replay_nccl(events: Mapping[int, list[Event]], streams: str = "pair") -> ReplayReport:
    """Replay every rank's events under NCCL's model (module docstring).

    Args:
        events: each recorded rank's events, in issue order.
        streams: ``"pair"`` (one in-order stream per group and peer, PyTorch's default) or
            ``"group"`` (one per group: stricter).

    Returns:
        The counts of a clean replay.

    Raises:
        ScheduleError: on the first problem found: a malformed event, p2p counts, sizes or dtypes
            that do not match in FIFO order, collectives that differ between members, or a
            deadlock.
    """
    if streams not in STREAM_MODES:
        raise ScheduleError(f"streams={streams!r}: expected one of {STREAM_MODES}")
    replay = _Replay(events, streams)
    partner = replay.match_p2p()
    replay.check_collectives()
    peak = replay.run(partner)
    ops = sum(1 for node in replay.nodes if node.op is not None)
    return ReplayReport(ranks=len(events), p2p_ops=ops, batched_ops=replay.batched_ops,
                        batches=replay.batches, collectives=len(replay.nodes) - ops,
                        streams=len(replay.queues), max_in_flight=peak, mode=streams)
