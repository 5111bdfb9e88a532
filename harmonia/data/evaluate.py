"""Held-out answer accuracy of a model on the synthetic tasks.

For each sample the model reads the prompt and its media (teacher forcing) and picks, among the
task's possible answers, the one whose first token it scores highest; every task's answers start
with distinct tokens. Chance is ``1 / len(TASK_ANSWERS[task])``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from harmonia.data.samples import LoadedSample
from harmonia.data.synth import TASK_ANSWERS
from harmonia.data.tokenizer import ByteTokenizer, Tokenizer
from harmonia.model.batch import pack_samples


@torch.no_grad()
def answer_accuracy(model: nn.Module, samples: list[LoadedSample],
                    tokenizer: Tokenizer | None = None) -> dict[str, tuple[float, int]]:
    """Per task: ``(accuracy, n_samples)``; samples of unknown tasks are ignored.

    Args:
        model: an `MLLM` (anything mapping a `PackedBatch` to ``(1, T, vocab)`` logits).
        samples: decoded held-out samples.
        tokenizer: the samples' tokenizer (None: the byte tokenizer); an answer's first token is the
            first of its text tokens.
    """
    tok = tokenizer or ByteTokenizer()
    was_training = model.training
    model.eval()
    hits: dict[str, list[bool]] = defaultdict(list)
    for s in samples:
        if s.task not in TASK_ANSWERS:
            continue
        batch = pack_samples([s.tokens])
        logits = model(batch)[0]  # (T, vocab)
        pos = int((batch.labels[0] != -100).nonzero()[0])  # predicts the answer's first token
        firsts = [tok.encode_text(a)[0] for a in TASK_ANSWERS[s.task]]
        pred = firsts[int(logits[pos, firsts].argmax())]
        hits[s.task].append(pred == tok.encode_text(s.answer)[0])
    model.train(was_training)
    return {task: (sum(h) / len(h), len(h)) for task, h in sorted(hits.items())}


def chance_accuracy(task: str) -> float:
    """Accuracy of a uniform guess among the task's answers."""
    return 1.0 / len(TASK_ANSWERS[task])
