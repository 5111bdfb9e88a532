"""Context parallelism of the LLM: any token-to-rank assignment, keys and values all-gathered.

Each CP rank of an LLM stage holds some tokens of every microbatch: the balancer's assignment
(`harmonia.schedule.cp_shards.plan_cp_shards`) or any other, contiguous or not. Embedding, norms,
MLPs, the head and the loss are token-wise and run on the rank's own tokens; rotary embedding uses
each token's own position. Attention computes queries, keys and values of the local tokens, then
all-gathers keys and values over the ``cp`` group (`gather_tokens`; backward: reduce-scatter, the
gradient of every rank's keys summed back onto the rank that owns them) and attends the local
queries against them with the microbatch's kernel (`harmonia.model.attention.PackedAttention`:
the multimodal rule per query block and its key range, never a ``(t, T)`` mask).

Keys are gathered in rank order, each rank's tokens ascending (the "gathered order"), and put back
in sequence order by one row gather (``key_order``). Ranks may hold different token counts: the
gather pads to the largest count (gloo takes no uneven all-gather) and trims.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from harmonia.errors import SampleError
from harmonia.model.attention import PackedAttention, on_host
from harmonia.model.attention_backend import choose_backend, mask_kind
from harmonia.model.batch import PackedBatch

# The newer names where torch has them (2.13; the older ones are deprecated there, and 2.11 has only
# those); same arguments.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    """All-gather rows (dim 0) over a group in rank order; backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, counts: tuple[int, ...]) -> torch.Tensor:
        ctx.group, ctx.counts = group, counts
        width, n = max(counts), len(counts)
        if x.shape[0] < width:
            x = torch.cat([x, x.new_zeros(width - x.shape[0], *x.shape[1:])])  # (width, *F)
        out = x.new_empty(n * width, *x.shape[1:])  # (cp * width, *F)
        all_gather_flat(out, x.contiguous(), group=group)
        if all(c == width for c in counts):
            return out
        return torch.cat([out[r * width:r * width + c] for r, c in enumerate(counts)])  # (T, *F)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        counts, width = ctx.counts, max(ctx.counts)
        parts = grad.contiguous().split(list(counts))
        padded = torch.cat([p if p.shape[0] == width else
                            torch.cat([p, p.new_zeros(width - p.shape[0], *p.shape[1:])]) for p in parts])
        out = grad.new_empty(width, *grad.shape[1:])  # (width, *F)
        _reduce_scatter(out, padded, op=dist.ReduceOp.SUM, group=ctx.group)
        return out[:counts[dist.get_rank(ctx.group)]], None, None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup, counts: tuple[int, ...]) -> torch.Tensor:
    """Every rank's rows of ``x`` along dim 0, in rank order; differentiable.

    Args:
        x: ``(counts[r], *F)`` on group rank ``r``.
        group: the ``cp`` group.
        counts: rows of every group rank.

    Returns:
        ``(sum(counts), *F)``. Its gradient reaches each rank's ``x`` summed over all ranks.
    """
    return _GatherTokens.apply(x, group, counts)


@dataclass(frozen=True)
class CPShard:
    """One CP rank's part of a packed microbatch.

    Planned on the host from the CPU's assignment and layout (`harmonia.model.batch.HOST`); what the
    kernels take is copied to the device without waiting, so building a shard reads nothing back.

    Attributes:
        tokens: ``(t,)`` positions in the packed sequence this rank holds, ascending (on the device).
        positions: ``(1, t)`` rotary positions of those tokens (``(3, 1, t)`` under multimodal RoPE:
            all three rows sliced with the tokens).
        attention: the local queries' attention against every key, with the key/value gather.
        local_of: ``(T,)`` index of each token among this rank's tokens (-1: another rank's), on the CPU.
        token_ranks: ``(T,)`` CP rank of each token, on the CPU.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    attention: PackedAttention
    local_of: torch.Tensor
    token_ranks: torch.Tensor

    def item_rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of an encoder's item rows (sequence positions ``index``, best on the CPU:
        `harmonia.model.batch.MediaInputs.host_index`) are local, and where they go.

        Returns:
            ``(mine, local_index)``: ``(n,)`` boolean over the rows (on the CPU), and the local
            sequence index of each local row, in row order, on the device of ``tokens`` (the boundary
            delivers exactly those rows, in that order).
        """
        local = self.local_of[on_host(index)]  # (n,)
        mine = local >= 0
        return mine, local[mine].to(self.tokens.device, non_blocking=True)


def build_cp_shard(mb: PackedBatch, token_ranks: torch.Tensor, rank: int, group: dist.ProcessGroup,
                   cp: int, backend: str = "auto", head_dim: int | None = None) -> CPShard:
    """The shard of microbatch ``mb`` that CP rank ``rank`` holds under the assignment ``token_ranks``.

    Args:
        mb: this DP replica's packed microbatch (whole sequence).
        token_ranks: ``(T,)`` CP rank of every token (best on the CPU: `RankBatch.llm_cp` is kept there).
        rank: this rank's ``cp`` coordinate.
        group: the ``cp`` group.
        cp: CP ranks.
        backend: the attention kernel (`harmonia.model.attention_backend.choose_backend`).
        head_dim: the LLM's channels per head (`choose_backend`).

    Raises:
        SampleError: the assignment does not cover the sequence or leaves a CP rank without tokens.
    """
    device = mb.input_ids.device
    token_ranks = on_host(token_ranks).long()
    if token_ranks.shape != (mb.n_tokens,) or token_ranks.min() < 0 or token_ranks.max() >= cp:
        raise SampleError(f"CP assignment of shape {tuple(token_ranks.shape)} must give each of the "
                          f"microbatch's {mb.n_tokens} tokens a CP rank in 0..{cp - 1}")
    counts = torch.bincount(token_ranks, minlength=cp)
    if bool((counts == 0).any()):
        raise SampleError(f"CP assignment leaves CP ranks {counts.eq(0).nonzero().flatten().tolist()} without "
                          "tokens; give every CP rank at least one token of each microbatch")
    tokens = (token_ranks == rank).nonzero().flatten()  # (t,)
    order = torch.argsort(token_ranks, stable=True)  # (T,) gathered key order: rank by rank, ascending
    local_of = torch.full((mb.n_tokens,), -1, dtype=torch.long)
    local_of[tokens] = torch.arange(tokens.numel())
    gather = partial(gather_tokens, group=group, counts=tuple(counts.tolist()))
    layout = mb.plan_layout
    kernel = choose_backend(backend, device, mask_kind(layout), head_dim)
    attention = PackedAttention(layout, query_index=tokens, backend=kernel, gather=gather, key_order=order,
                                device=device)
    on_device = tokens.to(device, non_blocking=True)
    return CPShard(on_device, mb.positions()[..., on_device], attention, local_of, token_ranks)
