"""Pipeline schedule generators over the multi-module stage graph.

Every family is one list scheduler with a different policy. The scheduler replays the iteration in
time with the given per-microbatch costs: whenever a rank is idle it starts, among the actions
whose inputs exist, the best one by the family's priority that its memory gate admits. The order
in which each rank started its actions is the schedule. Because the orders come from an execution
that respected every dependency, they never deadlock, whatever the costs.

=============  ===========================================  ========================================
family         priority on a rank                           memory gate (activations in flight)
=============  ===========================================  ========================================
``gpipe``      forwards, then backwards (a stage starts     none
               its backwards after its last forward)
``1f1b``       backward > forward                           per stage: stages to the end of the LLM
``interleaved`` forward > backward (Megatron's steady F, B),  per rank: Megatron's warm-up + 1
               LLM chunks in Megatron's order (rounds)
``zb``         B > F > W (W fills the bubbles, placed by    as ``1f1b`` counted until B; at most
               the costs)                                   as many W deferred as the 1F1B depth
=============  ===========================================  ========================================

Frozen-awareness comes from the graph: stages with nothing trainable upstream run no B, frozen
stages run no W, so their ranks have time the priority fills with other work. The gates hold for
encoder stages too, disjoint or colocated, as in a real pipeline: forward m + k waits for the
backward of m (k = the stages to the LLM's end); a stage with no backward frees its activations
after the forward but waits until its consumer's forward has taken the rows of m. Encoders
colocated with the LLM (sharing ranks with LLM stages) run on every rank that holds a share of
them (`StageGraph.holders_of`), each holder gated on its own share: a microbatch's encoder forward
goes ahead of the LLM forwards of later microbatches (so it is ready when the LLM's first stage
needs it), and encoder backwards run only when no LLM work is ready on the rank (filling
bubbles). Encoder stages may split each microbatch into sub-microbatches (``n_sub``); the LLM's
first stage waits for all of them, on every holder.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.costs import CostTable
from harmonia.schedule.graph import IterationSchedule, LLM, StageGraph

FAMILIES = ("gpipe", "1f1b", "interleaved", "zb")
_INF = float("inf")


@dataclass
class Policy:
    """How a family orders work on a rank.

    Attributes:
        name: family name.
        split: split backward into B and W (zero-bubble) instead of fused BW.
        priority: (action, microbatch position) -> sort key; smaller runs first.
        gate: stage -> key of the memory gate it counts against (None = ungated).
        limits: gate key -> most activations in flight (in microbatch units).
        b_release: share of a (sub-)microbatch's activations freed by B when W follows.
        w_limits: gate key -> most deferred weight gradients (B done, W not) before forwards wait.
        lanes: rank -> ordered queues of its actions (None = one queue per stage and kind).
        backward_after_forward: a stage's backwards wait for all its forwards (GPipe).
    """

    name: str
    split: bool
    priority: Callable[[Action, int], tuple]
    gate: Callable[[StageRef], object] = lambda ref: None
    limits: dict = field(default_factory=dict)
    b_release: float = 0.0
    w_limits: dict = field(default_factory=dict)
    lanes: dict[int, list[deque[Action]]] | None = None
    backward_after_forward: bool = False


# -- problem set-up ------------------------------------------------------------------------------
def normalize_sub(graph: StageGraph, n_microbatches: int,
                  n_sub: Mapping[str, int | Sequence[int]] | None) -> dict[str, tuple[int, ...]]:
    """Per encoder, the number of sub-microbatches of each microbatch (default 1)."""
    out: dict[str, tuple[int, ...]] = {}
    for name, value in (n_sub or {}).items():
        if name not in graph.encoders:
            raise ScheduleError(f"n_sub names {name!r}, which is not an encoder of the graph "
                                f"({graph.encoders}); only encoder stages split microbatches")
        counts = (value,) * n_microbatches if isinstance(value, int) else tuple(value)
        if len(counts) != n_microbatches or min(counts, default=1) < 1:
            raise ScheduleError(f"n_sub[{name!r}] = {value!r}: give one count >= 1 per microbatch "
                                f"({n_microbatches}) or a single count")
        out[name] = counts
    return out


def normalize_order(n_microbatches: int, order: Sequence[int] | None) -> list[int]:
    """The microbatch order, checked to be a permutation."""
    if n_microbatches < 1:
        raise ScheduleError(f"n_microbatches={n_microbatches}: need at least one microbatch")
    if order is None:
        return list(range(n_microbatches))
    order = [int(m) for m in order]
    if sorted(order) != list(range(n_microbatches)):
        raise ScheduleError(f"microbatch order {order} must be a permutation of 0..{n_microbatches - 1}")
    return order


def stage_actions(skeleton: IterationSchedule, ref: StageRef, order: list[int],
                  split: bool) -> dict[str, list[Action]]:
    """A stage's actions by class (F, grad = B/BW/W-only, W after B) in microbatch order."""
    g = skeleton.graph
    units = [(m, j) for m in order for j in skeleton.subs(ref.module, m)]
    kinds = g.backward_kinds(ref, split)
    out = {"F": [Action(ref.module, ref.stage, Kind.F, m, j) for m, j in units], "grad": [], "W": []}
    if kinds:
        out["grad"] = [Action(ref.module, ref.stage, kinds[0], m, j) for m, j in units]
    if len(kinds) == 2:
        out["W"] = [Action(ref.module, ref.stage, kinds[1], m, j) for m, j in units]
    return out


