"""Which of a step's samples a rank decodes, and how the ranks agree on the ones that failed.

The balance of a step is computed on every rank from shapes alone (the shape index and cached
token counts), so every rank knows every sample's place before any is decoded. A rank then decodes
only the samples whose tensors it trains (`rank_positions`: its LLM replica's samples, and for each
encoder it runs, its encoder replica's samples with items of that encoder); the others enter its
batch as `harmonia.data.samples.SampleOutline`s, which give the batch builder the same token runs,
item encoders and loss-normalizer counts (`rank_samples`).

A sample can fail to decode after its header passed (corrupt pixel data): only its owner sees it.
`agree_failures` gathers every rank's failures on the data process group (a gloo group the trainer
builds), so every rank drops the same samples and balances again identically. The same collective
carries each rank's pending stop signal (`StepAgreement.stops`) and, where the trainer logs the step
before, each rank's figures of it (`StepAgreement.rows`: module times, memory): a step's one
agreement on the host, whatever the device, instead of one collective each for the data, the stop
and the metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from harmonia.data.loader import Failed, MultimodalDataset
from harmonia.data.samples import LoadedSample, SampleOutline
from harmonia.model.batch import TokenizedSample
from harmonia.model.spec import MLLMSpec
from harmonia.schedule.graph import LLM
from harmonia.schedule.iteration import IterationAssignment
from harmonia.schedule.layout import Layout
from harmonia.workload.shapes import SampleShape


def rank_positions(layouts: Mapping[str, Layout], rank: int, assignment: IterationAssignment,
                   shapes: Sequence[SampleShape], spec: MLLMSpec) -> list[int]:
    """Batch positions of the samples whose tensors ``rank`` trains, ascending.

    Args:
        layouts: module -> layout.
        rank: the global rank.
        assignment: the step's global microbatches and replicas (positions into ``shapes``).
        shapes: the step's sample shapes.
        spec: the model (which encoder takes which modality).
    """
    mine: set[int] = set()
    llm = layouts[LLM]
    for m, mb in enumerate(assignment.microbatches):
        if llm.holds(rank):
            mine.update(mb[i] for i in assignment.llm_split[m][llm.coords(rank)["dp"]])
        for e, split in assignment.encoder_split.items():
            if not layouts[e].holds(rank):
                continue
            for i in split[m][layouts[e].coords(rank)["dp"]]:
                if any(spec.encoder_for(item.modality) == e for item in shapes[mb[i]].items):
                    mine.add(mb[i])
    return sorted(mine)


def check_decoded(result: LoadedSample | Failed, shape: SampleShape, dataset: MultimodalDataset) -> LoadedSample | Failed:
    """A decoded sample whose shape differs from its header shape (the balance was computed with the
    header's) becomes a ``shape_mismatch`` failure."""
    if isinstance(result, Failed) or result.shape == shape:
        return result
    return Failed(result.index, "shape_mismatch",
                  f"{dataset.records[result.index].where}: decoding gave {result.shape} but the media headers "
                  f"gave {shape}; fix the file (its header disagrees with its data)",
                  dataset.records[result.index].where)


def rank_samples(assignment: IterationAssignment, ids: Sequence[int], shapes: Sequence[SampleShape],
                 decoded: Mapping[int, LoadedSample | Failed], mine: set[int],
                 dataset: MultimodalDataset) -> list[list[TokenizedSample | SampleOutline]]:
    """Per global microbatch, its samples as this rank's batch builder takes them: decoded where the
    rank trains them (positions ``mine``), outlines elsewhere."""

    def sample(p: int) -> TokenizedSample | SampleOutline:
        if p in mine:
            return decoded[ids[p]].tokens
        return dataset.outline(shapes[p])

    return [[sample(p) for p in mb] for mb in assignment.microbatches]


class StepAgreement(NamedTuple):
    """What every rank agreed on before a step: the same on every rank."""

    failed: list[Failed]
    """Every rank's decoding failures, by dataset index."""
    stops: dict[int, int]
    """Rank -> the stop signal it has pending, for ranks that have one."""
    rows: torch.Tensor | None = None
    """``(world, R)`` float64: every rank's ``row``, in rank order (None where none was passed)."""
    summed: torch.Tensor | None = None
    """``(E,)`` float64: every rank's ``extra`` summed (None where none was passed)."""


def agree_failures(failed: Sequence[Failed], group: dist.ProcessGroup | None, stop: int = 0,
                   row: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> StepAgreement:
    """Every rank's decoding failures of a step and pending stop signals, the same on every rank.

    Args:
        failed: this rank's failures.
        group: the data process group (gloo, every rank); None when there is one process.
        stop: this rank's pending stop signal (0 = none).
        row: this rank's ``(R,)`` figures to gather into `StepAgreement.rows` in the same collective
            (every rank passes one of the same length, or none does).
        extra: this rank's ``(E,)`` values to sum over the ranks into `StepAgreement.summed` in the
            same collective (e.g. the loss and squared norm shares of the step before; every rank
            passes one of the same length, or none does).
    """
    extra = None if extra is None else extra.to(torch.float64).reshape(-1)
    if group is None or dist.get_world_size(group) == 1:  # nothing to agree with
        rank = 0 if group is None else dist.get_global_rank(group, 0)
        rows = None if row is None else row.to(torch.float64).reshape(1, -1)
        return StepAgreement(_merged([list(failed)]), {rank: stop} if stop else {}, rows, extra)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    width = 0 if row is None else row.numel()
    end = 1 + world + world * width
    # [failures over all ranks, each rank's stop signal, each rank's row, the extra sums]: every rank
    # fills its own slots and the sum gathers them, exactly (a value plus zeros; counts are exact in
    # float64), and adds its extra values to everyone's
    summed = torch.zeros(end + (0 if extra is None else extra.numel()), dtype=torch.float64)
    summed[0], summed[1 + me] = len(failed), stop
    if row is not None:
        summed[1 + world + me * width:1 + world + (me + 1) * width] = row.reshape(-1)
    if extra is not None:
        summed[end:] = extra
    dist.all_reduce(summed, group=group)  # one small collective in the common case: nothing failed
    stops = {dist.get_global_rank(group, r): int(v) for r, v in enumerate(summed[1:1 + world].tolist()) if v}
    rows = None if row is None else summed[1 + world:end].view(world, width)
    total = None if extra is None else summed[end:]
    if not int(summed[0]):
        return StepAgreement([], stops, rows, total)
    everyone = [None] * world
    dist.all_gather_object(everyone, list(failed), group=group)
    return StepAgreement(_merged(everyone), stops, rows, total)


def _merged(everyone: list[list[Failed]]) -> list[Failed]:
    merged = {f.index: f for rank_failed in everyone for f in rank_failed}
    return [merged[i] for i in sorted(merged)]
