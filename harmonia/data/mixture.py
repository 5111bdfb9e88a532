"""Mixture files: several annotation sources, each with its media root and a sampling rule.

Two conventions users already hold:

- LLaVA-NeXT's YAML (or the same as JSON)::

      datasets:
        - json_path: coco/llava_665k.json
          sampling_strategy: "first:50%"     # all | first:N | end:N | random:N, N a count or P%
          media_root: coco/images            # also spelled image_folder or data_root

  ``P%`` takes ``ceil(P * n / 100)`` records, as LLaVA-NeXT does.
- InternVL's meta JSON: ``{name: {"root": media root, "annotation": JSONL, "repeat_time": r,
  "length": n}}``; ``r < 1`` keeps the first ``int(n * r)`` records, an integer ``r > 1`` repeats them.

Relative paths are relative to the mixture file. Any other key is a `ConfigError` (it would change
the data in a way harmonia does not implement), except InternVL's informational ``length``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harmonia.errors import ConfigError

log = logging.getLogger(__name__)
_ROOT_KEYS = ("media_root", "image_folder", "data_root")
_LLAVA_KEYS = {"json_path", "sampling_strategy", "format", "repeat_time", *_ROOT_KEYS}
_INTERNVL_KEYS = {"root", "annotation", "repeat_time", "length", "data_augment", "max_dynamic_patch", "format"}


@dataclass(frozen=True)
class SourceSpec:
    """One source of a dataset.

    Attributes:
        path: annotation file, tar shard or directory.
        media_root: where its media paths are relative to (None: the annotation file's directory).
        format: record format (see `harmonia.data.formats.FORMATS`).
        strategy: ``all``, ``first:N``, ``end:N`` or ``random:N`` (N a count or ``P%``).
        repeat: InternVL ``repeat_time``.
        max_tiles: InternVL ``max_dynamic_patch``, checked against the vision encoder's.
        name: the source's name in reports.
    """

    path: Path
    media_root: Path | None = None
    format: str = "auto"
    strategy: str = "all"
    repeat: float = 1.0
    max_tiles: int | None = None
    name: str = ""


def is_mixture(path: Path) -> bool:
    """A YAML file, or a JSON object with ``datasets`` or of InternVL entries (without reading records)."""
    if path.suffix in (".yaml", ".yml"):
        return True
    if path.suffix != ".json" or path.stat().st_size > 1 << 20:
        return False
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return _is_mixture_data(data)


def _is_mixture_data(data: object) -> bool:
    if not isinstance(data, dict) or not data:
        return False
    if isinstance(data.get("datasets"), list):
        return True
    return all(isinstance(v, dict) and "annotation" in v for v in data.values())


def read_mixture(path: str | Path) -> list[SourceSpec]:
    """The sources a mixture file lists."""
    path = Path(path)
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text())
        else:
            data = json.loads(path.read_text())
    except Exception as e:
        raise ConfigError(f"mixture file {path} cannot be read: {type(e).__name__}: {e}") from e
    if not _is_mixture_data(data):
        raise ConfigError(f"mixture file {path}: expected 'datasets: [{{json_path: ...}}]' (LLaVA-NeXT) or "
                          "{name: {root, annotation, repeat_time}} (InternVL)")
    if "datasets" in data:
        return [_llava_entry(path, i, e) for i, e in enumerate(data["datasets"])]
    return [_internvl_entry(path, name, e) for name, e in data.items()]


def _check_keys(path: Path, what: str, entry: object, allowed: set[str], required: str) -> dict:
    if not isinstance(entry, dict) or required not in entry:
        raise ConfigError(f"mixture file {path}: entry {what} must be a mapping with {required!r}")
    unknown = set(entry) - allowed
    if unknown:
        raise ConfigError(f"mixture file {path}: entry {what} has unsupported keys {sorted(unknown)}; "
                          f"supported: {sorted(allowed)}")
    return entry


def _relative(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base.parent / p


def _llava_entry(path: Path, i: int, entry: object) -> SourceSpec:
    e = _check_keys(path, f"#{i}", entry, _LLAVA_KEYS, "json_path")
    roots = [k for k in _ROOT_KEYS if k in e]
    if len(roots) > 1:
        raise ConfigError(f"mixture file {path}: entry #{i} gives {roots}; give one media root")
    strategy = str(e.get("sampling_strategy", "all"))
    parse_strategy(strategy, 0, f"{path} entry #{i}")
    return SourceSpec(_relative(path, e["json_path"]), _relative(path, e[roots[0]]) if roots else None,
                      e.get("format", "auto"), strategy, _repeat(path, f"#{i}", e), None, str(e["json_path"]))


def _internvl_entry(path: Path, name: str, entry: object) -> SourceSpec:
    e = _check_keys(path, repr(name), entry, _INTERNVL_KEYS, "annotation")
    if e.get("data_augment"):
        raise ConfigError(f"mixture file {path}: entry {name!r} asks for data_augment, which harmonia does not "
                          "implement; set it to false")
    root = _relative(path, e["root"]) if e.get("root") else None
    return SourceSpec(_relative(path, e["annotation"]), root, e.get("format", "auto"), "all",
                      _repeat(path, repr(name), e), e.get("max_dynamic_patch"), name)


def _repeat(path: Path, what: str, e: dict) -> float:
    r = e.get("repeat_time", 1)
    if not isinstance(r, (int, float)) or r <= 0 or (r > 1 and r != int(r)):
        raise ConfigError(f"mixture file {path}: entry {what} repeat_time={r!r} must be in (0, 1] or an integer")
    return float(r)


def parse_strategy(strategy: str, n: int, where: str) -> tuple[str, int]:
    """``(rule, count)`` of a LLaVA-NeXT sampling strategy for a source of ``n`` records."""
    if strategy == "all":
        return "all", n
    rule, _, number = strategy.partition(":")
    try:
        count = math.ceil(float(number[:-1]) * n / 100) if number.endswith("%") else int(number)
    except ValueError:
        count = -1
    if rule not in ("first", "end", "random") or count < 0:
        raise ConfigError(f"{where}: sampling_strategy={strategy!r}; expected all, first:N, end:N or random:N "
                          "(N a count or a percentage like 10%)")
    return rule, min(count, n)


def select(n: int, spec: SourceSpec, seed: int) -> list[int]:
    """Indices of a source's ``n`` records that the mixture uses, repeats included, in file order."""
    rule, count = parse_strategy(spec.strategy, n, spec.name or str(spec.path))
    if rule == "first":
        idx = list(range(count))
    elif rule == "end":
        idx = list(range(n - count, n))
    elif rule == "random":
        idx = sorted(np.random.default_rng(seed).permutation(n)[:count].tolist())
    else:
        idx = list(range(n))
    if spec.repeat < 1:
        idx = idx[: int(len(idx) * spec.repeat)]
    return idx * int(spec.repeat) if spec.repeat > 1 else idx
