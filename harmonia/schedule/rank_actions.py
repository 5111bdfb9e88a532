"""Every rank's complete action list for one iteration, built once: what the executor runs and the
simulator times.

An `IterationSchedule` orders the compute of one LLM replica's stage graph; every replica of every
module runs it. `plan_rank_actions` expands it to each global rank of the plan, as pure data:

1. **Compute.** A rank runs the actions of the stage chunks it holds (chunk ``c`` of a module on its
   pipeline rank ``c % pp``), whichever replica it is. A colocated encoder stage held by several LLM
   ranks has one copy of its actions per holder; a rank takes the copy of the holder at its own LLM
   pipeline position (the primary's when that position holds none). The chunks' actions are merged
   by the schedule's own timeline (`harmonia.schedule.replay` under the schedule's costs), ties by
   the replay's sequence, which puts every producer before its consumers: each rank's list is a
   subsequence of one dependency-respecting order of all actions, so no set of lists deadlocks.
   Where the schedule's costs carry each encoder replica's own durations, a rank then moves its
   colocated single-chunk encoders' forwards ahead into the slack its LLM group leaves
   (`harmonia.schedule.encoder_slots`, which says why that keeps the lists deadlock-free).
2. **Stage messages.** Where the neighbouring chunk is on another rank: ``RECV_F`` before a
   forward, ``SEND_F`` after it; ``RECV_B`` before the action that consumes the output gradient (B,
   BW, or the W of a stage with nothing trainable upstream), ``SEND_B`` after the one producing the
   input gradient. The peer is the rank with the same ``dp``/``cp``/``tp`` coordinates.
3. **Boundary transfers**, one per encoder and microbatch (rows move as the batch's boundary plan
   says, `harmonia.runtime.boundary_link`): the encoder's last chunk sends after its last forward of
   the microbatch (``vision.s1.SEND_F3>llm.s0``), the LLM's first chunk receives before its forward
   (``llm.s0.RECV_F3<vision.s1``); where something upstream trains, the LLM's first chunk sends
   the rows' gradients after its backward and the encoder receives them before its first backward
   of the microbatch.
4. **Collectives.** ``REDUCE`` after a trainable chunk's last backward of the iteration: its
   gradient reduction over ``dp x cp`` (an all-reduce, or FSDP's reduce-scatter), where that group
   has more than one rank.

The executor runs its rank's list (`harmonia.runtime.mllm_executor`), the simulator times every
rank's (`harmonia.sim.tasks`); neither derives an order or a message of its own. Units with no data
(an encoder replica without items in a sub-microbatch) keep their actions: the executor finds them
empty on both ends of every message, the simulator gives them no time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from harmonia.schedule.actions import BACKWARD_KINDS, Action, Kind, StageRef
from harmonia.schedule.encoder_slots import group_members, group_ranks, movable_encoders, place_encoder_work
from harmonia.schedule.graph import LLM, IterationSchedule, StageGraph
from harmonia.schedule.layout import Layout
from harmonia.schedule.lowering import strip_communication
from harmonia.schedule.replay import replay


def holder_copy(graph: StageGraph, layouts: Mapping[str, Layout], ref: StageRef, rank: int) -> int:
    """The schedule rank whose copy of ``ref``'s actions global ``rank`` runs."""
    holders = graph.holders_of(ref)
    llm = layouts[LLM]
    if len(holders) == 1 or not llm.holds(rank):
        return holders[0]
    mine = graph.llm.ranks[llm.coords(rank)["pp"]]
    return mine if mine in holders else holders[0]


def _grad_action(graph: StageGraph, a: Action) -> bool:
    """The action that consumes the stage's output gradient (B, BW, or a W-only stage's W)."""
    return a.kind in (Kind.B, Kind.BW) or (a.kind is Kind.W and not graph.needs_b(a.stage_ref))


