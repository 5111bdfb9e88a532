"""The per-batch schedule search's time on pipelined plans (configs/scenarios/*.toml).

The trainer searches each iteration's microbatch order one step ahead, within a budget of 100 ms
per batch. Where harmonia's best plan has no pipeline (`pp1`), there is nothing to order and the
simulate benchmark's row says 0-1 ms; this script keeps the budget measured where it binds: for
each scenario it searches harmonia's best plan whose LLM is pipelined (``pp >= 2``), then times the
search on the scenario's sampled iterations (wall milliseconds per batch, schedules scored), as
the simulate benchmark does.

    python benchmarks/order_search.py [scenario.toml ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from rich.console import Console
from rich.table import Table
from saved import save_table
from simulate import order_search_ms

from harmonia.errors import LayoutError
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import search_plan

ROOT = Path(__file__).resolve().parents[1]
BUDGET_MS = 100.0


def pipelined(plan) -> str | None:
    """The search's filter: only plans whose LLM runs on two pipeline stages or more."""
    return None if plan.layouts["llm"].pp >= 2 else "LLM not pipelined"


def main(paths: list[str]) -> int:
    console = Console(record=True, width=160)
    files = [Path(p) for p in paths] or sorted((ROOT / "configs" / "scenarios").glob("*.toml"))
    table = Table(title="per-batch schedule search on harmonia's best pipelined plan (budget 100 ms per batch)")
    for col in ("scenario", "GPUs", "plan", "LLM replicas", "mean ms", "max ms", "schedules per batch"):
        table.add_column(col, justify="left" if col in ("scenario", "plan") else "right")
    worst = 0.0
    for path in files:
        scenario = Scenario.load(path)
        run = ScenarioRun(scenario)
        t0 = time.perf_counter()
        try:
            report = search_plan(scenario, samples=run.samples, accept=pipelined)
        except LayoutError:
            table.add_row(path.stem.split("-")[0], str(run.cluster.world_size), "no pipelined plan fits", "", "",
                          "", "")
            continue
        cand = report.ranked[0][2]
        ms, scored = order_search_ms(run, SimpleNamespace(candidate=cand))
        worst = max(worst, max(ms))
        plan = cand.plan
        text = f"{plan.schedule}x{plan.n_microbatches}: llm {plan.layouts['llm'].describe()}"
        table.add_row(path.stem.split("-")[0], str(run.cluster.world_size), text, str(plan.layouts["llm"].dp),
                      f"{np.mean(ms):.0f}", f"{max(ms):.0f}", f"{np.mean(scored):.0f}")
        console.print(f"{path.name}: searched in {time.perf_counter() - t0:.1f} s")
    console.print(table)
    console.print(f"largest per-batch search {worst:.0f} ms (budget {BUDGET_MS:.0f} ms, wall clock on this machine, "
                  "while nothing else ran)")
    save_table(console, "order-search")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
