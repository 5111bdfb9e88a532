"""The planner on the simulate benchmark's scenarios (configs/scenarios/*.toml), plus a 1024-GPU one.

For each scenario the planner searches harmonia's per-module layouts and, with the same search,
the best homogeneous plan (one layout for all modules: each encoder on the LLM's first pipeline
stage with its tp and dp). Both chosen plans then run the scenario's first ``--held-out`` sampled
iterations (batches the search never scored); the table shows the chosen layouts, their simulated
throughput on the search batches and on the held-out ones, and the search time (wall clock and
CPU time of the process and its planner workers, each search in a fresh process as `harmonia plan`
runs it, with its default workers: one per core this process may use, started once the costly
refinements have run `PARALLEL_AFTER_S` in one process). A last row times the search on 1024 GPUs:
scenario (b) on 128 nodes of 8 H100 with a 4x larger global batch; three more time `harmonia plan`
as a user runs it by default (`COMMAND`) on 64, 1024 and 4096 GPUs, two more the omni-72b command
(`OMNI_COMMAND`) on 1024 and 4096, and the last that 4096-GPU search again in one process
(``--workers 1``), for the workers' gain.

    python benchmarks/plan.py [--held-out N] [scenario.toml ...]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from saved import save_table

from harmonia.errors import LayoutError
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.refiners import PARALLEL_AFTER_S
from harmonia.plan.search import PlanReport, search_plan
from harmonia.train.backend import process_cores
from harmonia.workload.devices import cluster_from_string

ROOT = Path(__file__).resolve().parents[1]
LARGE = ("b-qwen72b-omni-256gpu.toml", "h100:128x8", 4)
"""The 1024-GPU row: scenario (b) on 128 nodes of 8, global batch scaled by 4."""
COMMAND = ("llava-siglip-8b", {"vision": "frozen"}, "../shared/traces/ai2d.csv", 512,
           ("h100:8x8", "h100:128x8", "h100:512x8"))
"""The rows of `harmonia plan --model llava-siglip-8b --frozen vision --trace ai2d.csv --global-batch
512` on 64, 1024 and 4096 GPUs, with the command's defaults (2 profiled batches, the best 3 ranked)."""
OMNI_COMMAND = ("omni-72b", {"vision": "frozen"}, "synthetic", 4096, ("h100:128x8", "h100:512x8"))
"""`harmonia plan --model omni-72b --cluster h100:128x8 --trace synthetic --global-batch 4096` (its
default training: the vision tower frozen), and on 4096 GPUs."""


def layout_text(report: PlanReport | None) -> str:
    if report is None:
        return "no plan fits device memory"
    plan = report.best
    mods = "; ".join(f"{m} {x.describe()}" for m, x in plan.layouts.items())
    return f"{plan.placement.value} {plan.schedule}x{plan.n_microbatches}: {mods}"