class _Rank:
    """One global rank's view: the chunks it holds, the ranks its messages go to, and per encoder
    whether gradients cross its boundary (its last stage or something before it trains)."""

    def __init__(self, layouts: Mapping[str, Layout], graph: StageGraph, rank: int,
                 crosses: Mapping[str, bool]) -> None:
        self.rank, self.graph, self.layouts, self.crosses = rank, graph, layouts, crosses
        self.coords = {m: lay.coords(rank) for m, lay in layouts.items() if lay.holds(rank)}

    def chunks(self) -> list[StageRef]:
        return [StageRef(m, c) for m, me in self.coords.items()
                for c in range(self.layouts[m].n_stages) if c % self.layouts[m].pp == me["pp"]]

    def local(self, module: str, chunk: int) -> bool:
        return module in self.coords and chunk % self.layouts[module].pp == self.coords[module]["pp"]

    def message_key(self) -> tuple:
        """What the rank's messages depend on beside its compute list: per module it holds, its
        pipeline rank, and where the module is pipelined, the coordinates its peers share with it
        (a module on one pipeline rank sends no stage message: every DP replica's list is alike)."""
        return tuple((m, me["pp"], None if self.layouts[m].pp == 1 else (me["dp"], me["cp"], me["tp"]))
                     for m, me in self.coords.items())

    def peer(self, module: str, chunk: int) -> int:
        layout, me = self.layouts[module], self.coords[module]
        return layout.rank_at(pp=chunk % layout.pp, dp=me["dp"], cp=me["cp"], tp=me["tp"])


def plan_rank_actions(layouts: Mapping[str, Layout], schedule: IterationSchedule,
                      ranks: Iterable[int] | None = None) -> dict[int, list[Action]]:
    """Each global rank's ordered actions for one iteration (see the module docstring).

    Args:
        layouts: module -> layout, the ones the schedule's graph was built from.
        schedule: the iteration's schedule (compute-only or lowered: its messages are re-placed on
            global ranks here).
        ranks: the global ranks wanted (default: every rank of the layouts).

    Returns:
        rank -> its actions in execution order.
    """
    graph = schedule.graph
    crosses = {e: graph.needs_backward(_last(graph, e)) for e in graph.encoders}
    made: dict[tuple, list[Action]] = {}  # (compute list, what its messages depend on) -> the list with them
    out = {}
    for rank, compute in rank_compute_actions(layouts, schedule, ranks).items():
        view = _Rank(layouts, graph, rank, crosses)
        key = (id(compute), view.message_key())  # compute lists are shared by the ranks running alike
        if key not in made:
            made[key] = _with_communication(view, compute)
        out[rank] = list(made[key])
    return out


def rank_compute_actions(layouts: Mapping[str, Layout], schedule: IterationSchedule,
                         ranks: Iterable[int] | None = None) -> dict[int, list[Action]]:
    """Each global rank's compute actions (F, B, W, BW) in execution order: step 1 of the module
    docstring, `plan_rank_actions` without messages and collectives (what a rank's compute stream
    and its activation memory follow). Ranks holding the same chunks and copies, and placing their
    encoders' forwards alike, share one list."""
    wanted = sorted({r for lay in layouts.values() for r in lay.rank_list()} if ranks is None else set(ranks))
    lists = _Lists(layouts, schedule)
    return {rank: lists.placed(rank) for rank in wanted}


class _Lists:
    """Ranks' compute lists: the schedule's order of the chunk copies a rank holds (shared by every
    rank holding the same copies), then its colocated encoders' forwards placed by its own replicas'
    costs where the schedule carries them (`harmonia.schedule.encoder_slots`)."""

    def __init__(self, layouts: Mapping[str, Layout], schedule: IterationSchedule) -> None:
        self.layouts, self.graph = layouts, schedule.graph
        self.costs = schedule.costs
        self.by_chunk = _chunk_actions(schedule)
        self.ordered: dict[tuple, list[Action]] = {}
        if schedule.placements is None:
            schedule.placements = {}
        self.groups: dict[tuple[int, ...], dict[int, list[Action]]] = schedule.placements
        self.movable = movable_encoders(layouts, self.graph.encoders) if self.costs and self.costs.replicas else ()

    def ordered_list(self, rank: int) -> list[Action]:
        """The schedule's order of the rank's chunk copies."""
        view = _Rank(self.layouts, self.graph, rank, {})
        copies = tuple((ref, holder_copy(self.graph, self.layouts, ref, rank)) for ref in view.chunks())
        if copies not in self.ordered:
            mine = sorted((t for ref, holder in copies for t in self.by_chunk.get((holder, ref), ())),
                          key=lambda t: t[0])
            self.ordered[copies] = [a for _, a in mine]
        return self.ordered[copies]

    def placed(self, rank: int) -> list[Action]:
        """The rank's list, its movable encoders' forwards placed for its LLM group."""
        llm = self.layouts[LLM]
        if not self.movable or not llm.holds(rank):
            return self.ordered_list(rank)
        group = group_ranks(llm, rank)
        if group not in self.groups:
            self.groups[group] = self._place(group)
        return self.groups[group].get(rank) or self.ordered_list(rank)

    def _place(self, group: tuple[int, ...]) -> dict[int, list[Action]]:
        """Every rank's placed list in a group (empty where the group keeps the schedule's order)."""
        members = group_members(self.layouts, self.movable, group)
        actions = self.ordered_list(group[0])
        if members is None or any(self.ordered_list(r) != actions for r in group[1:]):
            return {}
        by_member = place_encoder_work(actions, self.movable, set(members.values()), self.costs, self.graph)
        return {r: by_member[m] for r, m in members.items()}


