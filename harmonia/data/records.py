"""Raw records and where their media live: JSON / JSONL files beside media, or webdataset tar shards.

This module only reads containers; `harmonia.data.formats` decides what a record means. Every
record read here is a `RawRecord` (a parsed JSON value, or a caption string from a shard's
``key.txt``) with its location and its `MediaSource`. A line that is not UTF-8 or not JSON, a shard
that is not a tar file, is one `DataError` of its kind (``bad_utf8``, ``bad_json``,
``corrupt_shard``), never a refusal of the whole file.

Webdataset shards follow the convention of the ``webdataset`` library: members are grouped by key
(the member name up to the first dot of its base name), the rest is the extension: ``key.jpg``,
``key.json``, ``key.0.png``, ``key.wav``, ``key.mp4``. A key's ``.json`` holds a record in any
schema, or its ``.txt`` a caption; its media members are the record's media unless the JSON names
members itself.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harmonia.errors import SampleError

MEDIA_EXTENSIONS = {
    "image": ("jpg", "jpeg", "png", "webp", "bmp"),
    "audio": ("wav", "flac", "mp3", "ogg", "m4a"),
    "video": ("mp4", "webm", "mkv", "mov", "avi"),
}
_MODALITY_OF_EXT = {ext: m for m, exts in MEDIA_EXTENSIONS.items() for ext in exts}
TEXT_EXTENSIONS = ("json", "txt")


class DataError(SampleError):
    """A record or sample cannot be used. ``kind`` names the failure for the run's metrics."""

    def __init__(self, kind: str, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.kind = kind
        self.where = where


def modality_of_file(name: str) -> str | None:
    """``image`` / ``audio`` / ``video`` from a file name's extension, or None."""
    return _MODALITY_OF_EXT.get(name.rsplit(".", 1)[-1].lower())


class MediaSource(Protocol):
    """Where a record's media paths point: a directory or a tar shard."""

    def locate(self, name: str, where: str, key: str | None = None) -> str:
        """The name `read` takes for a path written in a record; raises `DataError` if not allowed."""

    def read(self, name: str) -> bytes:
        """The file's bytes; raises `DataError` (``missing_file``) when absent."""


class DirSource:
    """Media files under a root directory.

    Args:
        root: the media root; record paths are relative to it.
        allow_outside_root: accept paths (absolute, or with ``..``) that resolve outside the root.
    """

    def __init__(self, root: str | Path, allow_outside_root: bool = False) -> None:
        self.root = Path(root)
        self.allow_outside_root = allow_outside_root
        self._resolved = self.root.resolve()

    def locate(self, name: str, where: str, key: str | None = None) -> str:
        if not isinstance(name, str) or not name:
            raise DataError("bad_media", where, f"media path {name!r} is not a non-empty string")
        if not self.allow_outside_root and not (self.root / name).resolve().is_relative_to(self._resolved):
            raise DataError("outside_root", where,
                            f"media path {name!r} resolves outside the media root {self.root}; move the file "
                            "under the root, set the root to a directory holding it, or allow outside paths "
                            "explicitly (allow_outside_root)")
        return name

    def read(self, name: str) -> bytes:
        path = self.root / name
        if not path.is_file():
            raise DataError("missing_file", str(path), "media file not found; fix the path in the record "
                            "or the media root")
        return path.read_bytes()


class TarSource:
    """Members of one tar shard, opened lazily once per process (workers open their own)."""

    def __init__(self, path: str | Path, members: frozenset[str] = frozenset()) -> None:
        self.path = Path(path)
        self.members = members
        self._tar: tarfile.TarFile | None = None
        self._index: dict[str, tarfile.TarInfo] = {}
        self._pid = 0

    def __getstate__(self) -> dict:
        return {"path": self.path, "members": self.members, "_tar": None, "_index": {}, "_pid": 0}

    def locate(self, name: str, where: str, key: str | None = None) -> str:
        if not isinstance(name, str) or not name:
            raise DataError("bad_media", where, f"media member {name!r} is not a non-empty string")
        if name not in self.members and key is not None and f"{key}.{name}" in self.members:
            return f"{key}.{name}"
        return name

    def read(self, name: str) -> bytes:
        if self._tar is None or self._pid != os.getpid():  # one handle per process: forked workers reopen
            self._tar = tarfile.open(self.path)  # noqa: SIM115 - kept open for the process's lifetime
            self._index = {m.name: m for m in self._tar.getmembers()}
            self._pid = os.getpid()
        info = self._index.get(name)
        f = self._tar.extractfile(info) if info is not None else None
        if f is None:
            raise DataError("missing_file", f"{self.path}:{name}", "member not found in the shard")
        return f.read()


@dataclass
class RawRecord:
    """One record as read, before its schema is interpreted.

    Attributes:
        data: the parsed JSON value, or a caption string (a shard's ``key.txt``).
        where: ``file:line``, ``file[index]`` or ``shard:key``.
        source: where its media paths point.
        key: the webdataset key (shards only).
        members: the key's media members by modality (shards only), in name order.
        caption: the key's ``.txt`` text (shards only); ``data`` is None when there is no ``.json``.
    """

    data: object
    where: str
    source: DirSource | TarSource
    key: str | None = None
    members: dict[str, list[str]] = field(default_factory=dict)
    caption: str | None = None


def _decode_json(raw: bytes, where: str) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError("bad_utf8", where, f"not UTF-8 text (byte {e.start}); re-encode the file as UTF-8") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError("bad_json", where, f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from e


def read_jsonl(path: Path, source: DirSource) -> tuple[list[RawRecord], list[DataError]]:
    """One record per non-empty line; a line that is not UTF-8 or not JSON is one error."""
    records, errors = [], []
    for n, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            records.append(RawRecord(_decode_json(line.rstrip(b"\r"), where), where, source))
        except DataError as e:
            errors.append(e)
    return records, errors


def read_json(path: Path, source: DirSource) -> tuple[list[RawRecord], list[DataError]]:
    """A JSON list of records (LLaVA), one JSON object, or JSON Lines under a ``.json`` name."""
    raw = path.read_bytes()
    try:
        data = _decode_json(raw, str(path))
    except DataError as e:
        if e.kind == "bad_json" and "Extra data" in str(e):
            return read_jsonl(path, source)  # JSON Lines saved as .json
        return [], [e]
    if isinstance(data, list):
        return [RawRecord(d, f"{path}[{i}]", source) for i, d in enumerate(data)], []
    return [RawRecord(data, str(path), source)], []


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def split_member(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a shard member: ``dir/k.0.png`` -> ``(dir/k, 0.png)``."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{head}/{stem}" if head else stem), ext if dot else ""


def _key_record(tar: tarfile.TarFile, path: Path, source: TarSource, key: str,
                members: dict[str, tarfile.TarInfo]) -> RawRecord | None:
    """The record of one key, None for a key without text or media; raises `DataError`."""
    where = f"{path}:{key}"
    media: dict[str, list[str]] = {}
    for ext in sorted(members, key=_natural):
        modality = modality_of_file(ext)
        if modality is not None:
            media.setdefault(modality, []).append(members[ext].name)
    if "json" not in members and "txt" not in members:
        if media:
            raise DataError("unknown_schema", where, f"key has members {sorted(members)} but no .json or .txt; "
                            "add key.json (a conversation) or key.txt (a caption)")
        return None  # a key of other members only (e.g. .cls) is not a sample
    data = caption = None
    if "json" in members:
        data = _decode_json(tar.extractfile(members["json"]).read(), f"{path}:{members['json'].name}")
    if "txt" in members:
        raw = tar.extractfile(members["txt"]).read()
        try:
            caption = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise DataError("bad_utf8", f"{path}:{members['txt'].name}", f"not UTF-8 text (byte {e.start})") from e
    return RawRecord(data, where, source, key, media, caption)


def read_shard(path: str | Path) -> tuple[list[RawRecord], list[DataError]]:
    """Records of a webdataset tar shard, one per key holding a ``.json`` or ``.txt`` member."""
    path = Path(path)
    records, errors = [], []
    try:
        with tarfile.open(path) as tar:
            infos = [m for m in tar.getmembers() if m.isfile()]
            groups: dict[str, dict[str, tarfile.TarInfo]] = {}
            for m in infos:
                key, ext = split_member(m.name)
                groups.setdefault(key, {})[ext] = m
            source = TarSource(path, frozenset(m.name for m in infos))
            for key, members in groups.items():
                try:
                    record = _key_record(tar, path, source, key, members)
                except DataError as e:
                    errors.append(e)
                    continue
                if record is not None:
                    records.append(record)
    except (tarfile.TarError, OSError) as e:
        return [], [DataError("corrupt_shard", str(path), f"cannot read the tar shard: {e}")]
    return records, errors
