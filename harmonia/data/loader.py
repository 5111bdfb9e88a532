"""The dataset the trainer reads: shapes for the scheduler, decoded samples for the executor.

Bad data never disappears silently. Every unusable sample (a line that is not JSON, a missing or
corrupt media file, an unknown modality, a sample longer than ``max_tokens``) raises a `DataError`
naming its file and line; with ``on_error="skip"`` it is logged, counted by kind in `DataStats` (whose
`DataStats.metrics` go into the run's metrics) and skipped, with ``on_error="fail"`` it stops the run.
Decoding runs in worker processes (a ``torch.utils.data.DataLoader`` over the scheduler's index
lists); failures travel back as values and are counted in the main process.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harmonia.data.records import DataError, Record, read_dataset
from harmonia.data.samples import LoadedSample, build_sample, read_shape
from harmonia.data.tokenizer import ByteTokenizer
from harmonia.errors import ConfigError
from harmonia.model.batch import PackedBatch, pack_samples
from harmonia.model.spec import MLLMSpec
from harmonia.workload.shapes import SampleShape

log = logging.getLogger(__name__)
POLICIES = ("skip", "fail")


@dataclass
class Failed:
    """A sample that could not be used, returned by a worker instead of raising."""

    index: int
    kind: str
    message: str


@dataclass
class DataStats:
    """Counts of good and skipped samples, by failure kind, with the first messages of each kind."""

    loaded: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def record(self, kind: str, message: str, keep: int = 5) -> None:
        self.skipped[kind] += 1
        self.examples.setdefault(kind, [])
        if len(self.examples[kind]) < keep:
            self.examples[kind].append(message)

    def metrics(self) -> dict[str, int]:
        """``data/loaded`` and ``data/skipped/<kind>`` counters for the run's metrics."""
        out = {"data/loaded": self.loaded, "data/skipped": sum(self.skipped.values())}
        out.update({f"data/skipped/{k}": v for k, v in sorted(self.skipped.items())})
        return out


class MultimodalDataset(torch.utils.data.Dataset):
    """Samples of a manifest or tar shards for one MLLM.

    Args:
        path: a JSONL manifest, a tar shard, or a directory of shards / with ``manifest.jsonl``.
        mllm: the model; its encoders decide which modalities are known and their token counts.
        max_tokens: longest LLM sequence a sample may have.
        max_frames: frames sampled from each video.
        on_error: ``skip`` (count and skip bad samples) or ``fail`` (raise on the first).
    """

    def __init__(self, path: str | Path, mllm: MLLMSpec, max_tokens: int = 4096, max_frames: int = 8,
                 on_error: str = "skip") -> None:
        if on_error not in POLICIES:
            raise ConfigError(f"on_error={on_error!r} is invalid; expected one of {POLICIES}")
        self.mllm, self.max_tokens, self.max_frames, self.on_error = mllm, max_tokens, max_frames, on_error
        self.tokenizer = ByteTokenizer()
        self.stats = DataStats()
        self._counted: set = set()  # a bad sample is counted once, however often it is read
        self.records: list[Record]
        self.records, errors = read_dataset(path)
        for e in errors:
            self._fail(e.kind, str(e), e.where)

    def __len__(self) -> int:
        return len(self.records)

    def _fail(self, kind: str, message: str, key: object) -> None:
        if self.on_error == "fail":
            raise DataError(kind, "dataset", message + " (on_error='fail'; use 'skip' to count and skip)")
        if key in self._counted:
            return
        self._counted.add(key)
        log.warning("skipping sample (%s): %s", kind, message)
        self.stats.record(kind, message)

    def __getitem__(self, index: int) -> LoadedSample | Failed:
        try:
            return build_sample(self.records[index], index, self.mllm, self.max_tokens, self.max_frames,
                                self.tokenizer)
        except DataError as e:
            return Failed(index, e.kind, str(e))

    def shape(self, index: int) -> SampleShape | Failed:
        """Header-only shape of one sample."""
        try:
            return read_shape(self.records[index], index, self.mllm, self.max_tokens, self.max_frames,
                              self.tokenizer)
        except DataError as e:
            return Failed(index, e.kind, str(e))

    def shapes(self) -> list[SampleShape]:
        """Shapes of every usable sample (``sample_id`` = dataset index); bad ones counted and skipped."""
        out = []
        for i in range(len(self)):
            s = self.shape(i)
            if isinstance(s, Failed):
                self._fail(s.kind, s.message, s.index)
            else:
                out.append(s)
        return out

    def _accept(self, results: list[LoadedSample | Failed]) -> list[LoadedSample]:
        good = []
        for r in results:
            if isinstance(r, Failed):
                self._fail(r.kind, r.message, r.index)
            else:
                good.append(r)
        self.stats.loaded += len(good)
        return good

    def load(self, indices: list[int]) -> list[LoadedSample]:
        """Decode samples in this process; bad ones handled by the policy."""
        return self._accept([self[i] for i in indices])

    def iter_load(self, batches: Iterable[list[int]], num_workers: int = 0,
                  prefetch_factor: int = 2) -> Iterator[list[LoadedSample]]:
        """Decode index lists (the scheduler's per-rank microbatches) in worker processes, in order."""
        loader = torch.utils.data.DataLoader(
            self, batch_sampler=list(batches), num_workers=num_workers, collate_fn=list,
            prefetch_factor=prefetch_factor if num_workers else None,
            persistent_workers=False,
        )
        for results in loader:
            yield self._accept(results)


def collate(samples: list[LoadedSample]) -> PackedBatch:
    """Pack decoded samples into one microbatch (one sequence, encoders' inputs grouped)."""
    return pack_samples([s.tokens for s in samples])
