"""Which files make a dataset, and reading them into conversations.

A dataset path is one of:

- a file: a JSONL manifest / annotation (``.jsonl``), a JSON list (``.json``), a webdataset shard
  (``.tar``), or a mixture file (``.yaml`` / ``.yml``, or a JSON mixture; see harmonia.data.mixture);
- a directory: its ``*.tar`` shards if it has any; else its ``manifest.jsonl``; else its mixture
  files; else its ``*.jsonl`` / ``*.json`` annotation files. A directory with a ``train/`` split is
  the synthetic layout (`dataset_splits`).

Media paths are relative to the source's media root: the ``media_root`` given (or the mixture
entry's), else the annotation file's directory. Records are normalised by `to_conversation`; every
record that cannot be is one `DataError` of its kind.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harmonia.data.conversation import Conversation
from harmonia.data.formats import FORMATS, SCHEMAS, known_formats, to_conversation
from harmonia.data.mixture import SourceSpec, is_mixture, read_mixture, select
from harmonia.data.records import DataError, DirSource, RawRecord, read_json, read_jsonl, read_shard
from harmonia.errors import ConfigError

ANNOTATION_SUFFIXES = (".jsonl", ".json", ".tar", ".yaml", ".yml")


def is_dataset(path: str | Path) -> bool:
    """Whether ``path`` holds a user's data: an existing file, or a directory with anything in it.

    The training job refuses a path where this is False (`harmonia.train.data.check_data_path`),
    and writes a synthetic set only into a directory it creates, so a user's dataset, in any
    format, is never written into.
    """
    path = Path(path)
    if path.is_dir():
        return any(path.iterdir())
    return path.exists()


def dataset_splits(path: str | Path) -> tuple[Path, Path | None]:
    """``(train, heldout)``: the ``train/`` and ``heldout/`` splits of the synthetic layout, or the
    path itself (no held-out split) for any other dataset."""
    path = Path(path)
    if (path / "train").is_dir():
        return path / "train", (path / "heldout") if (path / "heldout").is_dir() else None
    return path, None


def _directory_files(path: Path) -> list[Path]:
    for pattern in ("*.tar", "manifest.jsonl"):
        found = sorted(path.glob(pattern))
        if found:
            return found
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".jsonl", ".json", ".yaml", ".yml"))
    mixtures = [p for p in files if is_mixture(p)]
    if mixtures or files:
        return mixtures or files
    raise ConfigError(f"no dataset files in {path}: expected *.tar shards, manifest.jsonl, a mixture (*.yaml) or "
                      "*.jsonl / *.json annotation files")


def plan_sources(path: str | Path, format: str = "auto", media_root: str | Path | None = None) -> list[SourceSpec]:
    """The sources a dataset path stands for (a mixture expands into its entries)."""
    if format not in FORMATS:
        raise ConfigError(f"format={format!r} is not one of {FORMATS}")
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"dataset path {path} does not exist")
    root = Path(media_root) if media_root is not None else None
    files = _directory_files(path) if path.is_dir() else [path]
    out: list[SourceSpec] = []
    for f in files:
        if f.suffix not in ANNOTATION_SUFFIXES:
            raise ConfigError(f"{f}: unknown dataset file type {f.suffix!r}; expected one of {ANNOTATION_SUFFIXES}")
        if is_mixture(f):
            out += [s if s.media_root is not None or root is None else replace(s, media_root=root)
                    for s in read_mixture(f)]
        else:
            out.append(SourceSpec(f, root, format, name=str(f)))
    return out


def _read_raw(spec: SourceSpec, allow_outside_root: bool) -> tuple[list[RawRecord], list[DataError]]:
    path = spec.path
    if path.is_dir():
        records, errors = [], []
        for sub in plan_sources(path, spec.format, spec.media_root):
            r, e = _read_raw(sub, allow_outside_root)
            records += r
            errors += e
        return records, errors
    if not path.is_file():
        raise ConfigError(f"dataset source {spec.name or path}: {path} not found")
    if path.suffix == ".tar":
        return read_shard(path)
    if spec.format == "webdataset":
        raise ConfigError(f"format='webdataset' reads tar shards, but {path} is not a .tar file")
    source = DirSource(spec.media_root or path.parent, allow_outside_root)
    return (read_jsonl if path.suffix == ".jsonl" else read_json)(path, source)


HEAD_RECORDS = 16
"""A source whose first this many records (or all, where it has fewer) match no format stops the job."""


def _check_head(spec: SourceSpec, raw: list[RawRecord], schema: str) -> None:
    """Raise one error where a source's first records all match no format: a dataset in a format
    harmonia does not read, not a few bad records to count."""
    head = raw[:HEAD_RECORDS]
    unknown = []
    for r in head:
        try:
            to_conversation(r, schema)
        except DataError as e:
            if e.kind != "unknown_schema":
                return
            unknown.append(r)
        else:
            return
    if not unknown:
        return
    keys = sorted({k for r in unknown if isinstance(r.data, dict) for k in r.data})
    matched = f"do not match data.format={schema}" if schema != "auto" else "match no format"
    raise ConfigError(f"{spec.name or spec.path}: its first {len(unknown)} records {matched}: keys found {keys}. "
                      f"Known formats: {known_formats()}. Convert the records (e.g. to messages JSONL: "
                      "{\"messages\": [{\"role\", \"content\"}], \"images\": [...]}), or set data.format. "
                      f"The first: {unknown[0].where}")


def read_conversations(path: str | Path, format: str = "auto", media_root: str | Path | None = None,
                       allow_outside_root: bool = False, seed: int = 0
                       ) -> tuple[list[Conversation], list[DataError], list[SourceSpec]]:
    """Every record of a dataset path, normalised; mixtures sampled and repeated.

    Args:
        path: a dataset file or directory (see the module docstring).
        format: ``auto`` or a format of `FORMATS` that every record must have.
        media_root: media root of sources that do not name their own.
        allow_outside_root: accept media paths resolving outside their root.
        seed: seed of ``random:N`` sampling strategies.

    Returns:
        The conversations (a repeated record appears several times, as the same object), one
        `DataError` per record that could not be read or normalised, and the sources read.
    """
    specs = plan_sources(path, format, media_root)
    conversations: list[Conversation] = []
    errors: list[DataError] = []
    for spec in specs:
        if spec.format not in FORMATS:
            raise ConfigError(f"source {spec.name!r}: format={spec.format!r} is not one of {FORMATS}")
        raw, errs = _read_raw(spec, allow_outside_root)
        errors += errs
        schema = spec.format if spec.format in SCHEMAS else "auto"
        _check_head(spec, raw, schema)
        normalised: dict[int, Conversation | None] = {}
        for i in select(len(raw), spec, seed):
            if i not in normalised:
                try:
                    normalised[i] = to_conversation(raw[i], schema)
                except DataError as e:
                    errors.append(e)
                    normalised[i] = None
            if normalised[i] is not None:
                conversations.append(normalised[i])
    return conversations, errors, specs
