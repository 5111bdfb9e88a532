"""Run metrics: JSON lines and TensorBoard scalars, written by rank 0 only.

Each logged step is one JSON object per line in ``metrics.jsonl`` (loss, tokens/s, samples/s,
per-module time, bubble fraction, balance statistics, peak memory, skipped samples, ...), and the
same numbers as TensorBoard scalars under their names when TensorBoard is installed and enabled.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Append-only metrics for one run.

    Args:
        directory: where ``metrics.jsonl`` and the TensorBoard events go.
        enabled: False on ranks other than 0 (then every call is a no-op).
        tensorboard: also write TensorBoard events.
    """

    def __init__(self, directory: str | Path, enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(directory) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(str(Path(directory) / "tensorboard"))

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record one step's values (nested dicts become ``a/b`` names in TensorBoard)."""
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **values}
        self._file.write(json.dumps(record, default=float) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in _flatten(values):
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


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