def default_lanes(skeleton: IterationSchedule, order: list[int], split: bool) -> dict[int, list[deque]]:
    """Per rank, one queue per stage and action class, in microbatch order (on every holder)."""
    lanes: dict[int, list[deque]] = {r: [] for r in skeleton.graph.ranks()}
    for ref in skeleton.graph.stages():
        for acts in stage_actions(skeleton, ref, order, split).values():
            for rank in skeleton.graph.holders_of(ref) if acts else ():
                lanes[rank].append(deque(acts))
    return lanes


def is_colocated(graph: StageGraph, ref: StageRef) -> bool:
    """An encoder stage on ranks that also hold LLM stages."""
    return ref.module != LLM and any(r in graph.llm.ranks for r in graph.holders_of(ref))


# -- the list scheduler --------------------------------------------------------------------------
@dataclass(frozen=True)
class _Facts:
    """What the scheduler asks of one stage per action, computed once per schedule."""

    gate: object  # the policy's gate key for the stage (None = ungated)
    shared: bool  # several holders, each with its own gate
    holders: tuple[int, ...]
    kinds: tuple[Kind, ...]  # backward kinds under the policy
    backward: bool  # the stage holds activations until its backward
    sends_rows: bool  # no backward; holds sent rows until the consumer's forward takes them

    @staticmethod
    def of(graph: StageGraph, policy: Policy, ref: StageRef) -> _Facts:
        holders = graph.holders_of(ref)
        return _Facts(policy.gate(ref), len(holders) > 1, holders, graph.backward_kinds(ref, policy.split),
                      graph.needs_backward(ref), _sends_rows(graph, ref))


@dataclass
class _State:
    missing: dict = field(default_factory=dict)  # action -> producers not yet done
    consumers: dict = field(default_factory=dict)  # action -> actions that wait for it
    copies_left: dict = field(default_factory=dict)  # action of a shared stage -> holders still running it
    held: dict = field(default_factory=dict)
    deferred: dict = field(default_factory=dict)  # gate -> W pending after their B
    f_left: dict = field(default_factory=dict)  # stage -> forwards not yet started
    producers: dict = field(default_factory=dict)  # action -> its producers (computed once)
    facts: dict = field(default_factory=dict)  # stage -> _Facts


