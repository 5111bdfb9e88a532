"""Per-module load of a sample: tokens through every layer and attended pairs under the mask.

The multimodal attention rule (one definition, shared with the model's mask and CP sharding):
a text token attends causally to every earlier token of its sample, items included; an item's
tokens attend to every token of their own item (bidirectional) and to every earlier token of the
sample; nothing attends across packed samples. Encoders attend bidirectionally within each of their
sequences (a tile, a frame, an audio chunk).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from harmonia.model.spec import MLLMSpec
from harmonia.workload.shapes import (
    SampleShape,
    encoder_sequences,
    llm_tokens_of_item,
    window_sequences,
    windowed_blocks,
)


@dataclass(frozen=True)
class ModuleLoad:
    """What one module does for a sample (or a set of samples).

    Attributes:
        tokens: tokens through each layer of the module.
        pairs: (query, key) pairs each attention layer computes under the mask.
        sequences: independent sequences (encoder tiles/chunks; 1 per sample for the LLM).
        window_pairs: pairs each sliding-window layer computes (`attended_pairs` with the
            window); None = as many as ``pairs``.
    """

    tokens: int = 0
    pairs: int = 0
    sequences: int = 0
    window_pairs: int | None = None

    def __add__(self, other: ModuleLoad) -> ModuleLoad:
        window = None
        if self.window_pairs is not None or other.window_pairs is not None:
            window = self.windowed_pairs + other.windowed_pairs
        return ModuleLoad(self.tokens + other.tokens, self.pairs + other.pairs, self.sequences + other.sequences,
                          window)

    @staticmethod
    def total(loads: Iterable[ModuleLoad]) -> ModuleLoad:
        """The sum of ``loads`` (as adding them one by one, without the loads in between)."""
        tokens = pairs = sequences = window = 0
        windowed = False
        for x in loads:
            tokens, pairs, sequences = tokens + x.tokens, pairs + x.pairs, sequences + x.sequences
            window += x.windowed_pairs
            windowed = windowed or x.window_pairs is not None
        return ModuleLoad(tokens, pairs, sequences, window if windowed else None)

    @property
    def windowed_pairs(self) -> int:
        """Pairs of a sliding-window layer."""
        return self.pairs if self.window_pairs is None else self.window_pairs


def llm_segments(sample: SampleShape, mllm: MLLMSpec) -> list[tuple[str, int]]:
    """The sample's LLM sequence as ``(kind, length)`` segments, kind ``text`` or ``item``, in order."""
    segments: list[tuple[str, int]] = []
    text_done = 0
    for item, offset in zip(sample.items, sample.offsets()):
        if offset > text_done:
            segments.append(("text", offset - text_done))
            text_done = offset
        encoder = mllm.encoders[mllm.encoder_for(item.modality)]
        segments.append(("item", llm_tokens_of_item(item, encoder)))
    if sample.text_tokens > text_done:
        segments.append(("text", sample.text_tokens - text_done))
    return segments


def _capped(m: int, window: int | None) -> int:
    """``sum_{j=1..m} min(j, window)``: keys of the first ``m`` text tokens of a sample."""
    w = m if window is None else min(m, window)
    return w * (w + 1) // 2 + (m - w) * w


def _dropped(m: int, window: int | None) -> int:
    """``sum_{p<m} max(0, p - window + 1)``: keys the window hides from the first ``m`` tokens."""
    t = 0 if window is None else max(0, m - window)
    return t * (t + 1) // 2


def attended_pairs(segments: list[tuple[str, int]], window: int | None = None) -> int:
    """Pairs computed by one attention layer over a sample's segments under the multimodal mask.

    A text token at position ``p`` attends ``p + 1`` keys, so a text run of ``n`` tokens starting at
    ``s`` attends ``n*s + n(n+1)/2``. An item of ``L`` tokens starting at ``s`` attends ``L * (s + L)``.

    With a sliding ``window`` (keys at ``p - k < window``, `harmonia.model.attention_mask`) a text
    token attends ``min(p + 1, window)`` keys: a run attends ``C(s + n) - C(s)`` with
    ``C(m) = sum_{j<=m} min(j, window)``. An item token at ``p`` loses the ``max(0, p - window + 1)``
    oldest keys: the item attends ``L * (s + L) - (D(s + L) - D(s))`` with ``D(m) = t(t+1)/2``,
    ``t = max(0, m - window)``. So attention work grows with ``min(sequence, window)``.
    """
    pairs, pos = 0, 0
    for kind, n in segments:
        if kind == "text":
            pairs += _capped(pos + n, window) - _capped(pos, window)
        else:
            pairs += n * (pos + n) - (_dropped(pos + n, window) - _dropped(pos, window))
        pos += n
    return pairs


def sample_loads(sample: SampleShape, mllm: MLLMSpec) -> dict[str, ModuleLoad]:
    """Per-module load of one sample, for every module of ``mllm`` (zero where it has no items)."""
    loads = {name: ModuleLoad() for name in mllm.module_names}
    for item in sample.items:
        enc_name = mllm.encoder_for(item.modality)
        enc = mllm.encoders[enc_name]
        seqs = encoder_sequences(item, enc)
        windows = sum(n * n for n in window_sequences(item, enc)) if windowed_blocks(enc) else None
        loads[enc_name] += ModuleLoad(sum(seqs), sum(n * n for n in seqs), len(seqs), windows)
        proj_tokens = llm_tokens_of_item(item, mllm.encoders[enc_name])
        loads[f"{enc_name}_proj"] += ModuleLoad(proj_tokens, 0, 1)
    segments = llm_segments(sample, mllm)
    if mllm.item_attention == "causal":  # items attend like text (LLaVA)
        segments = [("text", n) for _, n in segments]
    window = mllm.llm.body.sliding_window
    loads["llm"] = ModuleLoad(sum(n for _, n in segments), attended_pairs(segments), 1,
                              None if window is None else attended_pairs(segments, window))
    return loads


def load_arrays(samples: list[SampleShape], mllm: MLLMSpec) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and pairs of every sample for every module.

    A module with sliding-window or windowed layers (an LLM's, Qwen2.5-VL's tower's) gets the pairs
    averaged over its blocks (rounded), so that
    a whole-module cost from these arrays (`harmonia.workload.cost.CostModel.costs_from_loads`)
    prices every block with its own window.

    Returns:
        ``(tokens, pairs)``, each of shape ``(n_samples, n_modules)`` in ``mllm.module_names`` order.
    """
    names = mllm.module_names
    blocks = {"llm": (mllm.llm.body.n_layers, sum(mllm.llm.body.window_of(i) is not None
                                                   for i in range(mllm.llm.body.n_layers)))}
    blocks.update({name: (enc.body.n_layers, len(windowed_blocks(enc))) for name, enc in mllm.encoders.items()})
    tokens = np.zeros((len(samples), len(names)), dtype=np.int64)
    pairs = np.zeros((len(samples), len(names)), dtype=np.int64)
    for i, sample in enumerate(samples):
        loads = sample_loads(sample, mllm)
        for j, name in enumerate(names):
            load = loads[name]
            tokens[i, j] = load.tokens
            pairs[i, j] = load.pairs
            n, windowed = blocks.get(name, (0, 0))
            if windowed:
                pairs[i, j] = round(((n - windowed) * load.pairs + windowed * load.windowed_pairs) / n)
    return tokens, pairs


def llm_tokens(sample: SampleShape, mllm: MLLMSpec) -> int:
    """Length of the sample's LLM sequence (text plus item tokens)."""
    return sum(n for _, n in llm_segments(sample, mllm))
