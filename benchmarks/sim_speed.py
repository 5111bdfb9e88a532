"""Simulator speed: replay 100k tasks, render a 10k-task timeline, and search one batch's order.

Targets: 100k actions replayed in <= 1 s; per-batch schedule search within its 100 ms budget.

    python benchmarks/sim_speed.py
"""

from __future__ import annotations

import datetime
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from harmonia.schedule import CostTable, ModuleStages, PhaseCost, StageGraph
from harmonia.schedule.order_search import search_order
from harmonia.sim.engine import Task, replay
from harmonia.sim.timeline import plot_timeline

ROOT = Path(__file__).resolve().parents[1]


def chain(ranks: int, per_rank: int):
    tasks, order = [], {r: [] for r in range(ranks)}
    for r in range(ranks):
        for k in range(per_rank):
            deps = [(len(tasks) - per_rank, 1e-5)] if r > 0 else []
            order[r].append(len(tasks))
            tasks.append(Task(f"llm.r0.s{r}.F0.{k}", r, 1e-3, deps, "llm"))
    return tasks, order


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    console = Console(record=True, width=120)
    table = Table(title="simulator speed (best of 3, one core)")
    for col in ("what", "size", "seconds", "target"):
        table.add_column(col)
    tasks, order = chain(100, 1000)
    table.add_row("replay", "100,000 tasks", f"{best_of(lambda: replay(tasks, order)):.3f}", "<= 1.0")
    tl = replay(*chain(64, 160))
    with tempfile.TemporaryDirectory() as tmp:
        secs = best_of(lambda: plot_timeline(tl, Path(tmp) / "t.png"))
    table.add_row("PNG timeline", "10,240 tasks, 64 ranks", f"{secs:.3f}", "")
    graph = StageGraph((ModuleStages("vision", (0,), (False,)), ModuleStages("llm", (1, 2, 3, 4), (True,) * 4)))
    rng = np.random.default_rng(0)
    entries = {}
    for m in range(16):
        w = float(rng.lognormal(0, 0.6))
        entries[("vision", 0, m, None)] = PhaseCost(0.5 * w, 0, 0)
        for s in range(4):
            entries[("llm", s, m, None)] = PhaseCost(w, w, w)
    result = search_order(graph, CostTable(entries), 16, ("1f1b", "zb"), budget_s=0.1)
    table.add_row("order search", f"16 microbatches, 5 stages ({result.evaluated} schedules)",
                  f"{result.seconds:.3f}", "<= 0.1 + one schedule")
    console.print(table)
    out = ROOT / "benchmarks" / "results" / f"sim_speed-{datetime.date.today()}.txt"
    out.write_text(console.export_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
