"""Gradient reduction over data parallelism and global-norm clipping across ranks and modules.

Replicated data parallelism sums each stage chunk's gradients over its ``dp`` group in one flat
bucket, started as soon as the chunk's last backward of the iteration has run (the reduction
overlaps the rest of the schedule) and finished before clipping. The sum is right because every
microbatch's loss is already divided by the global target count. FSDP2 chunks reduce-scatter
instead, with the divide factor set to 1 by `apply_fsdp`: an LLM chunk inside its last (fused)
backward, block by block (`reduce_in_last_backward`), any other after its last backward
(`finish_fsdp_backward`); FSDP2 chunks that
reshard per microbatch (`start_fsdp_resharding`) reduce-scatter in every backward.

Tied embeddings split over pipeline stages (the first chunk's input embedding, the last chunk's
head) are two copies of one weight: after the ``dp``/``cp`` reduction `TiedGradSync` sums their
gradients between the two holders (Megatron-LM's embedding group), so both take the same step;
the norm counts the weight once (`TiedGradSync.uncounted`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from harmonia.model.dtensors import is_dtensor
from harmonia.model.llm import DecoderLM
from harmonia.schedule.layout import Layout


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as a plain tensor (this rank's shard of a DTensor).

    A DTensor gradient is first placed like its parameter: split backward (torch's
    ``stage_backward_weight``) can leave a vocab-sharded embedding's gradient replicated, and
    reductions pair this rank's shard with the same shard on other ranks.
    """
    g = p.grad
    if is_dtensor(g) and is_dtensor(p) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local() if is_dtensor(g) else g


