"""The multimodal attention rule: one definition for the model, CP sharding and the cost model.

A packed LLM sequence holds several samples one after another; each sample is a run of segments,
each segment a text run or one modality item's tokens. For a query token ``q`` and a key token ``k``:

- nothing attends across packed samples: ``sample[q] == sample[k]`` is required;
- a text token attends causally: every ``k`` of its sample with ``position[k] <= position[q]``,
  earlier items' tokens included;
- an item's tokens attend to every token of their own item (bidirectional) and causally to the
  earlier tokens of the sample.

Written with positions rather than indices, the rule holds for any subset or reordering of tokens,
which is what a context-parallel shard (a zig-zag slice of queries against all keys) needs.
`harmonia.workload.work.attended_pairs` counts the same pairs in closed form; a unit test checks both.

A sliding-window layer (Mistral, Qwen2) further requires ``position[q] - position[k] < window``,
transformers' rule (``kv_idx > q_idx - sliding_window``): a text token sees itself and the
``window - 1`` tokens before it. The limit applies to items' tokens too; keys later than the query
(an item's own tokens) are always within it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harmonia.errors import SampleError

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class TokenLayout:
    """Per-token description of a packed sequence; every field is ``(T,)``.

    Attributes:
        sample: index of the packed sample a token belongs to.
        segment: index of the token's segment (text run or item), unique within the pack.
        is_item: True for modality-item tokens (placeholders replaced by encoder output) that attend
            to their whole item; False for text and for items of a model whose items attend causally.
        position: position of the token within its sample (also the rotary position).
    """

    sample: torch.Tensor
    segment: torch.Tensor
    is_item: torch.Tensor
    position: torch.Tensor

    def __len__(self) -> int:
        return int(self.sample.numel())

    @staticmethod
    def from_segments(samples: list[list[tuple[str, int]]], causal_items: bool = False) -> TokenLayout:
        """Layout of samples packed in order, each a list of ``(kind, length)``, kind ``text``/``item``.

        This is the same segment description as `harmonia.workload.work.llm_segments` returns. With
        ``causal_items`` (LLaVA), items' tokens attend causally like text (``is_item`` stays False).
        """
        seg_sample, seg_item, seg_length, seg_first = [], [], [], []  # per non-empty segment
        at = 0
        for s, segments in enumerate(samples):
            first = at  # the sample's first token
            for kind, n in segments:
                if kind not in ("text", "item"):
                    raise SampleError(f"segment kind {kind!r} of sample {s} is invalid: expected 'text' or 'item'")
                if n <= 0:
                    continue
                seg_sample.append(s)
                seg_item.append(kind == "item" and not causal_items)
                seg_length.append(n)
                seg_first.append(first)
                at += n
        lengths = np.array(seg_length, dtype=np.int64)  # (S,); numpy: a few microseconds a call, not tens

        def per_token(values: list, dtype) -> torch.Tensor:  # (S,) -> (T,)
            return torch.from_numpy(np.repeat(np.array(values, dtype=dtype), lengths))

        first = np.repeat(np.array(seg_first, dtype=np.int64), lengths)  # (T,) its sample's first token
        return TokenLayout(per_token(seg_sample, np.int64), per_token(range(len(seg_length)), np.int64),
                           per_token(seg_item, np.bool_), torch.from_numpy(np.arange(at, dtype=np.int64) - first))

    def select(self, index: torch.Tensor | slice) -> TokenLayout:
        """The layout of a subset of tokens (a CP shard, a block)."""
        return TokenLayout(self.sample[index], self.segment[index], self.is_item[index], self.position[index])


def window_mask(q_position: torch.Tensor, k_position: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean ``(..., Tq, Tk)``: True where key ``j`` lies less than ``window`` positions before query ``i``.

    Args:
        q_position: ``(..., Tq)`` positions of the queries.
        k_position: ``(..., Tk)`` positions of the keys.
        window: the sliding window (transformers' ``sliding_window``).
    """
    return q_position[..., :, None] - k_position[..., None, :] < window


def multimodal_mask(q: TokenLayout, k: TokenLayout | None = None, window: int | None = None) -> torch.Tensor:
    """Boolean mask ``(Tq, Tk)``, True where query ``i`` of ``q`` may attend key ``j`` of ``k``.

    Args:
        q: layout of the query tokens.
        k: layout of the key tokens; None = the same tokens as ``q``.
        window: sliding window of the layer (`window_mask`); None = none.
    """
    k = q if k is None else k
    same_sample = q.sample[:, None] == k.sample[None, :]
    causal = k.position[None, :] <= q.position[:, None]
    own_item = q.is_item[:, None] & (q.segment[:, None] == k.segment[None, :])
    mask = same_sample & (causal | own_item)
    return mask if window is None else mask & window_mask(q.position, k.position, window)


def block_mask_kinds(q: TokenLayout, k: TokenLayout | None = None, block: int = 128,
                     window: int | None = None) -> torch.Tensor:
    """Per tile of ``block x block`` (query, key) tokens: `EMPTY`, `PARTIAL` or `FULL`.

    Attention kernels skip empty tiles and drop the mask on full ones; the CP sharder uses the
    count of non-empty tiles as a shard's work. Computed one row of tiles at a time, so memory is
    ``block x Tk`` booleans. ``window``: that of a sliding-window layer (`multimodal_mask`).

    Returns:
        ``(ceil(Tq / block), ceil(Tk / block))`` int8 tensor.
    """
    k = q if k is None else k
    nq, nk = -(-len(q) // block), -(-len(k) // block)
    out = torch.empty(nq, nk, dtype=torch.int8)
    pad = nk * block - len(k)
    for i in range(nq):
        rows = multimodal_mask(q.select(slice(i * block, (i + 1) * block)), k, window)  # (bq, Tk)
        rows = torch.nn.functional.pad(rows, (0, pad))  # (bq, nk * block)
        tiles = rows.view(rows.shape[0], nk, block).transpose(0, 1).reshape(nk, -1)  # (nk, bq * block)
        counts = tiles.sum(-1)
        sizes = torch.full((nk,), rows.shape[0] * block, dtype=counts.dtype)
        if pad:
            sizes[-1] = rows.shape[0] * (block - pad)
        out[i] = torch.where(counts == 0, EMPTY, torch.where(counts == sizes, FULL, PARTIAL))
    return out


def count_pairs(q: TokenLayout, k: TokenLayout | None = None, block: int = 1024, window: int | None = None) -> int:
    """(query, key) pairs the mask allows: the work of one attention layer, as the cost model counts it."""
    k = q if k is None else k
    return sum(
        int(multimodal_mask(q.select(slice(i, i + block)), k, window).sum()) for i in range(0, len(q), block)
    )
