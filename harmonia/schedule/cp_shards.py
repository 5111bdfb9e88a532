"""Context-parallel token shards for a packed multimodal sequence.

A microbatch's LLM input is one packed sequence of samples; under context parallelism (ring
attention) each CP rank holds some token blocks, runs the linear/MLP layers on its tokens, and
computes attention of its query blocks against every key block. A rank's cost is therefore

    token_cost * (its tokens)  +  tile_cost * (attention tiles its query blocks compute)

where a tile is a ``block x block`` (query, key) square that flash attention computes whenever
any pair in it is allowed by the mask (harmonia.workload.work: text is causal within its sample,
an item's tokens see their whole item and everything earlier in the sample, nothing crosses
samples). Cornstarch balances tile counts only; the linear term matters as much at long context.

For a token ``q`` the allowed keys form one interval ``[start of its sample, hi(q)]`` with
``hi(q) = q`` for text and the item's last token for item tokens. The intervals of a query block's
tokens overlap or touch, so the block's computed tiles are the key blocks from
``min start // block`` to ``max hi // block``: exact tile counts in O(tokens).

`plan_cp_shards` assigns blocks to ranks with equal block counts (even memory), largest first
onto the cheapest rank with room, then swaps blocks between the costliest rank and the others
while that lowers it; the same swaps also run from the uniform and zigzag splits and the best
result is kept, so it is never worse than either. `uniform_shards` (contiguous) and `zigzag_shards` (chunks ``r`` and
``2cp-1-r``) are the usual splits, for comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.model.spec import TransformerSpec

Segments = Sequence[tuple[str, int]]


@dataclass(frozen=True)
class CPShards:
    """Token blocks of one packed sequence per CP rank.

    Attributes:
        block: tokens per block (the last block may be shorter).
        n_tokens: tokens of the packed sequence.
        rank_blocks: per rank, its block indices, ascending.
        rank_costs: (cp,) cost of each rank (``token_cost`` units).
    """

    block: int
    n_tokens: int
    rank_blocks: list[np.ndarray]
    rank_costs: np.ndarray

    @property
    def cp(self) -> int:
        return len(self.rank_blocks)

    @property
    def imbalance(self) -> float:
        """Largest rank cost over the mean: 1.0 is perfect."""
        mean = self.rank_costs.mean()
        return float(self.rank_costs.max() / mean) if mean > 0 else 1.0

    def rank_tokens(self, rank: int) -> np.ndarray:
        """Token positions rank ``rank`` holds, ascending."""
        blocks = self.rank_blocks[rank]
        if blocks.size == 0:
            return np.zeros(0, dtype=np.int64)
        pos = (blocks[:, None] * self.block + np.arange(self.block)[None, :]).reshape(-1)
        return pos[pos < self.n_tokens]

    def token_ranks(self) -> np.ndarray:
        """(n_tokens,) the rank holding every token."""
        out = np.full(self.n_tokens, -1, dtype=np.int64)
        for r in range(self.cp):
            out[self.rank_tokens(r)] = r
        return out


def key_intervals(samples: Sequence[Segments]) -> tuple[np.ndarray, np.ndarray]:
    """Per token of the packed sequence, its allowed key interval ``[lo, hi]`` under the mask.

    Args:
        samples: per packed sample, its ``(kind, length)`` LLM segments (`llm_segments`),
            kind ``text`` or ``item``.
    """
    lo, hi, pos = [], [], 0
    for segments in samples:
        start = pos
        for kind, n in segments:
            if n < 0 or kind not in ("text", "item"):
                raise ScheduleError(f"segment ({kind!r}, {n}): kind must be 'text' or 'item', length >= 0")
            lo.append(np.full(n, start, dtype=np.int64))
            hi.append(np.arange(pos, pos + n, dtype=np.int64) if kind == "text"
                      else np.full(n, pos + n - 1, dtype=np.int64))
            pos += n
    if pos == 0:
        raise ScheduleError("the packed sequence is empty; pass at least one segment with tokens")
    return np.concatenate(lo), np.concatenate(hi)


def block_costs(samples: Sequence[Segments], block: int = 128, *, token_cost: float = 1.0,
                tile_cost: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Cost of every token block of the packed sequence.

    Returns:
        ``(costs, tiles)``: (n_blocks,) ``token_cost * tokens + tile_cost * tiles`` and the
        attention tiles each query block computes.
    """
    if block < 1:
        raise ScheduleError(f"block must be a positive token count, got {block}")
    lo, hi = key_intervals(samples)
    n = lo.shape[0]
    n_blocks = -(-n // block)
    starts = np.arange(n_blocks) * block
    first = np.minimum.reduceat(lo, starts) // block
    last = np.maximum.reduceat(hi, starts) // block
    tiles = last - first + 1
    tokens = np.minimum(starts + block, n) - starts
    return token_cost * tokens + tile_cost * tiles, tiles


def attention_unit_costs(body: TransformerSpec, block: int = 128) -> tuple[float, float]:
    """Forward FLOPs per layer of one token's linear/MLP work and of one attention tile.

    Token: ``2 * (h * (h + 2 * kv) + h * h + n_mlp * h * f)`` (QKV, output and MLP matmuls,
    2 FLOPs per multiply-add). Tile: ``4 * block^2 * heads * head_dim`` (``Q K^T`` and ``P V``).
    Backward scales both by the same factor, so the ratio holds for F+B+W.
    """
    head_dim = body.head_dim or body.hidden // body.n_heads
    kv = (body.n_kv_heads or body.n_heads) * head_dim
    n_mlp = 3 if body.mlp == "swiglu" else 2
    token = 2.0 * (body.hidden * (body.n_heads * head_dim + 2 * kv) + body.n_heads * head_dim * body.hidden
                   + n_mlp * body.hidden * body.ffn_hidden)
    tile = 4.0 * block * block * body.n_heads * head_dim
    return token, tile


def _shards(costs: np.ndarray, rank_of: np.ndarray, cp: int, block: int, n_tokens: int) -> CPShards:
    rank_blocks = [np.flatnonzero(rank_of == r) for r in range(cp)]
    return CPShards(block, n_tokens, rank_blocks, np.bincount(rank_of, costs, minlength=cp))


def _check(cp: int, n_blocks: int) -> None:
    if cp < 1:
        raise ScheduleError(f"cp must be at least 1, got {cp}")
    if n_blocks < cp:
        raise ScheduleError(
            f"{n_blocks} token blocks cannot feed {cp} CP ranks; use a smaller block or fewer CP ranks"
        )


def uniform_shards(samples: Sequence[Segments], cp: int, *, block: int = 128, token_cost: float = 1.0,
                   tile_cost: float = 1.0) -> CPShards:
    """Contiguous equal runs of blocks, rank ``r`` the ``r``-th run."""
    costs, _ = block_costs(samples, block, token_cost=token_cost, tile_cost=tile_cost)
    _check(cp, costs.size)
    rank_of = np.repeat(np.arange(cp), [len(c) for c in np.array_split(np.arange(costs.size), cp)])
    return _shards(costs, rank_of, cp, block, int(sum(n for s in samples for _, n in s)))


def zigzag_shards(samples: Sequence[Segments], cp: int, *, block: int = 128, token_cost: float = 1.0,
                  tile_cost: float = 1.0) -> CPShards:
    """``2 cp`` contiguous runs of blocks, rank ``r`` runs ``r`` and ``2 cp - 1 - r`` (load-balanced
    causal ring attention, as in Megatron-LM and Llama 3)."""
    costs, _ = block_costs(samples, block, token_cost=token_cost, tile_cost=tile_cost)
    _check(2 * cp, costs.size)
    chunk = np.repeat(np.arange(2 * cp), [len(c) for c in np.array_split(np.arange(costs.size), 2 * cp)])
    rank_of = np.minimum(chunk, 2 * cp - 1 - chunk)
    return _shards(costs, rank_of, cp, block, int(sum(n for s in samples for _, n in s)))


def _swap_down(costs: np.ndarray, rank_of: np.ndarray, cp: int, max_steps: int) -> None:
    """Swap one block of the costliest rank with one block of another while that lowers the pair's
    larger cost (block counts stay equal); in place."""
    loads = np.bincount(rank_of, costs, minlength=cp)
    for _ in range(max_steps):
        a = int(loads.argmax())
        mine, theirs = np.flatnonzero(rank_of == a), np.flatnonzero(rank_of != a)
        if mine.size == 0 or theirs.size == 0:
            return
        delta = costs[mine][:, None] - costs[theirs][None, :]  # what a gives minus what it gets
        worst = np.maximum(loads[a] - delta, loads[rank_of[theirs]][None, :] + delta)
        i, j = np.unravel_index(int(worst.argmin()), worst.shape)
        if not worst[i, j] < loads[a] - 1e-12 * max(1.0, loads[a]):
            return
        x, y, b = mine[i], theirs[j], rank_of[theirs[j]]
        rank_of[x], rank_of[y] = b, a
        loads[a] -= delta[i, j]
        loads[b] += delta[i, j]


def plan_cp_shards(samples: Sequence[Segments], cp: int, *, block: int = 128, token_cost: float = 1.0,
                   tile_cost: float = 1.0) -> CPShards:
    """Token blocks per CP rank minimising the largest rank cost under the multimodal mask.

    Args:
        samples: the packed samples' ``(kind, length)`` LLM segments, in sequence order.
        cp: CP ranks.
        block: tokens per block (the attention kernel's tile edge).
        token_cost: cost of one token's linear/MLP work (see `attention_unit_costs`).
        tile_cost: cost of one ``block x block`` attention tile.

    Returns:
        The shards; every token on exactly one rank, block counts differing by at most one.
    """
    costs, _ = block_costs(samples, block, token_cost=token_cost, tile_cost=tile_cost)
    n_blocks = costs.size
    _check(cp, n_blocks)
    room = np.array([len(c) for c in np.array_split(np.arange(n_blocks), cp)])
    loads = np.zeros(cp)
    lpt = np.empty(n_blocks, dtype=np.int64)
    for b in np.argsort(-costs, kind="stable"):
        r = int(np.argmin(np.where(room > 0, loads, np.inf)))
        lpt[b] = r
        loads[r] += costs[b]
        room[r] -= 1
    split = [len(c) for c in np.array_split(np.arange(n_blocks), cp)]
    starts = [lpt, np.repeat(np.arange(cp), split)]
    if n_blocks >= 2 * cp:
        chunk = np.repeat(np.arange(2 * cp), [len(c) for c in np.array_split(np.arange(n_blocks), 2 * cp)])
        zigzag = np.minimum(chunk, 2 * cp - 1 - chunk)
        if np.ptp(np.bincount(zigzag, minlength=cp)) <= 1:  # keep block counts within one
            starts.append(zigzag)
    best = None
    for rank_of in starts:  # LPT, and the uniform and zigzag splits: never worse than either
        _swap_down(costs, rank_of, cp, 4 * n_blocks)
        peak = np.bincount(rank_of, costs, minlength=cp).max()
        if best is None or peak < best[0] - 1e-12:
            best = (peak, rank_of)
    return _shards(costs, best[1], cp, block, int(sum(n for s in samples for _, n in s)))
