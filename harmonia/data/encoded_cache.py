"""Each sample's tokens kept in memory after its first decode, so a later epoch neither renders its
chat template nor tokenizes it again.

Rendering and tokenizing a conversation with an HF chat template takes about 0.6 ms (the template
is rendered once, and twice more per assistant turn to find the learned spans): on the tiny LLaVA's
samples, about half of decoding one. The tokens of a sample depend only on its conversation, its
items' LLM token counts and the tokenizer, all fixed for a run, so `EncodedCache` keys them by
dataset index and item token counts. Entries are compact (int32 ids, one byte per target flag) and
the cache stops taking new ones at `ENCODED_CACHE_BYTES`, a bound small beside any rank's memory
(64 MiB: about 13 M tokens).
"""

from __future__ import annotations

import numpy as np

from harmonia.data.tokenizer import Encoded

ENCODED_CACHE_BYTES = 64 * 2**20


class EncodedCache:
    """Tokens of decoded samples, by ``(dataset index, item token counts)``, up to ``limit`` bytes."""

    def __init__(self, limit: int = ENCODED_CACHE_BYTES) -> None:
        self.limit, self.bytes = limit, 0
        self._entries: dict[tuple, tuple[np.ndarray, np.ndarray, tuple]] = {}

    def get(self, index: int, lengths: list[int]) -> Encoded | None:
        entry = self._entries.get((index, tuple(lengths)))
        if entry is None:
            return None
        ids, targets, items = entry
        return Encoded(ids.tolist(), targets.tolist(), [tuple(r) for r in items])

    def put(self, index: int, lengths: list[int], enc: Encoded) -> None:
        ids = np.asarray(enc.ids, dtype=np.int32)  # an id past int32 raises OverflowError, never wraps
        targets = np.asarray(enc.targets, dtype=bool)
        size = ids.nbytes + targets.nbytes
        if self.bytes + size > self.limit:
            return
        self._entries[(index, tuple(lengths))] = (ids, targets, tuple(map(tuple, enc.items)))
        self.bytes += size

    def __len__(self) -> int:
        return len(self._entries)
