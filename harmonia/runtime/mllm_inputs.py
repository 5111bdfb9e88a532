"""What one rank needs for one MLLM iteration: its LLM microbatches, its encoder inputs, the boundary plans.

An iteration has ``n`` global microbatches. Global microbatch ``m`` is a list of samples; each LLM DP
replica packs its share of them as its microbatch ``m`` (`PackedBatch`), and each encoder DP
replica encodes its own share (the balancer deals encoder work to encoder replicas independently
of the LLM's). The boundary of encoder ``e`` for microbatch ``m`` then moves every sample's item
rows from the encoder replica that encoded it to the LLM replica that packs it
(`harmonia.runtime.boundary_plan.plan_boundary`, one plan per microbatch and encoder, computed the
same way on every rank).

Inside an encoder replica a microbatch's items may be cut into sub-microbatches (the schedule's
``n_sub``): contiguous runs of its items, so their outputs concatenate back to the replica's rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from harmonia.errors import SampleError
from harmonia.model.batch import ItemInputs, MediaInputs, PackedBatch, TokenizedSample, pack_samples
from harmonia.plan.layout import Layout
from harmonia.runtime.boundary_plan import BoundaryPlan, plan_boundary
from harmonia.schedule.graph import LLM

Split = Sequence[Sequence[int]]
"""Per DP replica, positions of its samples in the global microbatch (in packing order)."""


@dataclass
class RankBatch:
    """One rank's data for one iteration of the whole MLLM.

    Attributes:
        llm: this rank's LLM replica's microbatches (empty on ranks outside the LLM).
        media: encoder -> microbatch -> sub-microbatch -> this encoder replica's inputs (None: no
            items), for the encoders this rank runs.
        plans: encoder -> microbatch -> boundary plan (every encoder; the same on every rank).
        n_targets: target tokens of the whole iteration (the loss normalizer).
    """

    llm: list[PackedBatch] = field(default_factory=list)
    media: dict[str, list[list[MediaInputs | None]]] = field(default_factory=dict)
    plans: dict[str, list[BoundaryPlan]] = field(default_factory=dict)
    n_targets: float = 0.0


def encoder_items(sample: TokenizedSample, encoder: str) -> list[tuple[ItemInputs, int]]:
    """A sample's items of one encoder with their LLM token counts, in sequence order."""
    lengths = [n for kind, n in sample.segments if kind == "item"]
    return [(item, n) for item, n in zip(sample.items, lengths) if item.module == encoder]


def gather_media(items: Sequence[ItemInputs]) -> MediaInputs | None:
    """One encoder's inputs for a run of items (``index`` left empty: the LLM side owns positions)."""
    if not items:
        return None
    inputs, groups, n = [], [], 0
    for item in items:
        g = item.groups if item.groups is not None else torch.arange(item.inputs.shape[0])
        inputs.append(item.inputs)
        groups.append(g + n)
        n += item.n_groups
    return MediaInputs(torch.cat(inputs), torch.cat(groups), n, torch.zeros(0, dtype=torch.long))


def _cut(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges over ``n`` items, as even as possible (front-heavy)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def build_rank_batch(layouts: Mapping[str, Layout], rank: int,
                     microbatches: Sequence[Sequence[TokenizedSample]], llm_split: Sequence[Split],
                     encoder_split: Mapping[str, Sequence[Split]],
                     n_sub: Mapping[str, Sequence[int]] | None = None) -> RankBatch:
    """One rank's `RankBatch` from the iteration's global microbatches and their placement.

    Args:
        layouts: module -> layout (``llm`` and every encoder).
        rank: this process's global rank.
        microbatches: the global microbatches' samples.
        llm_split: per microbatch, per LLM DP replica, its sample positions (each non-empty).
        encoder_split: encoder -> per microbatch, per encoder DP replica, its sample positions.
        n_sub: encoder -> sub-microbatches per microbatch (default 1; the schedule's ``n_sub``).

    Raises:
        SampleError: a split does not hold every sample exactly once, or an LLM replica gets none.
    """
    llm = layouts[LLM]
    encoders = sorted(m for m in layouts if m != LLM)
    out = RankBatch()
    total = 0
    for m, samples in enumerate(microbatches):
        for d, replica in enumerate(llm_split[m]):
            if not replica:
                raise SampleError(f"microbatch {m}: LLM replica {d} gets no sample; give every LLM "
                                  "replica at least one sample per microbatch")
        total += sum(int((s.labels != -100).sum()) for s in samples)
        if rank in llm.rank_list():
            d = llm.coords(rank)["dp"]
            out.llm.append(pack_samples([samples[i] for i in llm_split[m][d]]))
        for e in encoders:
            items = [encoder_items(s, e) for s in samples]
            plan = plan_boundary(layouts[e], llm, [[n for _, n in its] for its in items],
                                 encoder_split[e][m], llm_split[m])
            out.plans.setdefault(e, []).append(plan)
            if rank not in layouts[e].rank_list():
                continue
            mine = [item for i in encoder_split[e][m][layouts[e].coords(rank)["dp"]] for item, _ in items[i]]
            parts = (n_sub or {}).get(e, ())
            cuts = _cut(len(mine), parts[m] if parts else 1)
            out.media.setdefault(e, []).append([gather_media(mine[a:b]) for a, b in cuts])
    out.n_targets = float(total)
    return out
