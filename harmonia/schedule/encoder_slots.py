"""Each rank's colocated encoder work, moved into the gaps its LLM group leaves, by its own costs.

A schedule orders one LLM replica's stage graph (`harmonia.schedule.generators`): an encoder stage
colocated with the LLM stands, on each holder, for every encoder replica on the ranks of that
holder's pipeline position, timed as the slowest of them (`harmonia.schedule.stagework.cost_table`).
The ranks of one LLM stage chunk (its TP x CP group: the *group*) run each LLM action together (its
collectives; `harmonia.sim.tasks` couples them likewise), so between two LLM actions (a *slot*) the
whole group waits for the longest encoder work any of its ranks runs there. Samples go to encoder
replicas whole (`harmonia.schedule.iteration`): where an LLM replica's microbatch holds fewer long
samples (videos) than its group has encoder replicas, some replicas encode while the others wait,
slot after slot.

`place_encoder_work` re-places, per rank, the actions of the encoders that are colocated with the
group and held in one chunk, with each encoder replica's own durations (`CostTable.replicas`). Slot
by slot:

- a slot lasts as long as the longest work some rank of the group must run there: its forwards
  whose slot (the schedule's) it is, and its backwards `DELAY` slots after theirs (all that is left
  in the last slot); and at least as long as every rank's work of this slot and before takes;
- each rank fills its own slack in the slot with its next backwards whose slot has come, then with
  its next forwards from at most `LOOKAHEAD` slots later, in order, while each fits.

With equal replicas nothing moves. An encoder's forwards keep their order and its backwards theirs
(a slot runs what it took in the schedule's order); the LLM's actions keep theirs. A single-chunk
encoder's forward takes no input from another rank, so running it earlier waits for nothing the
rank runs later; a backward runs later only, after the gradient it waits for as before: the lists
still cannot deadlock. Every rank of an encoder replica lies in one group with the same replicas and
so computes the same placement (they run the encoder's TP collectives together); a group where that
fails keeps the schedule's order. Activations live longer: a forward's from up to `LOOKAHEAD` slots
earlier, a backward's until up to `DELAY` slots later; the simulator's memory model reads the same
lists (`harmonia.sim.memory`), so a plan's memory check counts them.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Mapping, Sequence

from harmonia.schedule.actions import Action, Kind
from harmonia.schedule.costs import CostTable
from harmonia.schedule.graph import LLM, StageGraph
from harmonia.schedule.layout import Layout

LOOKAHEAD = 2
"""Slots a forward may move earlier (under 1F1B with one LLM stage, one microbatch: its F and BW)."""

DELAY = 2
"""Slots a backward may move later."""

_EPS = 1e-12

Member = tuple[tuple[str, int], ...]
"""The (encoder, replica) pairs a rank holds among the group's movable encoders."""


def movable_encoders(layouts: Mapping[str, Layout], encoders: Sequence[str]) -> tuple[str, ...]:
    """Encoders held in one stage chunk, every rank of which also holds the LLM."""
    return tuple(e for e in encoders if _movable(layouts[e], layouts[LLM]))


@functools.lru_cache(maxsize=4096)
def _movable(encoder: Layout, llm: Layout) -> bool:
    """`movable_encoders` of one encoder's layout (kept: every schedule of a plan asks again)."""
    return encoder.n_stages == 1 and all(llm.holds(r) for r in encoder.rank_list())


def group_ranks(llm: Layout, rank: int) -> tuple[int, ...]:
    """The TP x CP group of the LLM stage chunks ``rank`` holds."""
    me = llm.coords(rank)
    return llm_group(llm, me["dp"], me["pp"])


def llm_group(llm: Layout, dp: int, pp: int) -> tuple[int, ...]:
    """The TP x CP group of LLM replica ``dp`` at pipeline rank ``pp``."""
    return tuple(llm.rank_at(pp=pp, dp=dp, cp=c, tp=t) for c in range(llm.cp) for t in range(llm.tp))


