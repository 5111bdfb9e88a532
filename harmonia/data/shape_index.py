"""Header-only shapes of a dataset's media, computed once in worker processes and cached beside it.

The scheduler needs, per record, the sizes of each media item, never pixels. `media_shape` reads one
item's header (image size after EXIF orientation, audio samples and rate, video frame count, rate and
size); `build_shape_index` runs it over every item of a dataset in ``num_workers`` processes (each
distinct file once) with a progress bar, and caches the result in a JSON file keyed by the dataset
file's path, size and modification time (and the list of items), so a changed dataset is re-indexed.
The cache goes beside the dataset (`shape_cache_path`), or under the user cache directory when the
dataset's directory is not writable; failing to write it only logs a warning.

A bad item is recorded, not raised: ``{"error": kind, "message": ...}`` (kinds of `MediaError`), so
the loader counts it as a bad record of that kind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harmonia.data.audio import audio_header
from harmonia.data.image import image_header
from harmonia.data.media_errors import MediaError
from harmonia.data.video import video_header

log = logging.getLogger(__name__)
INDEX_VERSION = 1
KINDS = ("image", "audio", "video", "frames")


@dataclass(frozen=True)
class MediaFile:
    """One media item to index: files on disk, or members of a tar shard.

    Attributes:
        kind: ``image``, ``audio``, ``video`` (a container) or ``frames`` (a video as image files).
        path: the item's file (``image``, ``audio``, ``video``).
        frames: the frame files in order (``frames``).
        shard: a tar shard whose members ``path`` / ``frames`` name; None for files on disk.
    """

    kind: str
    path: str | None = None
    frames: tuple[str, ...] = ()
    shard: str | None = None

    @property
    def name(self) -> str:
        where = self.path if self.path is not None else f"{len(self.frames)} frames from {self.frames[:1]}"
        return f"{self.shard}:{where}" if self.shard else str(where)


def media_shape(kind: str, source: bytes | str | Path | Sequence[bytes | str | Path]) -> dict:
    """Sizes of one media item from its header, without decoding.

    Args:
        kind: ``image``, ``audio``, ``video`` or ``frames``.
        source: the file's bytes or path; for ``frames``, the list of frame files' bytes or paths.

    Returns:
        image ``{height, width}`` (after EXIF orientation); audio ``{samples, rate, channels}``; video
        ``{frames, fps, height, width}``; frames ``{frames, height, width}`` (of the first frame).

    Raises:
        MediaError: the header is unreadable.
    """
    if kind == "image":
        h, w = image_header(source, max_pixels=None)
        return {"height": h, "width": w}
    if kind == "audio":
        info = audio_header(source)
        return {"samples": info.frames, "rate": info.rate, "channels": info.channels}
    if kind == "video":
        v = video_header(source)
        return {"frames": v.frames, "fps": v.fps, "height": v.height, "width": v.width}
    if kind == "frames":
        if not source:
            raise MediaError("corrupt_media", "a video given as frames needs at least one frame")
        h, w = image_header(source[0], max_pixels=None)
        return {"frames": len(source), "height": h, "width": w}
    raise MediaError("unsupported_media", f"unknown media kind {kind!r}; expected one of {KINDS}")


def _shape_of(ref: MediaFile, tars: dict[str, tarfile.TarFile]) -> dict:
    def read(name: str) -> bytes | str:
        if ref.shard is None:
            if not Path(name).is_file():
                raise MediaError("missing_file", f"{name} not found")
            return name
        if ref.shard not in tars:
            tars[ref.shard] = tarfile.open(ref.shard)  # noqa: SIM115 - closed by _shape_batch
        try:
            f = tars[ref.shard].extractfile(name)
        except KeyError:
            f = None
        if f is None:
            raise MediaError("missing_file", f"member {name} not in the shard")
        return f.read()

    try:
        if ref.kind == "frames":
            if not ref.frames:
                raise MediaError("corrupt_media", "a video given as frames needs at least one frame")
            return media_shape("frames", [read(n) for n in ref.frames])
        return media_shape(ref.kind, read(ref.path))
    except MediaError as e:
        return {"error": e.kind, "message": f"{ref.name}: {e}"}
    except OSError as e:
        return {"error": "missing_file", "message": f"{ref.name}: {e}"}


def _shape_batch(refs: list[MediaFile]) -> list[dict]:
    """Shapes of a batch of items (one worker task); tar shards opened once per batch."""
    tars: dict[str, tarfile.TarFile] = {}
    try:
        return [_shape_of(r, tars) for r in refs]
    finally:
        for t in tars.values():
            t.close()


def _user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harmonia" / "shape-index"


def shape_cache_path(dataset: str | Path) -> Path:
    """Where the shape index of a dataset file is cached: beside it, or the user cache when not writable."""
    dataset = Path(dataset).resolve()
    if os.access(dataset.parent, os.W_OK):
        return dataset.parent / f".{dataset.name}.shapes.json"
    return _fallback(dataset.parent / f".{dataset.name}.shapes.json")


def _fallback(path: Path) -> Path:
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return _user_cache_dir() / f"{digest}-{path.name.lstrip('.')}"


def _cache_key(items: Sequence[Sequence[MediaFile]], dataset: str | Path | None) -> dict:
    text = "\n".join("\t".join(f"{r.kind}|{r.path}|{r.shard}|{'|'.join(r.frames)}" for r in refs) for refs in items)
    digest = hashlib.sha1(text.encode()).hexdigest()
    key: dict = {"version": INDEX_VERSION, "records": len(items), "items": digest}
    if dataset is not None:
        st = Path(dataset).stat()
        key["dataset"] = {"path": str(Path(dataset).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return key


def _read_cache(path: Path, key: dict) -> list[list[dict]] | None:
    for candidate in (path, _fallback(path)):
        try:
            payload = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if payload.get("key") == key:
            distinct = payload["distinct"]
            return [[distinct[i] for i in rec] for rec in payload["records"]]
    return None


def _write_cache(path: Path, key: dict, distinct: list[dict], records: list[list[int]]) -> Path | None:
    """Write the index as the distinct items' shapes and, per record, their positions (records share files)."""
    text = json.dumps({"key": key, "distinct": distinct, "records": records}, separators=(",", ":"))
    for candidate in (path, _fallback(path)):
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            tmp = candidate.with_name(f"{candidate.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, candidate)
            return candidate
        except OSError as e:
            log.debug("cannot write the shape index to %s: %s", candidate, e)
    log.warning("could not cache the shape index at %s or under %s; it will be recomputed next time",
                path, _user_cache_dir())
    return None


def _compute(unique: list[MediaFile], num_workers: int, progress: bool) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    size = max(16, min(512, len(unique) // max(1, 8 * num_workers)))
    batches = [unique[i:i + size] for i in range(0, len(unique), size)]
    columns = (TextColumn("indexing media shapes"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    out: list[dict] = []
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("index", total=len(unique))
        if num_workers <= 0:
            results = map(_shape_batch, batches)
            for r in results:
                out += r
                bar.advance(task, len(r))
            return out
        with ProcessPoolExecutor(num_workers) as pool:
            for r in pool.map(_shape_batch, batches):
                out += r
                bar.advance(task, len(r))
    return out


def build_shape_index(items: Sequence[Sequence[MediaFile]], num_workers: int = 0, cache_path: str | Path | None = None,
                      dataset: str | Path | None = None, progress: bool = True) -> list[list[dict]]:
    """Header-only shapes of every record's media items, from the cache when it is current.

    Args:
        items: per record, its media items in order.
        num_workers: worker processes reading headers (0: this process).
        cache_path: the cache file (see `shape_cache_path`); None computes without caching.
        dataset: the dataset file whose path, size and mtime key the cache.
        progress: show a rich progress bar while computing.

    Returns:
        Per record, one `media_shape` dict per item, or ``{"error": kind, "message": ...}``; records
        naming the same file share its dict (read it, do not change it).
    """
    key = _cache_key(items, dataset) if cache_path is not None else None
    if cache_path is not None:
        cached = _read_cache(Path(cache_path), key)
        if cached is not None:
            return cached
    unique = list(dict.fromkeys(r for refs in items for r in refs))
    for r in unique:
        if r.kind not in KINDS:
            raise MediaError("unsupported_media", f"unknown media kind {r.kind!r} of {r.name}; expected one of {KINDS}")
    distinct = _compute(unique, num_workers, progress)
    position = {r: i for i, r in enumerate(unique)}
    records = [[position[r] for r in refs] for refs in items]
    if cache_path is not None:
        _write_cache(Path(cache_path), key, distinct, records)
    return [[distinct[i] for i in rec] for rec in records]
