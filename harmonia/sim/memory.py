"""Activation memory of every rank's action list, without timing it.

A rank's compute actions run one after another on its compute stream in the order
`harmonia.schedule.rank_actions.rank_compute_actions` gives, and only they hold activations: F
keeps its unit's activations, the backward frees them (when split, B frees none and keeps the
output gradients W needs as well, W frees both: `harmonia.workload.memory_cost`), and the
task that runs a recomputed block's forward again holds its activations while it runs. So a rank's
activation peak depends on its order alone, not on when each action starts: `activation_peaks`
finds what `harmonia.sim.tasks.simulate_schedule` reports as ``Timeline.peak_mem`` for the cost of
ordering the actions, without building tasks, messages or collectives or replaying them (the plan
search rejects a candidate that cannot fit before it is timed).

`activation_bound` bounds the peak of any order from the units alone (all kept bytes at once plus
the largest one action holds while it runs): a training step's memory check orders the actions
only where that bound does not fit (`harmonia.train.iteration.IterationBuilder`).

Beside the activations, a rank holds its encoders' inputs for the whole step (`input_bytes`: the
runtime moves a step's batch to the device before its first action).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from harmonia.schedule.actions import Action
from harmonia.schedule.graph import IterationSchedule, StageGraph
from harmonia.schedule.plan import Plan
from harmonia.schedule.rank_actions import rank_compute_actions
from harmonia.schedule.stagework import IterationWork, MicrobatchWork, StageKey
from harmonia.sim.engine import running_peak

INPUT_BYTES = 4
"""Bytes of one encoder input value: pixel rows and mel frames arrive in fp32."""


def phase(graph: StageGraph, a: Action) -> tuple[str, bool, bool]:
    """(kind, a W-only stage's W, the stage has W) of a compute action."""
    kind = a.kind.value
    return kind, kind == "W" and not graph.needs_b(a.stage_ref), graph.needs_w(a.stage_ref)


def unit_memory(work: MicrobatchWork, kind: str, w_only: bool, has_w: bool) -> tuple[float, float]:
    """(bytes allocated (+) or freed (-), bytes held only while it runs) of one phase of a unit:
    F keeps its activations and, while it runs, the intermediates of a block that keeps nothing;
    a split backward's B frees none of them (its autograd graph is kept for W) and keeps the output
    gradients W needs (``w_held``), its W frees both and holds, while it runs, the weight gradients it
    makes (``w_transient``); a fused BW, or a W that is the stage's whole
    backward, frees them all; the phase that runs the blocks' backward through their inputs (B,
    BW, or a W-only stage's W) holds a block's gradients, and its recomputed activations, while
    it runs (`harmonia.workload.cost.CostModel.backward_transient_bytes`)."""
    if kind == "F":
        return work.act_bytes, work.act_bytes + work.f_transient if work.f_transient else 0.0
    if kind == "B" and has_w:
        delta = work.w_held
    elif kind == "W" and not w_only:  # beside what it frees at its end, the weight gradients it makes
        return -(work.act_bytes + work.w_held), work.w_transient
    else:
        delta = -work.act_bytes
    recomputes = kind in ("B", "BW") or w_only
    return delta, work.transient if recomputes else 0.0


def activation_peaks(plan: Plan, iw: IterationWork, schedule: IterationSchedule,
                     ranks: Iterable[int] | None = None) -> dict[int, float]:
    """Per rank (default: every rank of the plan), the peak activation bytes of the iteration's
    stage work ``iw`` under ``schedule``: ``Timeline.peak_mem`` of its simulation."""
    graph = schedule.graph
    phases: dict[tuple, tuple[str, bool, bool]] = {}
    specs: dict[int, list[tuple]] = {}  # action list -> its actions as (module, stage, microbatch, sub, phase)
    peaks: dict[tuple, float] = {}  # (action list, replicas) -> peak: TP and CP peers alike
    out = {}
    for rank, actions in rank_compute_actions(plan.layouts, schedule, ranks).items():
        replicas = tuple(sorted((m, lay.coords(rank)["dp"]) for m, lay in plan.layouts.items()
                                if lay.holds(rank)))
        same = (id(actions), replicas)
        if same not in peaks:
            if id(actions) not in specs:
                specs[id(actions)] = [_spec(phases, graph, a) for a in actions]
            peaks[same] = running_peak(_events(iw, specs[id(actions)], dict(replicas)))
        out[rank] = peaks[same]
    return out


def activation_bound(iw: IterationWork) -> dict[int, float]:
    """Per rank that runs a unit of ``iw``, an upper bound of its `activation_peaks` under any order
    of its actions, found without ordering them: every unit's kept bytes held at once (each F's
    activations and each unit's ``w_held``, which only a split B keeps, the only phases that
    allocate for later; counted for a fused backward too, a looser bound there) plus the most one
    of its actions holds only while it runs (an F's activations and intermediates, a backward's
    gradients and recomputed activations, a W's weight gradients). `running_peak` of any order of
    `unit_memory`'s events is at most that: its level never exceeds the kept bytes summed, and each
    event's transient adds to one level."""
    kept: dict[StageKey, float] = {}
    running: dict[StageKey, float] = {}
    for (key, _, _), w in iw.work.items():
        kept[key] = kept.get(key, 0.0) + w.act_bytes + w.w_held
        held = max(w.act_bytes + w.f_transient, w.transient, w.w_transient)
        running[key] = max(running.get(key, 0.0), held)
    rank_kept: dict[int, float] = {}
    rank_running: dict[int, float] = {}
    for key, nbytes in kept.items():
        for rank in iw.stage_ranks[key]:
            rank_kept[rank] = rank_kept.get(rank, 0.0) + nbytes
            rank_running[rank] = max(rank_running.get(rank, 0.0), running[key])
    return {rank: rank_kept[rank] + rank_running[rank] for rank in rank_kept}


def _spec(phases: dict, graph: StageGraph, a: Action) -> tuple:
    key = (a.module, a.stage, a.kind)
    if key not in phases:
        phases[key] = phase(graph, a)
    return a.module, a.stage, a.microbatch, a.sub, phases[key]


def _events(iw: IterationWork, spec: list[tuple], replicas: dict[str, int]) -> Iterator[tuple[float, float]]:
    """`unit_memory` of each action of a list (`_spec`) run by the given module replicas."""
    keys: dict[tuple[str, int], StageKey] = {}
    for module, stage, m, sub, (kind, w_only, has_w) in spec:
        key = keys.get((module, stage))
        if key is None:
            key = keys[(module, stage)] = StageKey(module, replicas[module], stage)
        work = iw.unit(key, m, sub)
        if work is not None:
            yield unit_memory(work, kind, w_only, has_w)


def input_elems(encoder) -> int:
    """Input values per encoder token (`harmonia.model.spec.EncoderSpec`): a patch's ``C p^2`` (times
    the temporal patch of a native-resolution tower), or two mel frames (the conv stem's stride 2)."""
    if encoder.is_audio:
        return 2 * encoder.n_mels
    return encoder.channels * encoder.patch_size ** 2 * (encoder.temporal_merge if encoder.native is not None else 1)


def input_bytes(mllm, iw: IterationWork, ranks: Iterable[int] | None = None) -> dict[int, float]:
    """Per rank (default: every rank that runs an encoder's first stage), the bytes of the encoder
    inputs it holds through the step: every unit of its first stages, ``tokens x input_elems`` fp32
    values each (a TP group's ranks each hold them whole)."""
    wanted = None if ranks is None else set(ranks)
    tokens: dict[StageKey, int] = {}
    for (key, _, _), work in iw.work.items():
        if key.stage == 0 and key.module in mllm.encoders:
            tokens[key] = tokens.get(key, 0) + work.tokens
    out: dict[int, float] = {}
    for key, n in tokens.items():
        nbytes = n * input_elems(mllm.encoders[key.module]) * INPUT_BYTES
        for rank in iw.stage_ranks[key]:
            if wanted is None or rank in wanted:
                out[rank] = out.get(rank, 0.0) + nbytes
    return out