def timed_search(scenario: Scenario, homogeneous: bool = False, top: int = 1,
                 workers: int | None = None) -> tuple[PlanReport | None, float, float]:
    """The search's report (None when no plan fits), its wall-clock seconds and the CPU seconds of its
    process and planner workers, searched in a fresh process, as `harmonia plan` runs (the searches
    before it leave their caches in this one), with ``workers`` (default: `harmonia plan`'s)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_search_here, scenario, homogeneous, top, workers or process_cores()).result()


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _search_here(scenario: Scenario, homogeneous: bool, top: int,
                 workers: int) -> tuple[PlanReport | None, float, float]:
    wall, cpu, children = time.perf_counter(), time.process_time(), _children_cpu()
    try:
        report = search_plan(scenario, top=top, homogeneous=homogeneous, workers=workers)
    except LayoutError:
        report = None
    return report, time.perf_counter() - wall, time.process_time() - cpu + _children_cpu() - children


def rate_text(report: PlanReport | None) -> str:
    return f"{report.ranked[0][1]:.1f}" if report else "-"


def counts_text(report: PlanReport | None) -> str:
    return f"{report.simulated}/{report.pruned}" if report else "-"


def held_out_rate(run: ScenarioRun, report: PlanReport | None, n: int) -> float:
    """Samples/s of the chosen plan over the scenario's first ``n`` iterations (balancer's order)."""
    if report is None:
        return float("nan")
    cand = report.ranked[0][2]
    seconds = np.mean([run.timeline(cand, k, 0.0).iteration_s for k in range(n)])
    return run.scenario.global_batch / float(seconds)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", help="scenario TOML files (default: configs/scenarios/*.toml)")
    parser.add_argument("--held-out", type=int, default=4, help="held-out iterations each chosen plan runs")
    parser.add_argument("--commands", action="store_true",
                        help="only the rows of `harmonia plan` commands (COMMAND, OMNI_COMMAND)")
    args = parser.parse_args(argv)
    console = Console(record=True, width=250)
    files = [Path(p) for p in args.scenarios] or sorted((ROOT / "configs" / "scenarios").glob("*.toml"))
    files = [] if args.commands else files
    table = Table(title="planner: per-module layouts vs the best homogeneous plan, same search and simulator")
    for col in ("scenario", "GPUs", "chosen plan", "samples/s search", "held-out", "homogeneous plan",
                "samples/s search", "held-out", "gain", "search s (cpu)", "homog. s (cpu)", "simulated/pruned"):
        table.add_column(col, justify="left" if "plan" in col or col == "scenario" else "right")
    for path in files:
        scenario = Scenario.load(path)
        best, wall, cpu = timed_search(scenario)
        homog, h_wall, h_cpu = timed_search(scenario, homogeneous=True)
        run = ScenarioRun(scenario)
        n = min(args.held_out, scenario.iterations)
        rate, h_rate = held_out_rate(run, best, n), held_out_rate(run, homog, n)
        table.add_row(path.stem.split("-")[0], str(run.cluster.world_size), layout_text(best),
                      rate_text(best), f"{rate:.1f}", layout_text(homog), rate_text(homog),
                      f"{h_rate:.1f}", f"{rate / h_rate:.2f}x", f"{wall:.1f} ({cpu:.1f})", f"{h_wall:.1f} ({h_cpu:.1f})",
                      counts_text(best))
        console.print(f"{path.name}: searched in {wall:.1f} s wall, {cpu:.1f} s cpu", highlight=False)
    if not args.commands:
        name, cluster, scale = LARGE
        base = Scenario.load(ROOT / "configs" / "scenarios" / name)
        large = replace(base, name=base.name.replace("256", "1024"), cluster=cluster,
                        global_batch=base.global_batch * scale)
        best, wall, cpu = timed_search(large)
        table.add_row("b x4", "1024", layout_text(best), rate_text(best), "", "", "", "", "",
                      f"{wall:.1f} ({cpu:.1f})", "", counts_text(best))
    rows = [(*COMMAND, cluster, None) for cluster in COMMAND[-1]]
    rows += [(*OMNI_COMMAND, cluster, None) for cluster in OMNI_COMMAND[-1]]
    rows += [(*OMNI_COMMAND, OMNI_COMMAND[-1][-1], 1)]  # the largest again in one process
    for model, training, trace, batch, _, cluster, workers in rows:
        scenario = Scenario("plan", model, cluster, trace, batch, training, iterations=1, search_batches=2)
        best, wall, cpu = timed_search(scenario, top=3, workers=workers)
        gpus = cluster_from_string(cluster).world_size
        used = f", {best.workers} workers" if best and best.workers > 1 else ", 1 process"
        table.add_row(f"{model} top 3{used}", str(gpus), layout_text(best), rate_text(best), "", "", "", "", "",
                      f"{wall:.1f} ({cpu:.1f})", "", counts_text(best))
        console.print(f"{model} on {gpus} GPUs{used}: searched in {wall:.1f} s wall, {cpu:.1f} s cpu", highlight=False)
    console.print(table)
    console.print(f"{process_cores()} cores; planner workers start after {PARALLEL_AFTER_S:.0f} s of refinements in "
                  "one process; targets: search <= 10 s on 64 GPUs, <= 60 s on 1024 GPUs, <= 300 s on 4096 GPUs; "
                  f"'held-out' runs the scenario's first {args.held_out} sampled iterations, which the search never "
                  "scored")
    save_table(console, "plan")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
