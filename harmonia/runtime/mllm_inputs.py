"""What one rank needs for one MLLM iteration: its LLM microbatches, its encoder inputs, the boundary plans.

An iteration has ``n`` global microbatches. Global microbatch ``m`` is a list of samples; each LLM DP
replica packs its share of them as its microbatch ``m`` (`PackedBatch`), and each encoder DP
replica encodes its own share (the balancer deals encoder work to encoder replicas independently
of the LLM's). The boundary of encoder ``e`` for microbatch ``m`` then moves every sample's item
rows from the encoder replica that encoded it to the LLM replica that packs it
(`harmonia.runtime.boundary_plan.plan_boundary`, one plan per microbatch and encoder, computed the
same way on every rank).

Inside an encoder replica a microbatch's items may be cut into sub-microbatches (the schedule's
``n_sub``): contiguous runs of its items, so their outputs concatenate back to the replica's rows. The
runs are the ones the schedule's stage work was priced with (`IterationWork.sub_runs`, cut by the
items' cost with `harmonia.schedule.submicrobatch.item_runs`), or, given only counts, the same cut
on equal costs.

With LLM ``cp > 1`` every token of an LLM replica's packed microbatch belongs to one CP rank (the
balancer's assignment, `plan_cp_shards` by default); each CP rank keeps the whole packed batch and
the assignment (`harmonia.runtime.context_parallel.build_cp_shard` cuts its tokens), and the
boundary delivers each CP rank the item rows of its own tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from harmonia.errors import SampleError
from harmonia.model.batch import HOST, ItemInputs, MediaInputs, PackedBatch, TokenizedSample, gather_items, pack_samples
from harmonia.model.spec import TransformerSpec
from harmonia.runtime.boundary_plan import BoundaryPlan, plan_boundary
from harmonia.schedule.cp_shards import attention_unit_costs, plan_cp_shards
from harmonia.schedule.graph import LLM
from harmonia.schedule.item_cuts import kept_parts
from harmonia.schedule.submicrobatch import item_runs
from harmonia.schedule.layout import Layout
from harmonia.schedule.message_order import MessageOrder

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
        llm_cp: with LLM ``cp > 1``, per microbatch the ``(T,)`` CP rank of every token of this
            replica's packed sequence (empty when ``cp == 1``); kept on the CPU, where the CP shard
            is planned (`harmonia.model.batch.HOST`).
        messages: this rank's message order of the iteration
            (`harmonia.runtime.message_program.plan_iteration_messages`), where its preparation built
            it a step ahead; None: the executor builds it when the step starts.
    """

    llm: list[PackedBatch] = field(default_factory=list)
    media: dict[str, list[list[MediaInputs | None]]] = field(default_factory=dict)
    plans: dict[str, list[BoundaryPlan]] = field(default_factory=dict)
    n_targets: float = 0.0
    llm_cp: list[torch.Tensor] = field(default_factory=list, metadata=HOST)
    messages: MessageOrder | None = field(default=None, compare=False)  # derived from the rest, a step ahead


def encoder_items(sample: TokenizedSample, encoder: str) -> list[tuple[ItemInputs, int]]:
    """A sample's items of one encoder with their LLM token counts, in sequence order."""
    lengths = [n for kind, n in sample.segments if kind == "item"]
    return [(item, n) for item, n in zip(sample.items, lengths) if item.module == encoder]


def gather_media(items: Sequence[ItemInputs]) -> MediaInputs | None:
    """One encoder's inputs for a run of items (``index`` left empty: the LLM side owns positions)."""
    if not items:
        return None
    return gather_items(list(items), torch.zeros(0, dtype=torch.long))