@dataclass
class DPGradSync:
    """Asynchronous bucketed all-reduce (sum) of gradients over one ``dp`` group.

    Attributes:
        group: the ``dp`` process group.
    """

    group: dist.ProcessGroup
    _inflight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)

    def start(self, params: list[nn.Parameter]) -> None:
        """Launch the reduction of ``params``' gradients (missing gradients count as zeros)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_grad(p) for p in params]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._inflight.append((work, flat, grads))

    def finish(self) -> None:
        """Wait for every launched reduction and write the sums back into the gradients."""
        for work, flat, grads in self._inflight:
            work.wait()
            for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(summed)
        self._inflight.clear()


@dataclass
class TiedGradSync:
    """Sums the gradients of a tied embedding's copies on the LLM's first and last stage chunks.

    Attributes:
        weights: this rank's copies (one, or two when it holds both chunks).
        peer: global rank holding the other copy with this rank's ``dp``/``cp``/``tp``
            coordinates; None when this rank holds both.
        group: a process group containing both ranks.
        uncounted: the last chunk's copy, left out of the gradient norm.
    """

    weights: list[nn.Parameter]
    peer: int | None
    group: dist.ProcessGroup | None
    uncounted: list[nn.Parameter]

    def run(self) -> None:
        """Replace every copy's gradient by the sum over all copies (after the ``dp``/``cp`` reduction)."""
        for p in self.weights:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_grad(p) for p in self.weights]
        total = grads[0] + grads[1] if len(grads) == 2 else grads[0].clone()
        if self.peer is not None:
            other = torch.empty_like(total)  # both ends send and receive: one batch, so neither waits first
            ops = [dist.P2POp(dist.isend, total.contiguous(), self.peer, self.group),
                   dist.P2POp(dist.irecv, other, self.peer, self.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            total = total + other  # the same sum on both ranks (addition commutes exactly)
        for g in grads:
            g.copy_(total)


def plan_tied_sync(chunks: dict[int, nn.Module], layout: Layout, rank: int,
                   group: dist.ProcessGroup | None) -> TiedGradSync | None:
    """The tied-embedding sync of this rank's LLM chunks, or None when it holds no trainable copy.

    Both holders must agree: the copies train together (the same training mode on both chunks).
    """
    last = layout.n_stages - 1
    held = {c: w for c, m in chunks.items() if isinstance(m, DecoderLM)
            and (w := m.tied_weight()) is not None and w.requires_grad}
    if not held:
        return None
    peer = None
    if set(held) != {0, last}:
        me = layout.coords(rank)
        other = last if 0 in held else 0
        peer = layout.rank_at(pp=other % layout.pp, dp=me["dp"], cp=me["cp"], tp=me["tp"])
    uncounted = [held[last]] if last in held else []
    return TiedGradSync(list(held.values()), peer, group, uncounted)


def start_fsdp_backward(module: nn.Module) -> list:
    """Start gathering an FSDP2 chunk for the iteration; let it accumulate unsharded gradients.

    Parameters stay unsharded from the start of the iteration to its end: split backward (B now, W
    later) differentiates w.r.t. the parameters the forward used, which are the unsharded ones. The
    all-gathers are issued here, in module order, rather than in the first forward: an encoder
    replica may have no items in some microbatches (the executor skips those actions) or in the whole
    iteration, and the ``dp`` ranks must still meet in the same collectives at the same point. They
    run asynchronously: each block's pre-forward waits for its own gather (FSDP2's pending-unshard
    wait), so the first forward computes block ``i`` while the gathers of blocks ``i+1 ..`` are in
    flight. Returns the gathers' handles; `wait_fsdp_gathers` before reducing (a replica that runs
    no forward never waits in one).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    module.set_reshard_after_forward(False)
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)
    fully_shard.state(module)._lazy_init()  # what the first forward would do
    return [sub.unshard(async_op=True) for sub in module.modules() if isinstance(sub, FSDPModule)]


def wait_fsdp_gathers(handles: list) -> None:
    """Wait for gathers `start_fsdp_backward` issued (idempotent: a forward may have waited already)."""
    for handle in handles:
        handle.wait()


def reduce_in_last_backward(module: nn.Module) -> None:
    """Let an FSDP2 chunk's next backward, its last of the iteration, reduce-scatter its gradients
    as FSDP2 does by default: each block's accumulated gradient (every microbatch's, summed in place
    as before) is reduce-scattered as soon as that block's backward is done, overlapping the blocks
    still to run, and the chunk's root group's at the end of that backward (FSDP2's final callback).
    Every ``dp`` rank must run the chunk's backwards alike (LLM replicas do under fused backward);
    the chunk then needs no `finish_fsdp_backward`."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)


def start_fsdp_resharding(module: nn.Module) -> None:
    """Let an FSDP2 chunk run as FSDP2 trains by default (ZeRO-3) for the iteration: every block
    gathers its weights before each forward and backward and frees them after; every backward
    reduce-scatters its gradients, which accumulate as shards over the microbatches.

    Every ``dp`` rank of the chunk must run the same forwards and backwards in the same order (the
    gathers and reduce-scatters are collectives over ``dp``): LLM replicas do, under schedules with
    fused backward (`harmonia.schedule.plan.Plan` refuses the rest). The root is resharded after
    forward too (FSDP2 keeps a root's weights by default), so between units only shards stay.
    """
    module.set_reshard_after_forward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    module.set_is_last_backward(True)


def finish_fsdp_backward(module: nn.Module) -> None:
    """Reduce-scatter an FSDP2 chunk's accumulated gradients (as torch.distributed.pipelining does).

    The executor calls autograd itself (``torch.autograd.grad`` for split backward), so FSDP's
    end-of-backward callback never fires on its own; this runs it after the chunk's last backward.
    """
    from torch.distributed.fsdp import fully_shard

    for p in module.parameters():  # the unsharded parameters (`start_fsdp_backward`)
        if p.requires_grad and p.grad is None:  # a replica that ran no backward reduces zeros
            p.grad = torch.zeros_like(p)
    module.set_is_last_backward(True)
    module.set_reshard_after_forward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)
    for sub in state._state_ctx.all_states:
        for group in sub._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def squared_norm_share(params: list[nn.Parameter], replication: int) -> torch.Tensor:
    """This rank's share of the squared gradient norm, so that a SUM over all ranks gives the total.

    A gradient is held by ``replication`` ranks (``dp * cp * tp`` of its stage); a DTensor shards it
    over the mesh axes whose placement is not ``Replicate`` (``Shard``, FSDP+TP's ``_StridedShard``),
    so each shard is held ``replication / shards``
    times and weighs ``shards / replication``.
    """
    by_weight: dict[tuple[float, torch.device], list[torch.Tensor]] = {}  # (weight, device) -> local grads
    for p in params:
        g = local_grad(p)
        if g is None or g.numel() == 0:
            continue
        shards = 1
        if is_dtensor(p.grad):
            mesh = p.grad.device_mesh
            shards = math.prod(mesh.size(i) for i, pl in enumerate(p.grad.placements) if not pl.is_replicate())
        by_weight.setdefault((shards / replication, g.device), []).append(g.detach())
    total = torch.zeros((), dtype=torch.float64)
    for (weight, _), grads in by_weight.items():  # one fused norm per group, one host copy
        norms = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64))
        total += norms.pow(2).sum().cpu() * weight
    return total


