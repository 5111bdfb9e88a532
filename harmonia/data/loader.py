"""The dataset the trainer reads: shapes for the scheduler, decoded samples for the executor.

`open_dataset(path, mllm, tokenizer=..., format=...)` reads any supported format (harmonia.data.sources),
renders each record with the tokenizer (`build_tokenizer`: a checkpoint's tokenizer and chat template,
or the byte tokenizer of the synthetic demo) and decodes media with the model's preprocessing
(`checkpoint_preprocessors`).

Bad data never disappears silently. Every unusable sample (a line that is not JSON, a missing or
corrupt media file, an unknown modality, a sample longer than ``max_tokens``) raises a `DataError`
naming its file and line; with ``on_error="skip"`` it is logged, counted by kind in `DataStats` (whose
`DataStats.metrics` go into the run's metrics) and skipped, with ``on_error="fail"`` it stops the run.
Decoding runs in worker processes (a ``torch.utils.data.DataLoader`` over the scheduler's index
lists, or the trainer's `harmonia.data.decode.SampleDecoder`); failures travel back as values and
are counted in the main process. With a ``shape_cache`` file the shape pass also caches rendered
token counts beside it (`harmonia.data.token_cache`), so a later pass does not render again.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from harmonia.data.conversation import Conversation
from harmonia.data.media import FrameSampling
from harmonia.data.records import DataError
from harmonia.data.samples import LoadedSample, SampleBuilder, SampleOutline, media_file
from harmonia.data.shape_index import build_shape_index
from harmonia.data.sources import read_conversations
from harmonia.data.token_cache import TokenCountCache, renderer_identity, token_cache_path
from harmonia.data.tokenizer import ByteTokenizer, Tokenizer
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
    where: str = ""


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
    """Samples of a dataset in any supported format, for one MLLM.

    Args:
        path: a dataset file or directory (see `harmonia.data.sources`).
        mllm: the model; its encoders decide which modalities are known and their token counts.
        max_tokens: longest LLM sequence a sample may have.
        max_frames: frames sampled from each video.
        on_error: ``skip`` (count and skip bad samples) or ``fail`` (raise on the first).
        format: ``auto`` or one of `harmonia.data.formats.FORMATS`.
        tokenizer: renders conversations; None is the byte tokenizer of the synthetic demo.
        media_root: media root of sources that name none (default: each annotation file's directory).
        allow_outside_root: accept media paths that resolve outside their root.
        seed: seed of mixture sampling (``random:N``).
        preprocessors: encoder module -> media preprocessing (`build_media_preprocessors`); encoders
            not named use their preset family's.
        shape_cache: a file caching media header shapes between runs, and beside it rendered token
            counts (None: no cache).
        num_workers: processes reading media headers for `shapes`.
        log_skips: log each skipped record once (False: count it only, where another process
            reports it).
        truncate: cut samples longer than ``max_tokens`` instead of skipping them
            (`harmonia.data.samples.SampleBuilder`).
        frames_fps: the frame rate of videos given as lists of frame files (None: unknown).
    """

    def __init__(self, path: str | Path, mllm: MLLMSpec, max_tokens: int = 4096, max_frames: int = 8,
                 on_error: str = "skip", *, format: str = "auto", tokenizer: Tokenizer | None = None,
                 media_root: str | Path | None = None, allow_outside_root: bool = False, seed: int = 0,
                 preprocessors: dict | None = None, shape_cache: str | Path | None = None,
                 num_workers: int = 0, log_skips: bool = True, truncate: bool = False,
                 frames_fps: float | None = None) -> None:
        if on_error not in POLICIES:
            raise ConfigError(f"on_error={on_error!r} is invalid; expected one of {POLICIES}")
        self.path, self.mllm, self.on_error = Path(path), mllm, on_error
        self.tokenizer = tokenizer or ByteTokenizer()
        identity = renderer_identity(self.tokenizer)
        tokens = None if identity is None else TokenCountCache(
            token_cache_path(shape_cache) if shape_cache is not None else None, identity)
        self.builder = SampleBuilder(mllm, self.tokenizer, max_tokens, preprocessors or {},
                                     FrameSampling(num_frames=max_frames), tokens, truncate, frames_fps=frames_fps)
        self.shape_cache, self.num_workers, self.log_skips = shape_cache, num_workers, log_skips
        self.stats = DataStats()
        self._counted: set = set()  # a bad record is counted once, however often it is read
        self._n_targets: dict[int, int] = {}  # dataset index -> tokens with a label (`outline`)
        self.records: list[Conversation]
        self.records, errors, self.sources = read_conversations(path, format, media_root, allow_outside_root, seed)
        self.n_read = len({id(c) for c in self.records}) + len(errors)
        for e in errors:
            self._fail(e.kind, str(e), e.where)
        self._check_tiles()
        self._check_item_tokens()

    def _check_item_tokens(self) -> None:
        if self.mllm.item_token_ids and isinstance(self.tokenizer, ByteTokenizer):
            raise ConfigError(f"the model {self.mllm.name!r} comes from a checkpoint with its own tokenizer (it names "
                              "item token ids) but the dataset was opened with the byte tokenizer of the synthetic "
                              "demo; pass the checkpoint's tokenizer (build_tokenizer(checkpoint_dir))")
        ours = getattr(self.tokenizer, "item_token_ids", {})
        for modality, token in self.mllm.item_token_ids.items():
            if modality in ours and ours[modality] != token:
                raise ConfigError(f"the tokenizer puts token {ours[modality]} at {modality} items but the model "
                                  f"{self.mllm.name!r} expects {token}; use the tokenizer of the same checkpoint")

    def _check_tiles(self) -> None:
        vision = [e for e in self.mllm.encoders.values() if e.is_vision]
        for spec in self.sources:
            if spec.max_tiles is not None and any(e.max_tiles != spec.max_tiles for e in vision):
                raise ConfigError(f"source {spec.name!r} sets max_dynamic_patch={spec.max_tiles} but the vision "
                                  f"encoder tiles up to {[e.max_tiles for e in vision]}; one tiling per model: "
                                  "remove max_dynamic_patch or make it equal")

    def __len__(self) -> int:
        return len(self.records)

    def _fail(self, kind: str, message: str, key: object) -> None:
        if self.on_error == "fail":
            raise DataError(kind, "dataset", message + " (on_error='fail'; use 'skip' to count and skip)")
        if key in self._counted:
            return
        self._counted.add(key)
        if self.log_skips:
            log.warning("skipping sample (%s): %s", kind, message)
        self.stats.record(kind, message)

    def report(self, failed: Failed) -> None:
        """Handle a sample that failed elsewhere (another rank's decoding) by the policy: count and log it
        once, or raise with ``on_error="fail"``."""
        self._fail(failed.kind, failed.message, failed.where)

    def __getitem__(self, index: int) -> LoadedSample | Failed:
        try:
            return self.builder.build(self.records[index], index)
        except DataError as e:
            return Failed(index, e.kind, str(e), self.records[index].where)

    def shape(self, index: int, headers: list[dict] | None = None) -> SampleShape | Failed:
        """Header-only shape of one sample (``headers``: its items' shape-index entries, if known)."""
        try:
            return self.builder.shape(self.records[index], index, headers)
        except DataError as e:
            return Failed(index, e.kind, str(e), self.records[index].where)

    def shapes(self) -> list[SampleShape]:
        """Shapes of every usable sample (``sample_id`` = dataset index); bad ones counted and skipped.

        Media headers come from the shape index (`build_shape_index`: each distinct file read once, in
        ``num_workers`` processes, cached in ``shape_cache``); a record repeated by a mixture is
        rendered once, and a record whose rendering the token cache holds is not rendered.
        """
        unique = list({id(c): c for c in self.records}.values())
        refs = [[media_file(r, c) for r in c.media()] for c in unique]
        headers = build_shape_index(refs, self.num_workers, self.shape_cache, self.path if self.path.is_file() else None,
                                    progress=False)
        by_id = {id(c): (k, h) for k, (c, h) in enumerate(zip(unique, headers))}
        done: dict[int, SampleShape | Failed] = {}
        out = []
        for i, conv in enumerate(self.records):
            k, h = by_id[id(conv)]
            if k not in done:
                done[k] = self.shape(i, h)
            s = done[k]
            if isinstance(s, Failed):
                self._fail(s.kind, s.message, s.where)
            else:
                out.append(replace(s, sample_id=i))
        if self.builder.token_cache is not None:
            self.builder.token_cache.save()
        return out

    def outline(self, shape: SampleShape) -> SampleOutline:
        """A sample of `shapes` as the batch builder sees it without decoding it (`SampleOutline`)."""
        index = shape.sample_id
        conv = self.records[index]
        if index not in self._n_targets:  # from the token cache; kept, as every step asks again
            self._n_targets[index] = self.builder.n_targets(conv, shape)
        outline = self.builder.outline(shape, self._n_targets[index])
        outline.sample_id = conv.id if conv.id is not None else index
        return outline

    def decode(self, indices: list[int]) -> list[LoadedSample | Failed]:
        """Decode samples in this process; bad ones returned as `Failed`, neither counted nor logged."""
        return [self[i] for i in indices]

    def _accept(self, results: list[LoadedSample | Failed]) -> list[LoadedSample]:
        good = []
        for r in results:
            if isinstance(r, Failed):
                self._fail(r.kind, r.message, r.where)
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


def build_tokenizer(hf_dir: str | Path | None = None, chat_template: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint directory (`HFTokenizer`), or the byte tokenizer when none is given.

    Args:
        hf_dir: an HF checkpoint (or tokenizer) directory; None or empty for the synthetic demo's bytes.
        chat_template: a template file replacing the checkpoint's.
    """
    if not hf_dir:
        if chat_template:
            raise ConfigError("a chat template needs the checkpoint's tokenizer; give the checkpoint directory too")
        return ByteTokenizer()
    from harmonia.data.chat import HFTokenizer

    return HFTokenizer.from_pretrained(hf_dir, chat_template)


def checkpoint_preprocessors(mllm: MLLMSpec, hf_dir: str | Path | None) -> dict | None:
    """Media preprocessing of a whole checkpoint (LLaVA: its processor's image processor for the vision
    encoders), or None (each encoder's preset family) when ``hf_dir`` is None or has no processor files."""
    if not hf_dir or not any((Path(hf_dir) / f).is_file() for f in ("preprocessor_config.json",
                                                                     "processor_config.json")):
        return None
    from harmonia.data.media import build_media_preprocessors

    return build_media_preprocessors(mllm, {m: hf_dir for m, e in mllm.encoders.items() if e.is_vision})


def open_dataset(path: str | Path, mllm: MLLMSpec, *, tokenizer: Tokenizer | None = None, format: str = "auto",
                 max_tokens: int = 4096, max_frames: int = 8, on_error: str = "skip", **options) -> MultimodalDataset:
    """Open a dataset for a model: records read and normalised, bad ones counted by kind.

    Args:
        path: a dataset file or directory: harmonia manifest, LLaVA JSON / JSONL, messages JSONL,
            webdataset shards, or a mixture file (see `harmonia.data.sources`).
        mllm: the model spec (token counts per item, known modalities, item attention).
        tokenizer: `build_tokenizer`'s result; None is the byte tokenizer.
        format: ``auto`` or a format every record must have.
        max_tokens: longest LLM sequence a sample may have.
        max_frames: frames sampled from each video.
        on_error: ``skip`` or ``fail``.
        **options: `MultimodalDataset`'s keyword options (media_root, allow_outside_root, seed,
            preprocessors, shape_cache, num_workers, truncate, frames_fps).

    Returns:
        The dataset: ``shapes()`` for the scheduler, ``load(indices)`` / ``iter_load(batches)`` for the
        executor, ``stats`` for the run's metrics.
    """
    return MultimodalDataset(path, mllm, max_tokens, max_frames, on_error, format=format, tokenizer=tokenizer,
                             **options)