def item_positions(samples: Sequence[TokenizedSample], encoder: str) -> np.ndarray:
    """Sequence positions of one encoder's item tokens when ``samples`` are packed in order (``media.index``)."""
    out, offset = [], 0
    for s in samples:
        items = iter(s.items)
        for kind, n in s.segments:
            if kind == "item" and next(items).module == encoder:
                out.append(np.arange(offset, offset + n))
            offset += n
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def cp_token_ranks(samples: Sequence[TokenizedSample], cp: int, block: int = 128, token_cost: float = 1.0,
                   tile_cost: float = 1.0, body: TransformerSpec | None = None) -> np.ndarray:
    """The balanced CP rank of every token of ``samples`` packed in order (`plan_cp_shards`).

    The block shrinks to ``T // cp`` for sequences too short to give every rank a block of ``block``.

    Args:
        samples: one LLM replica's packed samples, in order.
        cp: CP ranks.
        block: tokens per block (at most).
        token_cost: cost of a token's linear/MLP work.
        tile_cost: cost of one attention tile.
        body: the LLM's blocks; when given, both costs are its FLOPs (`attention_unit_costs`).

    Returns:
        ``(T,)`` CP rank per token.
    """
    n = sum(len(s) for s in samples)
    if n < cp:
        raise SampleError(f"a packed microbatch of {n} tokens cannot feed {cp} CP ranks; give each LLM "
                          "replica more tokens per microbatch or use a smaller cp")
    block = max(1, min(block, n // cp))
    if body is not None:
        token_cost, tile_cost = attention_unit_costs(body, block)
    shards = plan_cp_shards([s.segments for s in samples], cp, block=block, token_cost=token_cost,
                            tile_cost=tile_cost)
    return shards.token_ranks()


def slice_item(item: ItemInputs, first: int, stop: int | None) -> ItemInputs:
    """The sequences of an item's output slots [first, stop) (None: to the last), renumbered from 0:
    what an encoder replica runs for its share of the item (`harmonia.schedule.item_cuts`).

    Raises:
        SampleError: the item's tokens come in an order of their own (anyres), so its slots cannot
            be encoded apart.
    """
    if first == 0 and stop is None:
        return item
    if item.order is not None or item.grid is not None:
        raise SampleError("an anyres image's or native-resolution item's tokens cannot be encoded in parts")
    groups = item.groups if item.groups is not None else torch.arange(item.inputs.shape[0])
    stop = item.n_groups if stop is None else stop
    keep = (groups >= first) & (groups < stop)
    return ItemInputs(item.module, item.inputs[keep], groups[keep] - first)


def _boundary_units(items: list[list[tuple[ItemInputs, int]]], split: Split, cuts: Mapping, llm_split: Split
                    ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The rows one boundary moves as units: each sample whole, or each replica's share of a sample
    cut over several (in slot order). Returns (rows of each unit, per encoder replica its units in
    order, per LLM replica its units in order)."""
    holders: dict[int, list[tuple[tuple, int]]] = {}
    for r, positions in enumerate(split):
        for p in positions:
            whole = ((0, 0), (len(items[p]), 0), sum(n for _, n in items[p]))
            holders.setdefault(p, []).append((cuts.get((r, p)) or whole, r))
    unit_rows, of_sample, src = [], {}, [[] for _ in split]
    unit_of: dict[tuple[int, int], int] = {}
    for p in range(len(items)):
        of_sample[p] = []
        for share, r in sorted(holders.get(p, [])):
            unit_of[(r, p)] = len(unit_rows)
            of_sample[p].append(len(unit_rows))
            unit_rows.append([share[2]])
    unheld = [p for p in range(len(items)) if p not in holders]
    if unheld:
        raise SampleError(f"samples {unheld} are held by no encoder replica; every sample needs one")
    for r, positions in enumerate(split):
        src[r] = [unit_of[(r, p)] for p in positions]
    return unit_rows, src, [[u for p in positions for u in of_sample[p]] for positions in llm_split]


def build_rank_batch(layouts: Mapping[str, Layout], rank: int,
                     microbatches: Sequence[Sequence[TokenizedSample]], llm_split: Sequence[Split],
                     encoder_split: Mapping[str, Sequence[Split]],
                     n_sub: Mapping[str, Sequence[int]] | None = None,
                     sub_runs: Mapping[tuple[str, int, int], Sequence[tuple[int, int]]] | None = None,
                     llm_cp: Sequence[Sequence[np.ndarray | Sequence[int]]] | None = None,
                     encoder_cuts: Mapping[str, Sequence[Mapping[tuple[int, int], tuple]]] | None = None
                     ) -> RankBatch:
    """One rank's `RankBatch` from the iteration's global microbatches and their placement.

    Args:
        layouts: module -> layout (``llm`` and every encoder).
        rank: this process's global rank.
        microbatches: the global microbatches' samples.
        llm_split: per microbatch, per LLM DP replica, its sample positions (each non-empty).
        encoder_split: encoder -> per microbatch, per encoder DP replica, its sample positions.
        n_sub: encoder -> sub-microbatches per microbatch (default 1; the schedule's ``n_sub``).
        sub_runs: (encoder, encoder replica, microbatch) -> the item runs ``[a, b)`` of its
            sub-microbatches (`IterationWork.sub_runs`); where absent, ``n_sub`` runs even by count.
        llm_cp: with LLM ``cp > 1``: per microbatch, per LLM DP replica, the CP rank of every token of
            its packed sequence (any assignment); None = `cp_token_ranks` (balanced, unit costs).
        encoder_cuts: encoder -> per microbatch, ``(encoder replica, position)`` -> the replica's
            share of a sample several replicas encode in parts (`IterationAssignment.encoder_cuts`).

    Raises:
        SampleError: a split does not hold every sample exactly once, an LLM replica gets none, or a
            CP assignment does not cover its replica's tokens.
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
        total += sum(_n_targets(s) for s in samples)
        replicas = [[samples[i] for i in replica] for replica in llm_split[m]]
        assign = _cp_assignment(llm.cp, replicas, None if llm_cp is None else llm_cp[m], m)
        if llm.holds(rank):
            d = llm.coords(rank)["dp"]
            # the LLM takes the encoders' outputs at each item's positions (through the boundary), never
            # the pixels or mel frames, which would otherwise go to its device with the batch
            out.llm.append(pack_samples(replicas[d], with_inputs=False))
            if assign is not None:
                out.llm_cp.append(torch.from_numpy(assign[d]))
        for e in encoders:
            items = [encoder_items(s, e) for s in samples]
            dst_assign = None if assign is None else [a[item_positions(r, e)] for a, r in zip(assign, replicas)]
            cuts = (encoder_cuts or {}).get(e)
            cuts = cuts[m] if cuts else {}
            if cuts:
                rows, src, dst = _boundary_units(items, encoder_split[e][m], cuts, llm_split[m])
                plan = plan_boundary(layouts[e], llm, rows, src, dst, dst_cp_assign=dst_assign)
            else:
                plan = plan_boundary(layouts[e], llm, [[n for _, n in its] for its in items],
                                     encoder_split[e][m], llm_split[m], dst_cp_assign=dst_assign)
            out.plans.setdefault(e, []).append(plan)
            if not layouts[e].holds(rank):
                continue
            replica = layouts[e].coords(rank)["dp"]
            mine = [slice_item(items[i][k][0], a, b) for i in encoder_split[e][m][replica]
                    for k, a, b in kept_parts(len(items[i]), cuts.get((replica, i)))]
            parts = (n_sub or {}).get(e, ())
            runs = (sub_runs or {}).get((e, replica, m)) or item_runs([1.0] * len(mine), parts[m] if parts else 1)
            media = [gather_media(mine[a:b]) for a, b in runs]
            if layouts[e].coords(rank)["pp"]:  # a later stage takes the activations, not the inputs
                media = [x if x is None else _without_inputs(x) for x in media]
            out.media.setdefault(e, []).append(media)
    out.n_targets = float(total)
    return out


def _without_inputs(media: MediaInputs) -> MediaInputs:
    """``media`` with no rows of encoder inputs (its slots, positions and grids kept)."""
    return replace(media, inputs=media.inputs.new_empty((0, *media.inputs.shape[1:])))


def _n_targets(sample: TokenizedSample) -> int:
    """Tokens with a label; a sample this rank did not decode (`harmonia.data.samples.SampleOutline`)
    carries the count."""
    return sample.n_targets if hasattr(sample, "n_targets") else int((sample.labels != -100).sum())


def _cp_assignment(cp: int, replicas: list[list[TokenizedSample]],
                   given: Sequence[np.ndarray | Sequence[int]] | None, m: int) -> list[np.ndarray] | None:
    """Per LLM replica, the ``(T,)`` CP rank of each token (None when ``cp == 1``)."""
    if cp == 1:
        return None
    if given is None:
        return [cp_token_ranks(r, cp) for r in replicas]
    if len(given) != len(replicas):
        raise SampleError(f"microbatch {m}: CP assignments for {len(given)} LLM replicas, expected {len(replicas)}")
    out = []
    for d, (a, r) in enumerate(zip(given, replicas)):
        a = np.asarray(a, dtype=np.int64)
        n = sum(len(s) for s in r)
        if a.shape != (n,) or a.min() < 0 or a.max() >= cp or np.unique(a).size != cp:
            raise SampleError(f"microbatch {m}, LLM replica {d}: the CP assignment must give each of its {n} "
                              f"tokens a CP rank in 0..{cp - 1}, every rank at least one (got shape {a.shape})")
        out.append(a)
    return out