def list_schedule(skeleton: IterationSchedule, policy: Policy, order: list[int],
                  costs: CostTable) -> dict[int, list[Action]]:
    """Replay the iteration under ``policy``; return each rank's actions in start order."""
    g = skeleton.graph
    lanes = policy.lanes if policy.lanes is not None else default_lanes(skeleton, order, policy.split)
    position = {m: i for i, m in enumerate(order)}
    grad = {s: (Kind.BW if Kind.BW in g.backward_kinds(s, policy.split) else Kind.B) for s in g.stages()}
    state = _State(f_left={s: len(g.holders_of(s)) * sum(len(skeleton.subs(s.module, m)) for m in order)
                           for s in g.stages()},
                   facts={s: _Facts.of(g, policy, s) for s in g.stages()})
    for queues in lanes.values():
        for queue in queues:
            for a in queue:
                _register(skeleton, state, a, grad)
    orders: dict[int, list[Action]] = {r: [] for r in lanes}
    busy: dict[int, bool] = {r: False for r in lanes}
    near = _nearby_ranks(g)
    dirty = set(lanes)  # idle ranks whose choice may have changed since they last found nothing
    running: list[tuple[float, int, int, Action]] = []
    remaining = sum(len(q) for qs in lanes.values() for q in qs)
    t, seq = 0.0, 0
    while remaining or running:
        while running and running[0][0] <= t:
            _, _, rank, a = heapq.heappop(running)
            busy[rank] = False
            _finish(skeleton, policy, state, a, rank)
            dirty.add(rank)
            dirty.update(near[a.stage_ref])
        for rank, queues in lanes.items():
            if busy[rank] or rank not in dirty:
                continue
            dirty.discard(rank)
            pick = _choose(skeleton, policy, state, queues, position, grad, rank)
            if pick is None:
                continue
            queue, a = pick
            queue.popleft()
            _start(skeleton, policy, state, a, rank)
            if a.kind is Kind.F:  # may free rows its producers' holders held, or a GPipe stage's backwards
                dirty.update(near[a.stage_ref])
            split = len(skeleton.subs(a.module, a.microbatch))
            heapq.heappush(running, (t + costs.duration(a, split, rank), seq, rank, a))
            seq, busy[rank], remaining = seq + 1, True, remaining - 1
            orders[rank].append(a)
        if not running and remaining:
            heads = {r: [str(q[0]) for q in qs if q] for r, qs in lanes.items() if any(qs)}
            raise ScheduleError(f"{policy.name}: no rank can start any action (heads {heads}); the "
                                "memory gates are too tight for this graph, raise max_in_flight")
        if running:
            t = max(t, running[0][0])
    skeleton.producers = (grad, state.producers)
    return orders


def _nearby_ranks(graph: StageGraph) -> dict[StageRef, set[int]]:
    """Per stage, every rank whose choice an action of the stage can change when it starts or ends:
    the holders of the stage and of the stages its actions feed or take from (the chain neighbours;
    an encoder's last stage and the LLM's first stage are neighbours)."""
    firsts = {StageRef(LLM, 0)}
    lasts = {StageRef(e, graph.module(e).n_stages - 1) for e in graph.encoders}
    out = {}
    for ref in graph.stages():
        nearby = {ref, StageRef(ref.module, ref.stage - 1), StageRef(ref.module, ref.stage + 1)}
        nearby |= lasts if ref in firsts else firsts if ref in lasts else set()
        out[ref] = {r for n in nearby if graph.has_stage(n) for r in graph.holders_of(n)}
    return out


def _register(skeleton: IterationSchedule, state: _State, a: Action, grad) -> None:
    """Record an action's producers once (a shared stage's action sits in several holders' lanes)."""
    if a in state.producers:
        return
    deps = state.producers[a] = skeleton.graph.producers(a, skeleton.subs, lambda ref: grad[ref])
    state.missing[a] = len(set(deps))
    for d in set(deps):
        state.consumers.setdefault(d, []).append(a)


def _gate_key(facts: _Facts, rank: int):
    """The memory gate an action of the stage on ``rank`` counts against (None = ungated).

    Every holder of a shared stage keeps its own share of each microbatch, so it has its own gate.
    """
    key = facts.gate
    if key is None or not facts.shared:
        return key
    return key, rank


def _sends_rows(graph: StageGraph, ref: StageRef) -> bool:
    """A stage with no backward whose forward output waits for a consumer (gated by what it took)."""
    return not graph.needs_backward(ref) and not (ref.module == LLM and graph.is_last(ref))


