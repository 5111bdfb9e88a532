"""Soak benchmark: a long CPU run keeps every rank's resident memory flat and its step time steady.

The demo job (tiny omni MLLM, 4 processes, the searched plan) trains ``--steps`` steps (default
1,000) with checkpoints every ``--every`` steps. Every step's record in ``metrics.jsonl`` carries
each rank's resident memory (``rss_bytes``, read from ``/proc/self/statm`` after the step). The table
compares step 100 with the last step per rank (target: within 5%) and the median step time of the
second hundred steps with the last hundred's.

Run: ``python benchmarks/soak.py [--steps N]``; the table goes to stdout and to
``benchmarks/results/soak-<date>.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harmonia.cli import DEMO_OVERRIDES
from harmonia.config import load_config
from harmonia.train import run_training

RESULTS = Path(__file__).resolve().parent / "results"


def run(steps: int, every: int, out: Path) -> list[dict]:
    config = load_config(None, [*DEMO_OVERRIDES, f"--train.steps={steps}", f"--checkpoint.every={every}",
                                f"--data.path={out / 'data'}", f"--log.dir={out / 'run'}",
                                f"--checkpoint.dir={out / 'run' / 'ck'}", "--log.tensorboard=false"])
    run_training(config, Console(file=io.StringIO()))
    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def table(records: list[dict], steps: int) -> Table:
    by_step = {r["step"]: r for r in records}
    early, last = by_step[min(100, steps - 1)], by_step[steps - 1]
    t = Table(title=f"soak: demo job, {steps} steps on 4 CPU processes")
    for col in ("rank", f"RSS step {early['step']} (MiB)", f"RSS step {last['step']} (MiB)", "change", "target"):
        t.add_column(col)
    for rank, (a, b) in enumerate(zip(early["rss_bytes"], last["rss_bytes"])):
        t.add_row(str(rank), f"{a / 2**20:.1f}", f"{b / 2**20:.1f}", f"{(b - a) / a:+.1%}", "within 5%")
    second = [by_step[s]["step_s"] for s in range(100, min(200, steps))]
    final = [by_step[s]["step_s"] for s in range(max(0, steps - 100), steps)]
    if second and final:
        a, b = statistics.median(second), statistics.median(final)
        t.add_row("step time", f"{a * 1e3:.1f} ms (steps 100-199)", f"{b * 1e3:.1f} ms (last 100)",
                  f"{(b - a) / a:+.1%}", "steady")
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=250, help="checkpoint every N steps")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        records = run(a.steps, a.every, Path(tmp))
    console = Console(record=True, width=120)
    console.print(table(records, a.steps))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"soak-{datetime.date.today()}.txt"
    path.write_text(console.export_text())
    print(f"saved {path}")


if __name__ == "__main__":
    main()
