"""Recipes side by side on the published-evaluation scenarios (configs/scenarios/*.toml).

For each scenario every recipe searches its own best layout in the simulator, then runs the
scenario's sampled iterations; the table shows iteration time, throughput, speed-up over the
megatron recipe, bubble fraction, MFU (FLOPs under the attention mask, as executed), the share of
the lower bound each reaches (bound time / its time), the chosen plan and the search effort, plus
the lower bound (all work spread evenly over every rank). Where the model has encoders, a row
"harmonia, one layout" gives the best plan with one layout for all modules (each encoder on the
LLM's first pipeline stage with its tp and dp x cp), found by the same search and balanced the
same way: what harmonia's per-module layouts gain over it.

    python benchmarks/simulate.py [scenario.toml ...]
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from harmonia.errors import LayoutError
from harmonia.plan.compare import MFU_NOTE, RecipeResult, averages, run_recipe
from harmonia.plan.recipes import RECIPES, search_microbatch_order
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import search_plan
from harmonia.schedule.order_search import ReplayRate, search_order, search_submicrobatches
from harmonia.schedule.stagework import cost_table, iteration_schedule, plan_graph
from harmonia.sim.tasks import simulate_schedule, simulated_step

ROOT = Path(__file__).resolve().parents[1]


def times(a: float, b: float) -> str:
    """``a / b`` as a speed-up, or ``-`` when either side has no plan (NaN)."""
    return f"{a / b:.2f}x" if np.isfinite(a) and np.isfinite(b) else "-"


def plan_text(result) -> str:
    if result.candidate is None:
        why = "memory" if "memory" in result.error else result.error[:80]
        return f"no plan fits ({why})" if "fits" in result.error else result.error[:100]
    plan = result.candidate.plan
    mods = "; ".join(f"{m} {x.describe()}" for m, x in plan.layouts.items())
    recompute = f"; recompute {','.join(plan.recompute_text())}" if plan.recompute else ""
    return f"{plan.placement.value} {plan.schedule}x{plan.n_microbatches}: {mods}{recompute}"


def peak_text(run: ScenarioRun, result) -> str:
    """The most one rank holds over the scenario's iterations (states plus activations), marked
    ``over`` where some iteration exceeds the device: the search scores memory on its own batches
    only, and a heavier batch than those can need more."""
    capacity = run.cluster.device.mem_bytes
    return f"{result.peak_bytes / 2**30:.1f}" + (" over" if result.peak_bytes > capacity else "")


def one_layout(run: ScenarioRun):
    """harmonia's best plan with one layout for all modules, on the scenario's iterations (None for
    an LLM alone, whose every plan is one layout)."""
    if not run.mllm.encoders:
        return None
    t0 = time.perf_counter()
    try:
        report = search_plan(run.scenario, samples=run.samples, homogeneous=True)
    except LayoutError as err:
        return RecipeResult("harmonia, one layout", None, search_s=time.perf_counter() - t0, error=str(err))
    result = averages(run, report.ranked[0][2])
    result.recipe, result.tried, result.search_s = "harmonia, one layout", report.simulated, time.perf_counter() - t0
    return result


def order_search_ms(run: ScenarioRun, result, budget_s: float = 0.1) -> tuple[list[float], list[int]]:
    """Wall milliseconds of the per-batch schedule search (one order for every LLM replica) on each
    iteration, and the schedules it scored; one `ReplayRate` carries over iterations, as in the
    trainer."""
    cand, out, scored, rate = result.candidate, [], [], ReplayRate()
    for k in range(run.scenario.iterations):
        iw = run.iteration_work(cand, k)
        t0 = time.perf_counter()
        found = search_microbatch_order(cand.plan, run.cost, iw, budget_s, rate=rate)
        out.append(1e3 * (time.perf_counter() - t0))
        scored.append(found.evaluated)
    return out, scored


def sub_microbatch_gain(run: ScenarioRun, result) -> dict:
    """harmonia's plan on the scenario's iterations, each batch in the order the per-batch search
    finds (a fixed number of replays, so both runs use the same order), with each encoder split into
    the sub-microbatches the search chooses (items cut by cost, counts by the simulated step) and
    never split: mean iteration seconds, and in how many iterations some encoder was split."""
    cand, with_s, without_s, split = result.candidate, [], [], 0
    plan, cost = cand.plan, run.cost
    graph = plan_graph(plan, cost)
    for k in range(run.scenario.iterations):
        iw = run.iteration_work(cand, k)
        order = search_order(graph, cost_table(plan, iw), iw.n_microbatches, (plan.schedule,), budget_s=float("inf"),
                             max_evaluations=64).order
        chosen = search_submicrobatches(graph, plan, cost, iw, order, score=simulated_step(plan, cost, run.cluster))
        split += any(n > 1 for n in chosen.n_sub.values())
        for work, out in ((chosen.work, with_s), (iw, without_s)):
            schedule = iteration_schedule(plan, cost, work, order=order)
            out.append(simulate_schedule(plan, cost, run.cluster, work, schedule).iteration_s)
    return {"with_s": float(np.mean(with_s)), "without_s": float(np.mean(without_s)), "split_iterations": split}


def main(paths: list[str]) -> int:
    console = Console(record=True, width=180)
    files = [Path(p) for p in paths] or sorted((ROOT / "configs" / "scenarios").glob("*.toml"))
    summary = {}
    for path in files:
        scenario = Scenario.load(path)
        t0 = time.perf_counter()
        run = ScenarioRun(scenario)
        results = {r: run_recipe(run, r) for r in RECIPES}
        homogeneous = one_layout(run)
        if homogeneous is not None:
            results[homogeneous.recipe] = homogeneous
        bound = float(run.profile.batch_costs[: scenario.iterations].sum(axis=1).mean()) / run.cluster.compute_units
        table = Table(title=f"{scenario.name} — {scenario.iterations} iterations of {scenario.global_batch} "
                            f"samples ({time.perf_counter() - t0:.0f} s)")
        for col in ("recipe", "iteration s", "samples/s", "vs megatron", "bubble", "MFU", "bound / time",
                    "peak GiB", "plan", "searched"):
            table.add_column(col, justify="left" if col in ("recipe", "plan") else "right")
        base = results["megatron"].iteration_s  # NaN when no megatron plan fits
        fitted = [results[r].iteration_s for r in ("megatron", "cornstarch", "disttrain") if results[r].candidate]
        others = min(fitted, default=float("nan"))
        for name, r in results.items():
            if r.candidate is None:
                table.add_row(name, "-", "-", "-", "-", "-", "-", "-", plan_text(r), f"{r.tried} in {r.search_s:.1f}s")
                continue
            table.add_row(name, f"{r.iteration_s:.3f}", f"{r.samples_per_s:.1f}", times(base, r.iteration_s),
                          f"{r.bubble_frac:.1%}", f"{r.mfu:.1%}", f"{bound / r.iteration_s:.1%}", peak_text(run, r),
                          plan_text(r), f"{r.tried} in {r.search_s:.1f}s")
        table.add_row("lower bound", f"{bound:.3f}", f"{scenario.global_batch / bound:.1f}",
                      times(base, bound), "0.0%", "", "100%", "", "all work spread evenly over every rank", "")
        console.print(table)
        console.print(MFU_NOTE)
        h = results["harmonia"].iteration_s
        if results["harmonia"].candidate:
            console.print(f"harmonia vs megatron {times(base, h)} (target 1.40x); vs best other baseline "
                          f"{times(others, h)} (target 1.15x); {bound / h:.1%} of the lower bound"
                          + (f"; per-module layouts vs the best one layout {times(homogeneous.iteration_s, h)}"
                             if homogeneous is not None and homogeneous.candidate else ""))
        search_ms, scored = [float("nan")], [0]
        if results["harmonia"].candidate:
            search_ms, scored = order_search_ms(run, results["harmonia"])
            console.print(f"per-batch schedule search on {run.cluster.world_size} GPUs "
                          f"({results['harmonia'].candidate.plan.layouts['llm'].dp} LLM replicas): mean "
                          f"{np.mean(search_ms):.0f} ms, max {max(search_ms):.0f} ms (budget 100 ms), "
                          f"{np.mean(scored):.0f} schedules scored per batch")
        subs = sub_microbatch_gain(run, results["harmonia"]) if results["harmonia"].candidate else {}
        if subs:
            console.print(f"encoder sub-microbatches chosen per batch by cost: {subs['with_s']:.3f} s vs "
                          f"{subs['without_s']:.3f} s never split ({times(subs['without_s'], subs['with_s'])}); "
                          f"some encoder split in {subs['split_iterations']} of {scenario.iterations} iterations\n")
        summary[scenario.name] = {r: v.as_dict() for r, v in results.items()} | {
            "lower_bound_s": bound, "bound_share": {r: bound / v.iteration_s for r, v in results.items()},
            "order_search_ms": search_ms, "sub_microbatches": subs}
    stamp = f"{datetime.date.today()}" + ("" if not paths else "-" + "-".join(f.stem.split("-")[0] for f in files))
    out = ROOT / "benchmarks" / "results"
    (out / f"simulate-{stamp}.txt").write_text(console.export_text())
    (out / f"simulate-{stamp}.json").write_text(json.dumps(summary, indent=1))
    console.print(f"saved benchmarks/results/simulate-{stamp}.txt and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
