"""Encoder work cut inside items: each LLM replica's items shared evenly by the replicas that feed it.

Samples go to encoder replicas whole (`harmonia.schedule.iteration`). Where an LLM replica's
microbatch holds fewer long items (videos) than it has encoder replicas on its
ranks, dealing whole samples leaves some of them idle while one encodes, microbatch after
microbatch, and the LLM's TP x CP group waits for the last (`harmonia.sim.tasks`). An encoder runs
every output slot of an item on its own (a tile, or a video's merged frame of tiles:
`harmonia.model.batch.ItemInputs.groups`; the projector averages only within a slot), so an item
can be encoded in parts on different replicas and its rows put back together exactly.

`cut_encoder_items` re-splits, per global microbatch, each LLM replica's items of an encoder
among its feeding replicas: the items in packing order, as *units* (a merged video frame, or a
whole item the planner does not cut: images, audio), cut into
contiguous shares of about equal seconds, one per feeding replica in order, where that evens them
out more than dealing whole samples does (else the deal stays). A replica's share of a
sample is a `Cut`: from ``(item, slot)`` up to ``(item, slot)``, items counted among the encoder's
own in the sample. The encoder replica runs the slots of its share (`kept_parts`), the boundary
moves each share's rows to the replica packing the sample (`harmonia.runtime.mllm_inputs`), and
the stage work prices each share as a video of its frames (`cut_item`).

Only encoders whose feeding replicas lie on their LLM replica's own ranks are cut (colocated): the
rows then stay on those ranks, and each replica's share stays within one LLM replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from harmonia.model.spec import EncoderSpec
from harmonia.schedule.iteration import IterationAssignment, feeding_replicas
from harmonia.schedule.plan import Plan
from harmonia.workload.cost import CostModel
from harmonia.workload.shapes import ModalityItem, SampleShape, encoder_sequences, image_tiles, llm_tokens_of_item

_EPS = 1e-12

Cut = tuple[tuple[int, int], tuple[int, int], int]
"""A replica's share of one sample's items of an encoder: ``(item, slot)`` up to ``(item, slot)``
(exclusive; ``(n_items, 0)`` is the end), and the LLM rows it gives (every rank knows them, also
one that does not decode the sample)."""


def kept_parts(n_items: int, cut: Cut | None) -> list[tuple[int, int, int | None]]:
    """``(item, first slot, stop slot or None = the item's end)`` of each item part a share keeps,
    in order (None: every item whole)."""
    if cut is None:
        return [(k, 0, None) for k in range(n_items)]
    (ka, sa), (kb, sb) = cut[0], cut[1]
    out = []
    for k in range(ka, min(kb, n_items - 1) + 1):
        first, stop = (sa if k == ka else 0), (sb if k == kb else None)
        if stop is None or stop > first:
            out.append((k, first, stop))
    return out


def slot_unit(item: ModalityItem, encoder: EncoderSpec) -> tuple[int, int, int] | None:
    """``(units, slots per unit, frames per unit)`` of an item the planner cuts, or None: a video's
    merged frames (``temporal_merge`` frames of ``tiles`` slots each). Images are not cut (their
    few tiles even out over a microbatch's samples, and cutting them would only widen the search),
    nor audio, anyres or native-resolution items (their slots differ in rows)."""
    if item.modality != "video" or encoder.grid_pinpoints or (encoder.native_resolution and item.tiles is None):
        return None
    return math.ceil(item.frames / encoder.temporal_merge), image_tiles(item, encoder), encoder.temporal_merge


def cut_item(item: ModalityItem, encoder: EncoderSpec, first: int, stop: int | None) -> ModalityItem:
    """The item an encoder replica runs for slots [first, stop) of ``item`` (whole: the item)."""
    unit = slot_unit(item, encoder)
    if unit is None or (first == 0 and stop is None):
        return item
    n, per, frames = unit
    stop = n * per if stop is None else stop
    lo, hi = first // per * frames, min(item.frames, math.ceil(stop / per) * frames)
    return replace(item, frames=hi - lo, tiles=per)


def item_seconds(cost: CostModel, encoder: str, items: Sequence[ModalityItem]) -> np.ndarray:
    """(n_items,) F + B + W seconds of each item through the encoder and its projector, from the
    cost model's additive per-sample terms."""
    spec, col = cost.mllm.encoders[encoder], {m: j for j, m in enumerate(cost.modules)}
    tokens = np.zeros((len(items), len(cost.modules)))
    pairs = np.zeros_like(tokens)
    for i, item in enumerate(items):
        seqs = encoder_sequences(item, spec)
        tokens[i, col[encoder]], pairs[i, col[encoder]] = sum(seqs), sum(n * n for n in seqs)
        if f"{encoder}_proj" in col:
            tokens[i, col[f"{encoder}_proj"]] = llm_tokens_of_item(item, spec)
    per_module = cost.costs_from_loads(tokens, pairs)
    return per_module[:, col[encoder]] + (per_module[:, col[f"{encoder}_proj"]] if f"{encoder}_proj" in col else 0.0)


def encoder_items(shape: SampleShape, encoder: EncoderSpec) -> list[ModalityItem]:
    """A sample's items of one encoder, in sequence order."""
    return [item for item in shape.items if item.modality in encoder.modalities]


def cut_encoder_items(assignment: IterationAssignment, plan: Plan, cost: CostModel,
                      shapes: Sequence[SampleShape], kept: dict | None = None) -> IterationAssignment:
    """The assignment with each colocated encoder's work of every LLM replica's microbatch cut
    evenly over its feeding replicas (module docstring); other encoders keep their split.

    Args:
        assignment: the iteration's assignment (its positions index ``shapes``'s batch order via
            ``assignment.microbatches``).
        plan: the layouts (which replicas feed which LLM replica).
        cost: the cost model (each unit's seconds).
        shapes: the batch's sample shapes.
        kept: each encoder's item table (`_item_table`) and LLM replicas' cuts (`_cut_replica`) of
            earlier calls on the same ``shapes`` and ``cost``; updated with this call's.
    """
    split, cuts = dict(assignment.encoder_split), dict(assignment.encoder_cuts)
    for e in plan.encoders:
        feeds = feeding_replicas(plan, e)
        owned = [r for rs in feeds for r in rs]
        if len(set(owned)) != len(owned) or max(len(rs) for rs in feeds) < 2 or len(feeds) != plan.layouts["llm"].dp:
            continue
        spec = cost.mllm.encoders[e]
        table = None if kept is None else kept.get(("item table", e))
        if table is None:
            table = _item_table(cost, e, spec, shapes)
            if kept is not None:
                kept[("item table", e)] = table
        split[e], cuts[e] = [], []
        for m, samples in enumerate(assignment.microbatches):
            dealt = assignment.encoder_split[e][m]
            mine: list[list[int]] = [list(held) for held in dealt]
            shares: dict[tuple[int, int], Cut] = {}
            for d, positions in enumerate(assignment.llm_split[m]):
                rows = [table[samples[p]] for p in positions]
                if all(unit is None for _, _, units in rows for unit in units):
                    continue  # nothing to cut: the deal stays
                seconds = {p: sum(row[1]) for p, row in zip(positions, rows)}
                before = max(sum(seconds[p] for p in dealt[r] if p in seconds) for r in feeds[d])
                key = (tuple(samples[p] for p in positions), len(feeds[d]))
                found = None if kept is None else kept.setdefault(("cuts", e), {}).get(key)
                if found is None:
                    found = _cut_replica(rows, len(feeds[d]), spec)
                    if kept is not None:
                        kept[("cuts", e)][key] = found
                after, lists, parts = found
                if after < before - _EPS:  # cut where it evens the replicas out more than dealing whole samples
                    for j, r in enumerate(feeds[d]):
                        mine[r] = [p for p in mine[r] if p not in seconds] + [positions[s] for s in lists[j]]
                    shares.update({(feeds[d][j], positions[s]): cut for (j, s), cut in parts.items()})
            split[e].append([sorted(held) for held in mine])
            cuts[e].append(shares)
    return replace(assignment, encoder_split=split, encoder_cuts=cuts, memo={})  # what it keeps is the split's


def _item_table(cost: CostModel, encoder: str, spec: EncoderSpec, shapes: Sequence[SampleShape]) -> list[tuple]:
    """Per sample, its items of the encoder, their seconds and units (`slot_unit`), priced in one pass."""
    items = [encoder_items(s, spec) for s in shapes]
    flat = [i for its in items for i in its]
    seconds = item_seconds(cost, encoder, flat).tolist() if flat else []
    out, k = [], 0
    for its in items:
        out.append((its, seconds[k:k + len(its)], [slot_unit(i, spec) for i in its]))
        k += len(its)
    return out


def _cut_replica(rows: list[tuple], n_feeders: int, spec: EncoderSpec) -> tuple[float, list[list[int]], dict]:
    """One LLM replica's samples (``rows``: their `_item_table` entries, in packing order) cut over
    ``n_feeders`` replicas: the largest feeder's seconds, each feeder's samples (indices into
    ``rows``) and the partial shares (``(feeder index, sample index) -> Cut``). It depends on the
    samples and the feeder count only, so a search keeps it per both (`cut_encoder_items`'s
    ``kept``)."""
    units: list[tuple[int, int, int, float]] = []  # (sample, item, first slot, seconds)
    ends: list[tuple[int, int]] = []  # (item, slot) just past each unit
    for s, (items, item_secs, item_units) in enumerate(rows):
        for k, (sec, unit) in enumerate(zip(item_secs, item_units)):
            if unit is None:
                units.append((s, k, 0, float(sec)))
                ends.append((k + 1, 0))
                continue
            n, per, _ = unit
            for u in range(n):
                units.append((s, k, u * per, float(sec) / n))
                ends.append((k, (u + 1) * per) if u + 1 < n else (k + 1, 0))
    seconds = np.array([u[3] for u in units])
    bounds = _even_cuts(seconds, n_feeders)
    lists: list[list[int]] = [[] for _ in range(n_feeders)]
    shares: dict[tuple[int, int], Cut] = {}
    owner = [0] * len(rows)  # the feeder of each sample's first unit (unit-less samples: the last one's)
    first_unit = {}
    for j in range(n_feeders):
        for i in range(bounds[j], bounds[j + 1]):
            first_unit.setdefault(units[i][0], j)
    last = 0
    for s in range(len(rows)):
        last = owner[s] = first_unit.get(s, last)
    for j in range(n_feeders):
        lo, hi = bounds[j], bounds[j + 1]
        inside: dict[int, list[int]] = {}
        for i in range(lo, hi):
            inside.setdefault(units[i][0], []).append(i)
        touched = sorted(set(inside) | {s for s in range(len(rows)) if s not in first_unit and owner[s] == j})
        for s in touched:
            lists[j].append(s)
            if s not in inside:
                continue
            first, end = inside[s][0], inside[s][-1]
            items = rows[s][0]
            start, stop = (units[first][1], units[first][2]), ends[end]
            if start != (0, 0) or stop != (len(items), 0):
                n_rows = sum(llm_tokens_of_item(cut_item(items[k], spec, a, b), spec)
                             for k, a, b in kept_parts(len(items), (start, stop, 0)))
                shares[(j, s)] = (start, stop, n_rows)
    most = max((float(seconds[bounds[j]:bounds[j + 1]].sum()) for j in range(n_feeders)), default=0.0)
    return most, lists, shares


def _even_cuts(seconds: np.ndarray, k: int) -> list[int]:
    """``k + 1`` unit indices cutting ``seconds`` into ``k`` contiguous runs of about equal sums
    (each cut at the boundary nearest its share of the total)."""
    n = len(seconds)
    cum = np.cumsum(seconds)
    total = float(cum[-1]) if n else 0.0
    out = [0]
    for j in range(1, k):
        target = total * j / k
        i = int(np.searchsorted(cum, target))  # cum[i] >= target: cut before unit i or after it
        before = float(cum[i - 1]) if i > 0 else 0.0
        after = float(cum[i]) if i < n else total
        out.append(max(out[-1], min(n, i if target - before <= after - target else i + 1)))
    out.append(n)
    return out
