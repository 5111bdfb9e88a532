"""How far recomputation alone keeps each scenario from its lower bound.

The simulate benchmark's lower bound spreads an iteration's work evenly over every rank with no
recomputation. A plan that must recompute activations to fit device memory runs more work than
that bound counts: its backward runs the recomputed blocks' forward again. This script reads the
simulate benchmark's results, takes harmonia's chosen plan for each scenario, prices its
recomputation with the cost model on the scenario's mean sample (whole modules, one rank, no
parallelism: only the ratio is used), and prints

    work factor = (F + B + W with the plan's recompute) / (F + B + W without)

and the share of the bound the plan could reach at most with that recompute (1 / work factor),
beside the share it reaches (bound / its time) and that share over the cap. Whether the
recomputation is forced: harmonia's search again over the plans that recompute strictly less (no
module more, some module less), the best of them simulated on the scenario's iterations like the
chosen plan (its share of the bound), or why none can run (memory).

    python benchmarks/recompute_bound.py [benchmarks/results/simulate-DATE.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from saved import save_table

from harmonia.errors import LayoutError
from harmonia.plan.compare import averages
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import search_plan
from harmonia.schedule.plan import Plan, parse_recompute

ROOT = Path(__file__).resolve().parents[1]


def work_factor(run: ScenarioRun, recompute: list[str]) -> float:
    """Work with the plan's recompute over work without, on the scenario's mean sample."""
    modules, shares = parse_recompute(recompute)
    plain = again = 0.0
    for module in run.cost.layers:
        load = run.profile.sample_load(module)
        share = shares.get(module, 1.0) if module in modules else 0.0
        t = run.cost.stage_times(module, load)
        r = run.cost.stage_times(module, load, recompute=share) if share else t
        plain += t.F + t.B + t.W
        again += r.F + r.B + r.W
    return again / plain


def less_recompute(run: ScenarioRun, recompute: list[str], lower_bound_s: float) -> tuple[str, str]:
    """The best plan recomputing strictly less than ``recompute`` (its recompute and share of the
    bound over the scenario's iterations), or why there is none."""
    modules, shares = parse_recompute(recompute)
    chosen = {m: shares.get(m, 1.0) for m in modules}

    def accept(plan: Plan) -> str | None:
        mine = {m: plan.recompute_share(m) for m in run.cost.layers}
        if all(mine[m] <= chosen.get(m, 0.0) for m in mine) and any(mine[m] < chosen.get(m, 0.0) for m in mine):
            return None
        return "recomputes as much or more"

    try:
        report = search_plan(run.scenario, accept=accept)
    except LayoutError as err:
        return "none fits", str(err).split(";")[0].removeprefix("no plan fits: ")[:90]
    best = report.ranked[0][2]
    result = averages(run, best)
    return ",".join(best.plan.recompute_text()) or "none", f"{lower_bound_s / result.iteration_s:.1%}"


def main(argv: list[str]) -> int:
    results = Path(argv[0]) if argv else max((ROOT / "benchmarks" / "results").glob("simulate-20*-[0-9][0-9].json"))
    summary = json.loads(results.read_text())
    scenarios = {Scenario.load(p).name: p for p in sorted((ROOT / "configs" / "scenarios").glob("*.toml"))}
    console = Console(record=True, width=160)
    table = Table(title=f"recomputation against the lower bound ({results.name})")
    for col in ("scenario", "harmonia recompute", "work factor", "cap (1 / factor)", "bound / time", "of the cap",
                "less recompute", "its bound / time"):
        left = col in ("scenario", "harmonia recompute", "less recompute")
        table.add_column(col, justify="left" if left else "right")
    for name, entry in summary.items():
        plan = entry.get("harmonia", {})
        if name not in scenarios or "recompute" not in plan:
            continue
        run = ScenarioRun(Scenario.load(scenarios[name]))
        factor = work_factor(run, plan["recompute"])
        share = entry["bound_share"]["harmonia"]
        less, less_share = ("", "")
        if plan["recompute"]:
            less, less_share = less_recompute(run, plan["recompute"], entry["lower_bound_s"])
        table.add_row(name, ",".join(plan["recompute"]) or "none", f"{factor:.3f}", f"{1 / factor:.1%}",
                      f"{share:.1%}", f"{share * factor:.1%}", less, less_share)
        console.print(f"{name}: {less or 'no recompute'} {less_share}", highlight=False)
    console.print(table)
    save_table(console, "recompute-bound")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
