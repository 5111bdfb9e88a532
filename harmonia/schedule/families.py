"""The schedule families users pick: GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1).

Each ``build_*`` takes the stage graph, the number of microbatches and, optionally, the order in
which microbatches enter the pipeline, the encoders' sub-microbatch counts and per-microbatch
costs, and returns a compute-only `IterationSchedule`; `harmonia.schedule.lowering.lower` adds the
sends and receives. See `harmonia.schedule.generators` for how the policies below are run.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Mapping, Sequence

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.costs import CostTable
from harmonia.schedule.generators import (FAMILIES, Policy, default_lanes, is_colocated, list_schedule,
                                          normalize_order, normalize_sub, stage_actions)
from harmonia.schedule.graph import IterationSchedule, LLM, StageGraph

_CLASS = {Kind.F: "F", Kind.B: "grad", Kind.BW: "grad", Kind.W: "W"}


def _class(graph: StageGraph, a: Action, split: bool) -> str:
    """F, grad (produces or consumes the incoming gradient first) or W (deferrable)."""
    if a.kind is Kind.W and not graph.needs_b(a.stage_ref):
        return "grad"  # W-only stage: its W is the stage's whole backward
    return _CLASS[a.kind]


def _priority(graph: StageGraph, split: bool, rank_of_class: dict[str, int]):
    """Sort key of an action on its rank: its class first (the family's), then microbatch position.

    A colocated encoder's forward of a microbatch goes right ahead of the LLM forwards of the same
    position (the LLM's first stage consumes it next); its backwards come after every LLM class,
    so they run only in the rank's bubbles. Elsewhere, at equal class and position, the LLM's
    gradients go first (they are on the critical path).
    """
    colocated = {ref for ref in graph.stages() if is_colocated(graph, ref)}
    fill = max(rank_of_class.values()) + 1

    def key(a: Action, position: int) -> tuple:
        cls = _class(graph, a, split)
        if a.stage_ref in colocated:
            if cls == "F":
                return rank_of_class[cls], position, 0, a.sub or 0, -a.stage
            return fill, position, 0, a.sub or 0, -a.stage
        module_rank = 1 if cls == "F" or a.module == LLM else 2
        return rank_of_class[cls], position, module_rank, a.sub or 0, -a.stage
    return key


def _stage_gates(graph: StageGraph, cap: float | None) -> tuple:
    """1F1B gates: one per stage (per holder of a shared stage), limit = depth to the LLM's end.

    Encoders are gated as the LLM's stages are, wherever they run: forward m + k waits for backward
    m (or, on a stage with no backward, for the consumer to take the rows of m), k = the stages
    from the encoder's to the LLM's last, so no encoder runs arbitrarily far ahead of the LLM.
    """
    def gate(ref: StageRef):
        return ref
    limits = {ref: float(graph.depth_to_end(ref) if cap is None else cap) for ref in graph.stages()}
    return gate, limits


def _skeleton(graph, n_microbatches, n_sub, order, family) -> tuple[IterationSchedule, list[int]]:
    order = normalize_order(n_microbatches, order)
    skeleton = IterationSchedule(graph, n_microbatches, normalize_sub(graph, n_microbatches, n_sub),
                                 {r: [] for r in graph.ranks()}, family)
    return skeleton, order


def _finish(skeleton: IterationSchedule, policy: Policy, order, costs) -> IterationSchedule:
    skeleton.orders = list_schedule(skeleton, policy, order, costs or CostTable.uniform())
    skeleton.costs = costs
    return skeleton


def build_gpipe(graph: StageGraph, n_microbatches: int, *, order: Sequence[int] | None = None,
                n_sub: Mapping[str, int | Sequence[int]] | None = None,
                costs: CostTable | None = None) -> IterationSchedule:
    """GPipe: every stage runs all its forwards, then all its (fused) backwards."""
    skeleton, order = _skeleton(graph, n_microbatches, n_sub, order, "gpipe")
    policy = Policy("gpipe", False, _priority(graph, False, {"F": 0, "grad": 1, "W": 2}),
                    backward_after_forward=True)
    return _finish(skeleton, policy, order, costs)


def build_1f1b(graph: StageGraph, n_microbatches: int, *, order: Sequence[int] | None = None,
               n_sub: Mapping[str, int | Sequence[int]] | None = None, costs: CostTable | None = None,
               max_in_flight: float | None = None) -> IterationSchedule:
    """1F1B: a stage keeps at most (stages to the LLM's end) microbatches in flight, backward first.

    Args:
        max_in_flight: replaces every stage's in-flight limit (memory bound in microbatches).
    """
    skeleton, order = _skeleton(graph, n_microbatches, n_sub, order, "1f1b")
    gate, limits = _stage_gates(graph, max_in_flight)
    policy = Policy("1f1b", False, _priority(graph, False, {"grad": 0, "F": 1, "W": 2}), gate, limits)
    return _finish(skeleton, policy, order, costs)


def build_zero_bubble(graph: StageGraph, n_microbatches: int, *, order: Sequence[int] | None = None,
                      n_sub: Mapping[str, int | Sequence[int]] | None = None,
                      costs: CostTable | None = None, max_in_flight: float | None = None,
                      max_deferred_w: float | None = None) -> IterationSchedule:
    """Zero-bubble ZB-H1: backward split into B and W; W runs when nothing else can (bubbles).

    Forwards are gated as in 1F1B on microbatches whose B has not run (B frees the activations
    the input gradient needs; W keeps only what the weight gradients need). A stage defers at most
    ``max_deferred_w`` weight gradients (default: its 1F1B depth) before its forwards wait for W.
    Where each W lands depends on the costs: it fills the gaps the replay finds.

    Args:
        max_in_flight: replaces every stage's in-flight limit.
        max_deferred_w: replaces every stage's limit on deferred weight gradients.
    """
    skeleton, order = _skeleton(graph, n_microbatches, n_sub, order, "zb")
    gate, limits = _stage_gates(graph, max_in_flight)
    w_limits = {k: (lim if max_deferred_w is None else max_deferred_w) for k, lim in limits.items()}
    policy = Policy("zb", True, _priority(graph, True, {"grad": 0, "F": 1, "W": 2}), gate, limits,
                    b_release=1.0, w_limits=w_limits)
    return _finish(skeleton, policy, order, costs)


def build_interleaved_1f1b(graph: StageGraph, n_microbatches: int, *,
                           order: Sequence[int] | None = None,
                           n_sub: Mapping[str, int | Sequence[int]] | None = None,
                           costs: CostTable | None = None, split: bool = False,
                           max_in_flight: float | None = None) -> IterationSchedule:
    """Interleaved 1F1B over the LLM's virtual stages (chunk c on pipeline rank c % pp).

    Microbatches go in rounds of ``n // max(1, n // pp)``; within a round a rank runs a chunk's
    forwards for every microbatch of the round before moving to its next chunk (Megatron-LM's
    order, as in torch.distributed.pipelining). With ``split`` the backward is split into B and W
    (interleaved zero bubble, torch's warm-up of one op per hop).
    """
    skeleton, order = _skeleton(graph, n_microbatches, n_sub, order, "interleaved")
    llm = graph.llm
    pp = len(dict.fromkeys(llm.ranks))
    if llm.n_stages % pp or any(llm.ranks[c] != llm.ranks[c % pp] for c in range(llm.n_stages)):
        raise ScheduleError(
            f"interleaved 1F1B needs the LLM's {llm.n_stages} stage chunks round-robin over its "
            f"{pp} ranks (chunk c on the rank of chunk c % pp); got ranks {llm.ranks}"
        )
    rounds = max(1, n_microbatches // pp)
    per_round = n_microbatches // rounds
    if n_microbatches % rounds:
        raise ScheduleError(
            f"interleaved 1F1B with pp={pp} needs n_microbatches divisible by its {rounds} rounds; "
            f"use a multiple of {pp}, or fewer than {2 * pp} microbatches"
        )
    lanes = _interleaved_lanes(skeleton, order, pp, per_round, split)
    v = llm.n_stages // pp
    factor = 1 if split else 2
    limits: dict = {}
    for r, rank in enumerate(llm.ranks[:pp]):
        warmup = min((v - 1) * per_round + factor * (pp - 1 - r), n_microbatches * v)
        limits[("llm", rank)] = float(min(warmup + 1, n_microbatches * v) if max_in_flight is None
                                      else max_in_flight)
    stage_gate, stage_limits = _stage_gates(graph, max_in_flight)
    limits.update({k: l for k, l in stage_limits.items() if k.module != LLM})

    def gate(ref: StageRef):
        return ("llm", graph.rank_of(ref)) if ref.module == LLM else stage_gate(ref)

    classes = {"F": 0, "grad": 1, "W": 2}  # steady state F then B, as Megatron-LM
    policy = Policy("interleaved", split, _priority(graph, split, classes), gate,
                    limits, b_release=0.5 if split else 0.0, lanes=lanes)
    return _finish(skeleton, policy, order, costs)


def _interleaved_lanes(skeleton: IterationSchedule, order: list[int], pp: int, per_round: int,
                       split: bool) -> dict[int, list[deque]]:
    """Per rank: encoders' default lanes plus one F, one grad and one W lane over the LLM chunks."""
    graph = skeleton.graph
    enc_only = IterationSchedule(graph, skeleton.n_microbatches, skeleton.n_sub)
    lanes = {r: [q for q in qs if q[0].module != LLM]
             for r, qs in default_lanes(enc_only, order, split).items()}
    v = graph.llm.n_stages // pp
    rounds = [order[i:i + per_round] for i in range(0, len(order), per_round)]
    for r in range(pp):
        rank = graph.llm.ranks[r]
        by_class: dict[str, list[Action]] = {"F": [], "grad": [], "W": []}
        for mbs in rounds:
            per_chunk = [stage_actions(skeleton, StageRef(LLM, c * pp + r), mbs, split) for c in range(v)]
            for cls, chunks in (("F", range(v)), ("grad", reversed(range(v))), ("W", reversed(range(v)))):
                for c in chunks:
                    by_class[cls].extend(per_chunk[c][cls])
        lanes[rank].extend(deque(acts) for acts in by_class.values() if acts)
    return lanes


def build_schedule(graph: StageGraph, n_microbatches: int, family: str = "1f1b", *,
                   order: Sequence[int] | None = None,
                   n_sub: Mapping[str, int | Sequence[int]] | None = None,
                   costs: CostTable | None = None) -> IterationSchedule:
    """A compute-only schedule of the named family (``gpipe``, ``1f1b``, ``interleaved``, ``zb``)."""
    builders = {"gpipe": build_gpipe, "1f1b": build_1f1b, "interleaved": build_interleaved_1f1b,
                "zb": build_zero_bubble}
    if family not in builders:
        raise ScheduleError(f"schedule family {family!r} unknown; expected one of {FAMILIES}")
    return builders[family](graph, n_microbatches, order=order, n_sub=n_sub, costs=costs)


def fuse_encoders(schedule: IterationSchedule) -> IterationSchedule:
    """Megatron-LM's order: on every rank, an encoder's forwards of a microbatch run right before the
    LLM's first-stage forward of it, and its backwards right after that stage's last backward of it
    (encoders placed inside the LLM's first pipeline stage). A copy of a compute-only schedule."""
    orders = {}
    for rank, acts in schedule.orders.items():
        enc_f: dict[int, list[Action]] = {}
        enc_b: dict[int, list[Action]] = {}
        rest = []
        for a in acts:
            if a.module == LLM:
                rest.append(a)
            else:
                (enc_f if a.kind is Kind.F else enc_b).setdefault(a.microbatch, []).append(a)
        last_b = {a.microbatch: i for i, a in enumerate(rest) if a.stage == 0 and a.kind is not Kind.F}
        fused = []
        for i, a in enumerate(rest):
            if a.stage == 0 and a.kind is Kind.F:
                fused += enc_f.pop(a.microbatch, [])
            fused.append(a)
            if last_b.get(a.microbatch) == i:
                fused += enc_b.pop(a.microbatch, [])
        for leftovers in (*enc_f.values(), *enc_b.values()):
            fused += leftovers
        orders[rank] = fused
    return replace(schedule, orders=orders, family=schedule.family + "+fused", producers=None, chunk_actions=None,
                   placements=None)
