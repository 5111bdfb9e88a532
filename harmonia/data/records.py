"""Dataset format: a JSONL manifest beside media files, or webdataset-style tar shards.

One record per sample::

    {"id": "s17", "prompt": "<image>\\nWhat colour is the square?", "answer": "red",
     "media": [{"type": "image", "path": "images/s17.png"}]}

``media`` entries: ``{"type": "image", "path": ...}``, ``{"type": "audio", "path": ... (WAV)}``,
``{"type": "video", "frames": [path, ...]}``. ``<image>``, ``<video>`` and ``<audio>`` markers in the
prompt place the items in the text, in order; a prompt without markers gets all items first.
Paths are relative to the manifest's directory. In a tar shard, ``<key>.json`` holds a record and its
paths name members of the same shard (``<key>.0.png``).
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from harmonia.errors import SampleError

MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


class DataError(SampleError):
    """A sample cannot be used. ``kind`` names the failure for the run's metrics."""

    def __init__(self, kind: str, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.kind = kind
        self.where = where


class DirSource:
    """Media files under a directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def read(self, name: str) -> bytes:
        path = self.root / name
        if not path.is_file():
            raise DataError("missing_file", str(path), "media file not found; fix the path in the manifest")
        return path.read_bytes()


class TarSource:
    """Members of one tar shard, opened lazily in each worker process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tar: tarfile.TarFile | None = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "_tar": None}

    def read(self, name: str) -> bytes:
        if self._tar is None:  # kept open for the worker's lifetime, one handle per process
            self._tar = tarfile.open(self.path)  # noqa: SIM115
        try:
            f = self._tar.extractfile(name)
        except KeyError:
            f = None
        if f is None:
            raise DataError("missing_file", f"{self.path}:{name}", "member not found in the shard")
        return f.read()


@dataclass
class Record:
    """One manifest record and where it came from (``file:line`` or ``shard:member``)."""

    data: dict
    where: str
    source: DirSource | TarSource


def _check_record(data: object, where: str) -> dict:
    if not isinstance(data, dict):
        raise DataError("bad_record", where, f"record is a {type(data).__name__}, expected a JSON object")
    if not isinstance(data.get("prompt", ""), str) or not isinstance(data.get("answer", ""), str):
        raise DataError("bad_record", where, "'prompt' and 'answer' must be strings")
    media = data.get("media", [])
    if not isinstance(media, list) or not all(isinstance(m, dict) for m in media):
        raise DataError("bad_record", where, "'media' must be a list of objects")
    for m in media:
        if m.get("type") not in MARKERS:
            raise DataError("unknown_modality", where, f"media type {m.get('type')!r} is not one of {sorted(MARKERS)}")
    return data


def read_manifest(path: str | Path) -> tuple[list[Record], list[DataError]]:
    """Records of a JSONL manifest, and an error for each line that is not a valid record."""
    path = Path(path)
    if not path.is_file():
        raise DataError("missing_file", str(path), "manifest not found")
    source = DirSource(path.parent)
    records, errors = [], []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            records.append(Record(_check_record(json.loads(line), where), where, source))
        except json.JSONDecodeError as e:
            errors.append(DataError("bad_json", where, f"line is not JSON ({e.msg} at column {e.colno})"))
        except DataError as e:
            errors.append(e)
    return records, errors


def read_shard(path: str | Path) -> tuple[list[Record], list[DataError]]:
    """Records of a tar shard (its ``*.json`` members), and an error for each invalid one."""
    path = Path(path)
    records, errors = [], []
    source = TarSource(path)
    try:
        tar = tarfile.open(path)  # noqa: SIM115 - closed by the with-block below
    except (tarfile.TarError, OSError) as e:
        return [], [DataError("corrupt_shard", str(path), f"cannot open tar shard: {e}")]
    with tar:
        for member in tar.getmembers():
            if not member.name.endswith(".json"):
                continue
            where = f"{path}:{member.name}"
            try:
                records.append(Record(_check_record(json.loads(tar.extractfile(member).read()), where), where, source))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                errors.append(DataError("bad_json", where, f"member is not JSON: {e}"))
            except DataError as e:
                errors.append(e)
    return records, errors


def read_dataset(path: str | Path) -> tuple[list[Record], list[DataError]]:
    """A manifest file, a tar shard, or a directory of ``*.tar`` shards (or holding ``manifest.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        shards = sorted(path.glob("*.tar"))
        if shards:
            records, errors = [], []
            for shard in shards:
                r, e = read_shard(shard)
                records += r
                errors += e
            return records, errors
        path = path / "manifest.jsonl"
    if path.suffix == ".tar":
        return read_shard(path)
    return read_manifest(path)