def _admitted(skeleton: IterationSchedule, policy: Policy, state: _State, a: Action, rank: int) -> bool:
    """Whether the rank's memory gate lets ``a`` start.

    A stage with a backward holds a microbatch's activations from its forward until its backward
    (1F1B's warm-up depth: forward m + k waits for backward m); a stage with none frees them after
    the forward, but holds the rows it sent until its consumer's forward takes them.
    """
    ref = a.stage_ref
    if a.kind is not Kind.F:
        return not policy.backward_after_forward or state.f_left[ref] == 0
    facts = state.facts[ref]
    base = facts.gate
    if base is None or not (facts.backward or facts.sends_rows):
        return True
    key = _gate_key(facts, rank)
    share = 1.0 / len(skeleton.subs(a.module, a.microbatch))
    if state.deferred.get(key, 0.0) >= policy.w_limits.get(base, _INF) - 1e-9:
        return False
    return state.held.get(key, 0.0) + share <= policy.limits.get(base, _INF) + 1e-9


def _choose(skeleton: IterationSchedule, policy: Policy, state: _State, queues: list[deque],
            position: dict[int, int], grad: dict[StageRef, Kind], rank: int) -> tuple[deque, Action] | None:
    """The best ready and admitted head among a rank's queues."""
    best = None
    for queue in queues:
        if not queue:
            continue
        a = queue[0]
        if state.missing[a] or not _admitted(skeleton, policy, state, a, rank):
            continue
        key = policy.priority(a, position[a.microbatch])
        if best is None or key < best[0]:
            best = (key, queue, a)
    return None if best is None else (best[1], best[2])


def _held_delta(skeleton: IterationSchedule, policy: Policy, state: _State, a: Action) -> float:
    share = 1.0 / len(skeleton.subs(a.module, a.microbatch))
    kinds = state.facts[a.stage_ref].kinds
    if not kinds or a.kind is Kind.F:
        return share if kinds and a.kind is Kind.F else 0.0
    if len(kinds) == 2:
        return -share * (policy.b_release if a.kind is Kind.B else 1 - policy.b_release)
    return -share


def _start(skeleton: IterationSchedule, policy: Policy, state: _State, a: Action, rank: int) -> None:
    if a.kind is not Kind.F:
        return
    ref = a.stage_ref
    state.f_left[ref] -= 1
    facts = state.facts[ref]
    key = _gate_key(facts, rank)
    if facts.backward:
        state.held[key] = state.held.get(key, 0.0) + _held_delta(skeleton, policy, state, a)
    elif facts.sends_rows:
        state.held[key] = state.held.get(key, 0.0) + 1.0 / len(skeleton.subs(a.module, a.microbatch))
    for p in state.producers[a]:  # this forward takes the rows its producers with no backward sent
        pfacts = state.facts[p.stage_ref]
        if pfacts.sends_rows:
            share = 1.0 / len(skeleton.subs(p.module, p.microbatch))
            for holder in pfacts.holders:
                pkey = _gate_key(pfacts, holder)
                state.held[pkey] = state.held.get(pkey, 0.0) - share


def _finish(skeleton: IterationSchedule, policy: Policy, state: _State, a: Action, rank: int) -> None:
    facts = state.facts[a.stage_ref]
    holders = len(facts.holders)
    if holders > 1:  # a shared stage's action is done once every holder has run its share
        state.copies_left[a] = state.copies_left.get(a, holders) - 1
    if holders == 1 or state.copies_left[a] == 0:
        for c in state.consumers.get(a, ()):
            state.missing[c] -= 1
    if a.kind is not Kind.F:
        key = _gate_key(facts, rank)
        state.held[key] = state.held.get(key, 0.0) + _held_delta(skeleton, policy, state, a)
        if len(facts.kinds) == 2:
            share = 1.0 / len(skeleton.subs(a.module, a.microbatch))
            state.deferred[key] = state.deferred.get(key, 0.0) + (share if a.kind is Kind.B else -share)
