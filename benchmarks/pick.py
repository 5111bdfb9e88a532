"""The planner's pick measured against plain data parallelism and against its own next two candidates.

For each job and process count, harmonia's search ranks its three best plans as ``harmonia train``
searches at start-up (``parallel.plan=auto``: the job's own sample shapes, the CPU device preset,
`harmonia.train.planning.search_training_plan` with ``top=3``), and a DDP-like plan is added: every
module replicated on every rank, colocated, one microbatch per replica (what DDP runs). Each plan is
written to a file and trained with ``harmonia train --parallel.plan=FILE`` for ``--steps`` steps, the
plans taking turns round after round (``--reps``). The LLM's pipeline degree is left to the search
(``parallel.llm_pp=0``; the demo's config pins 2).

Jobs: ``demo`` (`configs/demo.toml`: the tiny omni model, vision frozen, synthetic data, global
batch 32) and ``llava`` / ``varied`` (the tiny LLaVA of `benchmarks/peer.py`, vision frozen, on its
two datasets, global batch 8).

Columns: the search's score (its simulated iteration time on the CPU preset, before any
calibration; "-" for the DDP-like plan, which it does not rank), the measured step time (median of
each run's steps after the first two, median over runs), the simulated step time with the cost
model fitted to the run's own warm step (``simulated_step_s``), wall-clock samples/s of the training
window (``summary.json``, median over runs), and the rank by that rate. The pick should be the
fastest measured.

    python benchmarks/pick.py [--jobs demo,llava] [--processes 2,4] [--steps 20] [--reps 2] [--quick]

The table goes to stdout and (without ``--quick``) to ``benchmarks/results/pick-<date>.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def job_args(job: str, procs: int, work: Path, data: dict[str, Path], steps: int) -> list[str]:
    """The ``harmonia train`` arguments of one job (without plan and run directories)."""
    common = [f"--parallel.world_size={procs}", "--parallel.llm_pp=0", f"--train.steps={steps}",
              "--log.tensorboard=false", "--checkpoint.every=0"]
    if job == "demo":
        return ["--config", str(ROOT / "configs" / "demo.toml"), f"--data.path={data['demo']}", *common]
    toml = work / f"{job}.toml"
    toml.write_text(f'[model]\nhf = "{data["base"]}"\nfrozen = ["vision"]\n\n[data]\npath = "{data[job]}"\n\n'
                    "[train]\nglobal_batch = 8\nlr = 3e-3\nwarmup = 4\nlr_schedule = \"cosine\"\n"
                    "min_lr_ratio = 0.1\nseed = 0\n")
    return ["--config", str(toml), *common]


def run_dirs(work: Path, name: str) -> list[str]:
    return [f"--log.dir={work / name}", f"--checkpoint.dir={work / name / 'ck'}"]


def candidates(args: list[str], work: Path) -> list[tuple[str, object, float | None]]:
    """(label, plan, the search's iteration seconds) for the search's three best and the DDP-like plan."""
    from harmonia.config import load_config
    from harmonia.schedule.layout import Layout, Placement
    from harmonia.train.job import dataset_shapes, prepare_data
    from harmonia.train.planning import search_training_plan, with_world_size

    config = with_world_size(load_config(_config_file(args), _overrides(args) + run_dirs(work, "search")))
    prepare_data(config)
    report = search_training_plan(config, dataset_shapes(config), top=3)
    out = [(f"pick #{i}" if i > 1 else "pick", cand.plan, secs)
           for i, (secs, _, cand) in enumerate(report.ranked, 1)]
    pick = report.best
    ddp = dataclasses.replace(pick, layouts={m: Layout(dp=pick.world_size) for m in pick.layouts},
                              placement=Placement.COLOCATED, schedule="1f1b", n_microbatches=1, recompute=(),
                              recompute_fraction={})
    return out + [("DDP-like", ddp, None)]


def _config_file(args: list[str]) -> str:
    return args[args.index("--config") + 1]


def _overrides(args: list[str]) -> list[str]:
    i = args.index("--config")
    return args[:i] + args[i + 2:]


def train(args: list[str], plan_file: Path, work: Path, name: str, env: dict) -> dict:
    """One run; its measured and simulated step medians and wall-clock samples/s."""
    cmd = [sys.executable, "-m", "harmonia", "train", *args, f"--parallel.plan={plan_file}", *run_dirs(work, name)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    warm = records[2:] or records
    summary = json.loads((work / name / "summary.json").read_text())
    return {"step_s": statistics.median(r["step_s"] for r in warm),
            "sim_s": statistics.median(r["simulated_step_s"] for r in warm),
            "samples_per_s": summary["throughput"]["samples_per_s"]}


def measure(job: str, procs: int, a: argparse.Namespace, data: dict[str, Path], root: Path) -> list[dict]:
    from harmonia.plan.layout_text import describe_layouts

    work = root / f"{job}-{procs}"
    work.mkdir(parents=True, exist_ok=True)
    args = job_args(job, procs, work, data, a.steps)
    plans = candidates(args, work)
    rows = []
    for k, (label, plan, secs) in enumerate(plans):
        plan.save(work / f"plan-{k}.json")
        rows.append({"job": job, "procs": procs, "label": label, "search_s": secs, "runs": [],
                     "plan": f"{describe_layouts(plan.layouts)}; {plan.placement.value}; {plan.schedule}, "
                             f"{plan.n_microbatches} mb" + (f"; recompute {','.join(plan.recompute)}"
                                                            if plan.recompute else "")})
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for rep in range(a.reps):
        order = range(len(plans)) if rep % 2 == 0 else reversed(range(len(plans)))
        for k in order:
            rows[k]["runs"].append(train(args, work / f"plan-{k}.json", work, f"run-{k}-{rep}", env))
            print(f"{job} {procs}p {rows[k]['label']} rep {rep}: {rows[k]['runs'][-1]}", flush=True)
    for row in rows:
        for key in ("step_s", "sim_s", "samples_per_s"):
            row[key] = statistics.median(r[key] for r in row["runs"])
    for rank, row in enumerate(sorted(rows, key=lambda r: -r["samples_per_s"]), 1):
        row["measured_rank"] = rank
    return rows


def table(rows: list[dict]) -> str:
    head = ("job", "procs", "plan", "search ms", "step ms", "sim ms (fitted)", "samples/s", "measured rank", "layouts")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        search = "-" if r["search_s"] is None else f"{r['search_s'] * 1e3:.1f}"
        lines.append(" | ".join([r["job"], str(r["procs"]), r["label"], search, f"{r['step_s'] * 1e3:.1f}",
                                 f"{r['sim_s'] * 1e3:.1f}", f"{r['samples_per_s']:.1f}", str(r["measured_rank"]),
                                 r["plan"]]))
    verdicts = []
    for job, procs in dict.fromkeys((r["job"], r["procs"]) for r in rows):
        group = [r for r in rows if (r["job"], r["procs"]) == (job, procs)]
        pick = next(r for r in group if r["label"] == "pick")
        best = max(group, key=lambda r: r["samples_per_s"])
        verdicts.append(f"{job} {procs}p: pick {'is' if best is pick else 'is not'} the fastest measured "
                        f"({pick['samples_per_s'] / best['samples_per_s']:.2f}x the best samples/s, {best['label']})")
    return "\n".join(lines + [""] + verdicts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", default="demo,llava")
    p.add_argument("--processes", default="2,4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one round of 6 steps, demo at 2 processes; nothing saved")
    a = p.parse_args()
    if a.quick:
        a.jobs, a.processes, a.steps, a.reps = "demo", "2", 6, 1
    from benchmarks.peer import prepare

    with tempfile.TemporaryDirectory(prefix="harmonia-pick-") as tmp:
        root = Path(tmp)
        base, datasets = prepare(root / "peer", 160, 24)
        data = {"base": base, "demo": root / "demo-data", **{k: v / "train" / "llava.json" for k, v in datasets.items()}}
        rows = [row for job in a.jobs.split(",") for procs in map(int, a.processes.split(","))
                for row in measure(job, procs, a, data, root)]
    out = (f"# the planner's pick vs the DDP-like plan and its next two candidates, measured "
           f"({datetime.date.today()}; {a.steps} steps, {a.reps} rounds alternating; `python benchmarks/pick.py`)\n\n"
           + table(rows) + "\n")
    print(out)
    if not a.quick:
        path = ROOT / "benchmarks" / "results" / f"pick-{datetime.date.today()}.txt"
        path.write_text(out)
        print(f"saved {path}")


if __name__ == "__main__":
    main()
