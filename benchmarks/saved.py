"""Where every benchmark script writes its table: ``benchmarks/results/NAME-DATE.txt``."""

from __future__ import annotations

import datetime
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]


def save_table(console: Console, name: str) -> Path:
    """Write what ``console`` recorded to ``benchmarks/results/{name}-{today}.txt`` and say so."""
    out = ROOT / "benchmarks" / "results" / f"{name}-{datetime.date.today()}.txt"
    out.write_text(console.export_text(clear=False))  # a second save keeps what the first held
    console.print(f"saved {out.relative_to(ROOT)}")
    return out
