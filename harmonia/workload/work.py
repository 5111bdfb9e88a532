"""Per-module load of a sample: tokens through every layer and attended pairs under the mask.

The multimodal attention rule (one definition, shared with the model's mask and CP sharding):
a text token attends causally to every earlier token of its sample, items included; an item's
tokens attend to every token of their own item (bidirectional) and to every earlier token of the
sample; nothing attends across packed samples. Encoders attend bidirectionally within each of their
sequences (a tile, a frame, an audio chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harmonia.model.spec import MLLMSpec
from harmonia.workload.shapes import SampleShape, encoder_sequences, llm_tokens_of_item


@dataclass(frozen=True)
class ModuleLoad:
    """What one module does for a sample (or a set of samples).

    Attributes:
        tokens: tokens through each layer of the module.
        pairs: (query, key) pairs each attention layer computes under the mask.
        sequences: independent sequences (encoder tiles/chunks; 1 per sample for the LLM).
    """

    tokens: int = 0
    pairs: int = 0
    sequences: int = 0

    def __add__(self, other: ModuleLoad) -> ModuleLoad:
        return ModuleLoad(self.tokens + other.tokens, self.pairs + other.pairs, self.sequences + other.sequences)


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


def attended_pairs(segments: list[tuple[str, int]]) -> int:
    """Pairs computed by one attention layer over a sample's segments under the multimodal mask.

    A text token at position ``p`` attends ``p + 1`` keys, so a text run of ``n`` tokens starting at
    ``s`` attends ``n*s + n(n+1)/2``. An item of ``L`` tokens starting at ``s`` attends ``L * (s + L)``.
    """
    pairs, pos = 0, 0
    for kind, n in segments:
        if kind == "text":
            pairs += n * pos + n * (n + 1) // 2
        else:
            pairs += n * (pos + n)
        pos += n
    return pairs


def sample_loads(sample: SampleShape, mllm: MLLMSpec) -> dict[str, ModuleLoad]:
    """Per-module load of one sample, for every module of ``mllm`` (zero where it has no items)."""
    loads = {name: ModuleLoad() for name in mllm.module_names}
    for item in sample.items:
        enc_name = mllm.encoder_for(item.modality)
        seqs = encoder_sequences(item, mllm.encoders[enc_name])
        loads[enc_name] += ModuleLoad(sum(seqs), sum(n * n for n in seqs), len(seqs))
        proj_tokens = llm_tokens_of_item(item, mllm.encoders[enc_name])
        loads[f"{enc_name}_proj"] += ModuleLoad(proj_tokens, 0, 1)
    segments = llm_segments(sample, mllm)
    loads["llm"] = ModuleLoad(sum(n for _, n in segments), attended_pairs(segments), 1)
    return loads


def load_arrays(samples: list[SampleShape], mllm: MLLMSpec) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and pairs of every sample for every module.

    Returns:
        ``(tokens, pairs)``, each of shape ``(n_samples, n_modules)`` in ``mllm.module_names`` order.
    """
    names = mllm.module_names
    tokens = np.zeros((len(samples), len(names)), dtype=np.int64)
    pairs = np.zeros((len(samples), len(names)), dtype=np.int64)
    for i, sample in enumerate(samples):
        loads = sample_loads(sample, mllm)
        for j, name in enumerate(names):
            tokens[i, j] = loads[name].tokens
            pairs[i, j] = loads[name].pairs
    return tokens, pairs


def llm_tokens(sample: SampleShape, mllm: MLLMSpec) -> int:
    """Length of the sample's LLM sequence (text plus item tokens)."""
    return sum(n for _, n in llm_segments(sample, mllm))