def _chunk_actions(schedule: IterationSchedule) -> dict[tuple[int, StageRef], list[tuple[tuple[float, int], Action]]]:
    """``schedule.chunk_actions``, derived on first use: every schedule rank's compute actions by
    stage chunk, each with its (start, sequence) on the schedule's own timeline."""
    if schedule.chunk_actions is None:
        compute = strip_communication(schedule) if schedule.is_lowered() else schedule
        times = replay(compute, compute.costs)
        order = {key: (start, seq) for seq, (key, (start, _)) in enumerate(times.items())}
        by_chunk: dict[tuple[int, StageRef], list] = {}
        for holder, actions in compute.orders.items():
            for pos, a in enumerate(actions):
                by_chunk.setdefault((holder, a.stage_ref), []).append((order[(holder, pos)], a))
        schedule.chunk_actions = by_chunk
    return schedule.chunk_actions


def _with_communication(view: _Rank, compute: list[Action]) -> list[Action]:
    """A rank's compute actions with its messages and collectives in place."""
    graph = view.graph
    last_forward = {(a.stage_ref, a.microbatch): i for i, a in enumerate(compute) if a.kind is Kind.F}
    last_backward = {a.stage_ref: i for i, a in enumerate(compute) if a.kind in BACKWARD_KINDS}
    got_grads: set[tuple[str, int]] = set()
    out: list[Action] = []
    for i, a in enumerate(compute):
        ref, m, sub = a.stage_ref, a.microbatch, a.sub
        name, c = ref.module, ref.stage
        last = graph.is_last(ref)
        grad = _grad_action(graph, a)
        if a.kind is Kind.F:
            if c > 0 and not view.local(name, c - 1):
                out.append(Action(name, c, Kind.RECV_F, m, sub, peer_rank=view.peer(name, c - 1)))
            if name == LLM and c == 0:
                out += [Action(LLM, 0, Kind.RECV_F, m, peer=_last(graph, e)) for e in graph.encoders]
        elif grad:
            if not last and not view.local(name, c + 1) and graph.needs_b(StageRef(name, c + 1)):
                out.append(Action(name, c, Kind.RECV_B, m, sub, peer_rank=view.peer(name, c + 1)))
            if name != LLM and last and view.crosses[name] and (name, m) not in got_grads:
                got_grads.add((name, m))
                out.append(Action(name, c, Kind.RECV_B, m, peer=StageRef(LLM, 0)))
        out.append(a)
        if a.kind is Kind.F:
            if not last and not view.local(name, c + 1):
                out.append(Action(name, c, Kind.SEND_F, m, sub, peer_rank=view.peer(name, c + 1)))
            if name != LLM and last and last_forward[(ref, m)] == i:
                out.append(Action(name, c, Kind.SEND_F, m, peer=StageRef(LLM, 0)))
        elif grad and graph.needs_b(ref):
            if c > 0 and not view.local(name, c - 1):
                out.append(Action(name, c, Kind.SEND_B, m, sub, peer_rank=view.peer(name, c - 1)))
            if name == LLM and c == 0:
                out += [Action(LLM, 0, Kind.SEND_B, m, peer=_last(graph, e)) for e in graph.encoders
                        if view.crosses[e]]
        if last_backward.get(ref) == i and graph.needs_w(ref) and _reduces(view.layouts[name]):
            out.append(Action(name, c, Kind.REDUCE, 0))
    return out


def _last(graph: StageGraph, encoder: str) -> StageRef:
    return StageRef(encoder, graph.module(encoder).n_stages - 1)


def _reduces(layout: Layout) -> bool:
    """A stage chunk's gradients are reduced over more than one rank."""
    return layout.dp * layout.cp > 1

