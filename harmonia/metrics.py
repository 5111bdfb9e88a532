"""Run metrics: JSON lines, TensorBoard scalars and experiment trackers, written by rank 0 only.

Each logged step is one JSON object per line in ``metrics.jsonl`` (loss; ``tokens_per_s`` and
``samples_per_s``, real tokens and samples over wall-clock time since the run's first step began,
everything between steps included; ``step_tokens_per_s`` and ``step_samples_per_s``, the step's
own compute time only; per-module time, bubble fraction, balance statistics, peak memory, skipped samples, ...), and the
same numbers as TensorBoard scalars under their names when TensorBoard is installed and enabled, and
to each experiment tracker handed in (`harmonia.train.trackers`: Weights & Biases, MLflow).

Metrics never stop training: a write that fails (a full or unwritable disk) warns once and
metrics of that kind are no longer written in this run (a tracker that raises is dropped the same way). A resumed run first cuts
``metrics.jsonl`` back to the steps before the one it resumes at (and TensorBoard purges the
same), so no step appears twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def step_records(path: Path) -> list[tuple[int, str]]:
    """``(step, line)`` of every step record of a ``metrics.jsonl`` (none where there is no file; a torn
    last line and lines of no step are skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append((record["step"], line))
    return out


def cut_metrics(path: Path, start_step: int) -> None:
    """Keep only the records of ``path`` before ``start_step`` (a torn last line goes too); atomic."""
    if not path.is_file():
        return
    kept = [line + "\n" for step, line in step_records(path) if step < start_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsWriter:
    """Metrics for one run, appended from ``start_step`` on.

    Args:
        directory: where ``metrics.jsonl`` and the TensorBoard events go.
        enabled: False on ranks other than 0 (then every call is a no-op).
        tensorboard: also write TensorBoard events.
        start_step: the step the run starts at; records of this step and later are removed first.
        trackers: objects with ``name``, ``log(step, scalars)`` and ``close(failed)``, each sent the
            same finite scalars as TensorBoard and closed by `close`.
    """

    def __init__(self, directory: str | Path, enabled: bool = True, tensorboard: bool = True,
                 start_step: int = 0, trackers: list | None = None) -> None:
        self.enabled = enabled
        self.path = Path(directory) / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._trackers = list(trackers or [])
        if not enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            cut_metrics(self.path, start_step)
            self._file = self.path.open("a")
        except OSError as err:
            self._warn(str(self.path), err)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only
                SummaryWriter = None
            if SummaryWriter is not None:
                try:
                    self._tb = SummaryWriter(str(Path(directory) / "tensorboard"), purge_step=start_step or None)
                except OSError as err:
                    self._warn("TensorBoard events", err)

    @staticmethod
    def _warn(what: str, err: Exception) -> None:
        log.warning("could not write %s (%s): no more of it is written in this run; training goes on", what, err)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record one step's values (nested dicts become ``a/b`` names in TensorBoard)."""
        if not self.enabled:
            return
        if self._file is not None:
            record = {"step": step, "time": time.time(), **values, "unix_time": time.time()}  # wall clock, unshadowed
            try:
                self._file.write(json.dumps(record, default=float) + "\n")
                self._file.flush()
            except OSError as err:
                self._warn(str(self.path), err)
                self._close_file()
        scalars = {name: value for name, value in _flatten(values)
                   if isinstance(value, (int, float)) and math.isfinite(value)}
        if self._tb is not None:
            try:
                for name, value in scalars.items():
                    self._tb.add_scalar(name, value, step)
            except OSError as err:
                self._warn("TensorBoard events", err)
                self._tb = None
        for tracker in list(self._trackers):
            try:
                tracker.log(step, scalars)
            except Exception as err:  # noqa: BLE001 - a tracker never stops training
                self._warn(f"{tracker.name} metrics", err)
                self._trackers.remove(tracker)

    def _close_file(self) -> None:
        file, self._file = self._file, None
        try:
            file.close()
        except OSError:
            pass

    def close(self, failed: bool = False) -> None:
        """Close the files and end each tracker's run (``failed``: the run ended in an error)."""
        if not self.enabled:
            return
        for tracker in self._trackers:
            try:
                tracker.close(failed)
            except Exception as err:  # noqa: BLE001 - closing never hides the run's own outcome
                log.warning("could not close the %s run (%s)", tracker.name, err)
        self._trackers = []
        if self._file is not None:
            self._close_file()
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as err:
                self._warn("TensorBoard events", err)


def _flatten(values: dict[str, Any], prefix: str = ""):
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, f"{name}/")
        else:
            yield name, value


def read_metrics(directory: str | Path) -> list[dict]:
    """All records of a run's ``metrics.jsonl``."""
    path = Path(directory) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