def clip_grad_norm(shares: torch.Tensor, params: list[nn.Parameter], max_norm: float | None,
                   group: dist.ProcessGroup | None) -> float:
    """Global gradient norm over ``group`` from every rank's share; scale gradients to ``max_norm``.

    Uses torch.nn.utils.clip_grad_norm_'s rule: ``coef = min(1, max_norm / (norm + 1e-6))``.

    Args:
        shares: this rank's `squared_norm_share` (summed over its modules).
        params: this rank's parameters to scale.
        max_norm: None = report the norm only.
        group: every rank holding parameters of any module being clipped together.

    Returns:
        The global norm before clipping.
    """
    total = shares.clone()
    dist.all_reduce(total, group=group)
    norm = float(total.sqrt())
    _clip(params, max_norm, norm)
    return norm


def reduce_loss_and_clip(loss_share: torch.Tensor, shares: torch.Tensor, params: list[nn.Parameter],
                         max_norm: float | None, group: dist.ProcessGroup | None) -> tuple[float, float]:
    """The step's global loss (``loss_share``: this rank's, `MLLMExecutor.loss_share`) and
    `clip_grad_norm`, reduced in one collective on the host instead of two: ``(loss, norm)``, the
    same floats as reducing each alone (a float64 square root of the same sum)."""
    return LossAndNorm.start(loss_share, shares, group).clip(params, max_norm)


@dataclass
class LossAndNorm:
    """`reduce_loss_and_clip` in two halves: `start` launches the collective, `clip` waits for it
    and clips, so the host can do other work (the next step's preparation) while it is in flight."""

    total: torch.Tensor  # (2,) float64 on the host: [loss, squared norm], summed over the group once done
    work: dist.Work | None  # the collective in flight; None for a one-rank group

    @staticmethod
    def local(loss_share: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:
        """``(2,)`` float64 on the host: this rank's [loss share, squared norm share]."""
        return torch.stack([loss_share.to("cpu", torch.float64), shares.detach().to("cpu", torch.float64)])

    @staticmethod
    def start(loss_share: torch.Tensor, shares: torch.Tensor, group: dist.ProcessGroup | None) -> LossAndNorm:
        total = LossAndNorm.local(loss_share, shares)
        if dist.get_world_size(group) == 1:  # a one-rank group has nothing to add
            return LossAndNorm(total, None)
        return LossAndNorm(total, dist.all_reduce(total, group=group, async_op=True))

    def clip(self, params: list[nn.Parameter], max_norm: float | None) -> tuple[float, float]:
        """``(loss, norm)`` once the collective is done; the gradients scaled to ``max_norm``."""
        if self.work is not None:
            self.work.wait()
        loss, squared = self.total.tolist()
        norm = math.sqrt(squared)
        _clip(params, max_norm, norm)
        return loss, norm


def _clip(params: list[nn.Parameter], max_norm: float | None, norm: float) -> None:
    """Scale the gradients by ``min(1, max_norm / (norm + 1e-6))``."""
    if max_norm is not None:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            grads = [g for g in map(local_grad, (p for p in params if p.grad is not None)) if g.numel()]
            for device in {g.device for g in grads}:
                torch._foreach_mul_([g for g in grads if g.device == device], coef)
