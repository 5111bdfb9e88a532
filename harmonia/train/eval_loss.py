"""The loss over an evaluation set while training (``train.eval_every``, ``data.eval_path``).

Every ``train.eval_every`` steps, and after the last, every rank runs the evaluation set's batches
through the training step's own machinery: the plan's layouts, the same balancing into microbatches,
the same schedule family, kernels and collectives, with every module in eval mode (no dropout) and
no optimizer update. A batch's loss is the step's (summed over its target tokens, divided by their
number); the evaluation loss weighs the batches by their target tokens, so it is the mean over every
target token of the ``n_batches x train.global_batch`` samples evaluated (the usable samples in a
fixed order, the remainder beyond whole batches left out and counted). Its schedules come from the
stage graph with nothing trained (`harmonia.train.rank.schedule_graph` ``forward_only``): forward
actions alone, run without autograd, so a batch costs about a third of a training step and keeps no
activation for a backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harmonia.errors import SampleError
from harmonia.train.iteration import IterationBuilder
from harmonia.train.rank import RankModel, to_device


@dataclass
class EvalResult:
    """One evaluation: the loss per target token, the batches and samples it read, and the target tokens."""

    loss: float
    batches: int
    samples: int
    targets: float


class EvalLoss:
    """The evaluation set's batches, prepared by their own `IterationBuilder` (same plan and cost
    model as training, order search off: evaluation has no step to hide it behind).

    Args:
        builder: prepares evaluation batch ``k`` (its `DataOrder` over the evaluation set: one fixed
            permutation, the same on every rank and run).
        n_batches: whole batches of the evaluation set.
        left_out: usable samples beyond those batches.
    """

    def __init__(self, builder: IterationBuilder, n_batches: int, left_out: int) -> None:
        self.builder, self.n_batches, self.left_out = builder, n_batches, left_out

    @staticmethod
    def batches_of(n_usable: int, global_batch: int, path: str) -> tuple[int, int]:
        """(whole batches, samples left over) of an evaluation set with ``n_usable`` samples.

        Raises:
            SampleError: where the set holds fewer usable samples than one batch.
        """
        if n_usable < global_batch:
            raise SampleError(f"the evaluation set {path} has {n_usable} usable samples, fewer than "
                              f"train.global_batch={global_batch}; give a larger one (data.eval_path)")
        return n_usable // global_batch, n_usable % global_batch

    def run(self, model: RankModel, device: torch.device) -> EvalResult:
        """Every evaluation batch through ``model``, forward only (collective over all ranks)."""
        ex = model.executor
        chunks = [c for r in ex.runners.values() for c in r.chunks.values()]
        modes = [c.training for c in chunks]
        loss_sum = targets = 0.0
        samples = 0
        try:
            for c in chunks:
                c.eval()
            for k in range(self.n_batches):
                it = self.builder.build(k)
                batch = it.batch if device.type == "cpu" else to_device(it.batch, device)
                loss = ex.forward_backward(it.schedule, batch)
                loss_sum += loss * batch.n_targets
                targets += batch.n_targets
                samples += len(it.sample_ids)
        finally:
            for c, training in zip(chunks, modes):
                c.train(training)
        return EvalResult(loss_sum / max(targets, 1.0), self.n_batches, samples, targets)

    def close(self) -> None:
        self.builder.close()