def group_members(layouts: Mapping[str, Layout], encoders: tuple[str, ...],
                  group: tuple[int, ...]) -> dict[int, Member] | None:
    """Each rank's encoder replicas, or None where the group cannot be placed: an encoder replica
    with ranks outside the group or ranks holding different replicas, or one kind of rank only."""
    member = {r: tuple((e, layouts[e].coords(r)["dp"]) for e in encoders if layouts[e].holds(r)) for r in group}
    inside = set(group)
    for r, pairs in member.items():
        for e, replica in pairs:
            lay = layouts[e]
            peers = (lay.rank_at(dp=replica, cp=c, tp=t) for c in range(lay.cp) for t in range(lay.tp))
            if any(p not in inside or member[p] != pairs for p in peers):
                return None
    return member if len(set(member.values())) > 1 else None


def place_encoder_work(actions: list[Action], encoders: tuple[str, ...], members: set[Member],
                           costs: CostTable, graph: StageGraph) -> dict[Member, list[Action]]:
    """Each kind of rank's compute list, its encoder work moved into the group's slack (module docstring).

    Args:
        actions: the group's compute list, as the schedule orders it (every rank of the group runs
            the same; `harmonia.schedule.rank_actions.rank_compute_actions`).
        encoders: the movable encoders (`movable_encoders`).
        members: the kinds of rank in the group (`group_members`).
        costs: the schedule's costs, with each encoder replica's own (`CostTable.replicas`).
        graph: the schedule's stage graph (a stage with no B runs its whole backward in its W).

    Returns:
        member -> its list: the same actions, the LLM's (and any other module's) in the same order.
    """
    slots = _slots(actions, encoders)
    n = len(slots) - 1
    anchors = [a for a in actions if a.module not in encoders]
    out: dict[Member, list[Action]] = {m: [] for m in members}
    queues = {m: _queues(slots, costs, graph, m) for m in members}
    for j in range(n + 1):
        last = n if j == n else j - DELAY  # backwards of this slot or before must run now
        due, ready = {}, {}
        for m, (backward, forward) in queues.items():
            now = _seconds_until(forward, j)
            due[m] = now + _seconds_until(backward, last)
            ready[m] = now + _seconds_until(backward, j)
        length = max(max(due.values()), min(ready.values()))  # no rank's work is late for a shorter slot
        for m, (backward, forward) in queues.items():
            used = due[m]
            taken = []
            for queue, must, may in ((backward, last, j), (forward, j, j + LOOKAHEAD)):
                while queue:
                    (slot, _), _, sec = queue[0]
                    if slot > must:
                        if slot > may or used + sec > length + _EPS:
                            break
                        used += sec
                    taken.append(queue.popleft())
            out[m].extend(a for _, a, _ in sorted(taken, key=lambda x: x[0]))  # the schedule's order
            if j < n:
                out[m].append(anchors[j])
    return out


def _queues(slots: list[list[Action]], costs: CostTable, graph: StageGraph, member: Member) -> tuple[deque, deque]:
    """A rank's backwards and its forwards, each ``((slot, index), action, seconds)`` in the
    schedule's order."""
    items = [((j, k), a, _seconds(costs, graph, member, a)) for j, slot in enumerate(slots) for k, a in enumerate(slot)]
    return (deque(x for x in items if x[1].kind is not Kind.F), deque(x for x in items if x[1].kind is Kind.F))


def _seconds_until(queue: deque, last: int) -> float:
    """Seconds of the queue's actions from slots up to ``last`` (a prefix: the queue is in slot order)."""
    total = 0.0
    for (slot, _), _, sec in queue:
        if slot > last:
            break
        total += sec
    return total


def _slots(actions: list[Action], encoders: tuple[str, ...]) -> list[list[Action]]:
    """The movable encoders' actions between consecutive other actions: slot ``j`` before the
    ``j``-th other action, the last slot after every other action."""
    slots: list[list[Action]] = [[]]
    for a in actions:
        if a.module in encoders:
            slots[-1].append(a)
        else:
            slots.append([])
    return slots


def _seconds(costs: CostTable, graph: StageGraph, member: Member, a: Action) -> float:
    """Seconds of an encoder action on the rank of ``member`` (zero where its replica has no data), as
    the simulator times it (`harmonia.sim.tasks.compute_seconds`)."""
    replica = dict(member).get(a.module)
    phase = None if replica is None else costs.replicas.get((a.module, replica, a.stage, a.microbatch, a.sub))
    if phase is None:
        return 0.0
    if a.kind is Kind.W and not graph.needs_b(a.stage_ref):
        return phase.B + phase.W
    return phase.of(a.kind)
