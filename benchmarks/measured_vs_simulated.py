"""Measured against simulated: does the simulator rank the Megatron-LM recipe's plan and harmonia's as
training does?

The demo's job (`configs/demo.toml`: tiny-omni, vision and audio encoders, projectors, LLM; vision
frozen; 4 CPU processes on gloo, LLM pipelined over 2 stages, global batch 32) is trained for a few
steps under two plans, searched on the job's own data with the same constraints:

- ``megatron``: the Megatron-LM recipe's best plan (`harmonia.plan.recipes`, ``recipe="megatron"``):
  both encoders inside the LLM's first pipeline stage (on its ranks, with the LLM's dp), layers split
  evenly, run with ``train.assignment=sequential``: fixed-size microbatches in data order, no
  balancing, no order search, no sub-microbatches. The trainer runs the encoders' actions beside the
  LLM's on those ranks rather than fused into its first stage; the simulated step is of the same
  action lists the ranks run, so the comparison stays like for like.
- ``harmonia``: what ``parallel.plan=auto`` picks (`harmonia.train.planning.search_training_plan`),
  with its per-iteration balancing, order search and sub-microbatch split.

Both runs train the same data stream (same dataset, global batch and seed; their losses are equal
step by step) and are timed alternately (megatron, harmonia, harmonia, megatron, ...), so a change of
the machine's load during the benchmark weighs on both alike. A step's time is the trainer's
``step_s`` (forward, backward and optimizer of every rank; the next step's preparation runs beside it
in the prefetch thread); the first `WARMUP_STEPS` steps are left out (start-up, and the steps whose
simulation the prefetcher priced before the trainer's calibration existed).

Fair calibration. The trainer fits one efficiency factor (achieved fraction of the device's peak) to
the compute actions of its step 1 (`harmonia.train.calibrate`); each run fits its own, so the ratio
of the two runs' simulated steps would also carry the difference between two fits taken under
different load. Here one calibration serves both plans: the pooled fit over every run's step 1,
``sum(simulated FLOPs) / (peak x sum(measured compute s))`` (each run's efficiency weighted by its
measured compute seconds), so the factor is fitted on both plans' work alike and favours neither.
Each run's measured steps are then simulated again with it: the iteration builder of rank 0, rebuilt
here with the run's config and plan, prepares exactly the trainer's steps (the same assignment,
order search, split and action lists; checked by reproducing the trainer's own simulated steps from
its own calibration) and prices them with the pooled calibration. The trainer's own-fit figures are
shown too.

    nice -n 5 python benchmarks/measured_vs_simulated.py [--repeats 2] [--steps 12]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harmonia.config import Config, load_config
from harmonia.plan.scenario import Scenario
from harmonia.plan.search import search_plan
from harmonia.schedule.plan import Plan
from harmonia.train import run_training
from harmonia.train.data import open_training_data, prepare_data
from harmonia.train.iteration import DataOrder, IterationBuilder
from harmonia.train.job import dataset_shapes
from harmonia.train.planning import _constraints, model_spec, search_training_plan, training_modes
from harmonia.train.rank import schedule_graph
from harmonia.workload.cost import PHASES, Calibration, CostModel
from harmonia.workload.devices import cluster_from_string

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "runs" / "bench" / "measured-vs-simulated"
WARMUP_STEPS = 3
"""Steps left out: step 0 (start-up), step 1 (the calibration step) and step 2 (prepared before it)."""
AGREEMENT = 0.10
ASSIGNMENT = {"megatron": "sequential", "harmonia": "balanced"}


@dataclass
class Runs:
    """One plan's runs: measured and simulated seconds of each measured step."""

    name: str
    plan: Plan
    measured: list[float] = field(default_factory=list)
    own_fit: list[float] = field(default_factory=list)  # the trainer's simulated_step_s (its own calibration)
    pooled: list[float] = field(default_factory=list)  # simulated again with the pooled calibration
    calibrations: list[Path] = field(default_factory=list)
    configs: list[Config] = field(default_factory=list)
    module_s: dict[str, list[float]] = field(default_factory=dict)
    bubble: list[float] = field(default_factory=list)


def job_config(name: str, steps: int, plan: str = "auto", assignment: str = "balanced") -> Config:
    """The demo job on the benchmark's data, logging under ``WORK / name``."""
    run = WORK / name
    return load_config(ROOT / "configs" / "demo.toml", [
        f"--data.path={WORK / 'data'}", "--data.heldout=0", f"--train.steps={steps}",
        f"--log.dir={run}", f"--checkpoint.dir={run / 'ck'}", "--checkpoint.every=0", "--checkpoint.resume=false",
        "--log.tensorboard=false", f"--parallel.plan={plan}", f"--train.assignment={assignment}"])


def search_plans(config: Config) -> dict[str, Plan]:
    """harmonia's plan (what ``parallel.plan=auto`` runs) and the Megatron-LM recipe's, on the job's data."""
    shapes = dataset_shapes(config)
    scenario = Scenario(name="train", model=config.model.source, cluster=config.parallel.cluster,
                        trace=config.data.path, global_batch=config.train.global_batch,
                        training=training_modes(config), iterations=2, search_batches=2, seed=config.train.seed)
    megatron = search_plan(scenario, accept=_constraints(config), samples=shapes, recipe="megatron").best
    return {"megatron": megatron, "harmonia": search_training_plan(config, shapes).best}


def train(config: Config) -> list[dict]:
    """Run the job (its own processes); rank 0's per-step records."""
    shutil.rmtree(config.log.dir, ignore_errors=True)
    result = run_training(config, Console(file=io.StringIO()))
    return result.records


def pooled_calibration(paths: list[Path]) -> Calibration:
    """One calibration from every run's step-1 fit: efficiencies weighted by measured compute seconds
    (= the runs' simulated FLOPs over peak x their measured compute seconds, summed)."""
    fits = [Calibration.load(p) for p in paths]
    seconds = [fit.measurements[0]["measured_compute_s"] for fit in fits]
    efficiency = sum(f.flops_efficiency["F"] * s for f, s in zip(fits, seconds)) / sum(seconds)
    return Calibration(fits[0].device, {p: efficiency for p in PHASES},
                       [m for f in fits for m in f.measurements])


def resimulate(config: Config, plan: Plan, steps: list[int], calibration: Calibration) -> list[float]:
    """The simulated seconds of ``steps`` as the trainer's rank 0 prepares them, priced with ``calibration``."""
    spec = model_spec(config)
    dataset, shapes = open_training_data(config, spec, 0)
    cluster = cluster_from_string(config.parallel.cluster)
    builder = IterationBuilder(spec, plan, dataset, DataOrder(list(shapes), config.train.global_batch,
                                                              config.train.seed),
                               CostModel(spec, cluster.device), cluster, schedule_graph(spec, plan), 0,
                               search_evaluations=config.parallel.schedule_search, simulate=True, shapes=shapes,
                               assignment=config.train.assignment)
    builder.calibrate(calibration)
    try:
        return [builder.build(k).predicted.iteration_s for k in steps]
    finally:
        builder.close()


def collect(runs: Runs, config: Config, records: list[dict]) -> None:
    """Keep one run's measured steps and check that the offline rebuild reproduces its simulated ones."""
    kept = [r for r in records if r["step"] >= WARMUP_STEPS]
    runs.measured += [r["step_s"] for r in kept]
    runs.own_fit += [r["simulated_step_s"] for r in kept]
    runs.bubble += [r["bubble_frac"] for r in kept]
    for r in kept:
        for m, s in r["time"].items():
            runs.module_s.setdefault(m, []).append(s)
    assert all(r["simulated_calibrated"] for r in kept), "a measured step was simulated before calibration"
    calibration = Path(config.log.dir) / "calibration.json"
    runs.calibrations.append(calibration)
    runs.configs.append(config)
    again = resimulate(config, runs.plan, [r["step"] for r in kept], Calibration.load(calibration))
    worst = max(abs(a / r["simulated_step_s"] - 1) for a, r in zip(again, kept))
    assert worst < 1e-9, f"{config.log.dir}: the rebuilt steps simulate {worst:.2e} away from the trainer's"


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def spread(xs: list[float]) -> str:
    return f"{mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{mean(xs):.3f}"


def report(runs: dict[str, Runs], calibration: Calibration, load: tuple[str, str], args) -> str:
    """The tables as text."""
    out = io.StringIO()
    console = Console(file=out, width=150, force_terminal=False)
    m, h = runs["megatron"], runs["harmonia"]
    table = Table(title="Measured vs simulated step time, tiny-omni on 4 CPU processes (gloo), global batch 32 — "
                  f"timed under load (1-min load average {load[0]} before, {load[1]} after, on 2 shared cores)")
    for col in ("plan", "schedule", "assignment", "measured s/step", "simulated s/step (pooled fit)",
                "simulated s/step (run's own fit)", "bubble (measured)"):
        table.add_column(col, justify="left" if col in ("plan", "schedule", "assignment") else "right")
    for name, r in runs.items():
        llm = r.plan.layouts["llm"]
        table.add_row(f"{name}: {r.plan.placement.value}, llm {llm.describe()}", r.plan.schedule,
                      f"{ASSIGNMENT[name]}, {r.plan.n_microbatches} mb", spread(r.measured), spread(r.pooled),
                      spread(r.own_fit), f"{mean(r.bubble):.2f}")
    console.print(table)
    measured, pooled, own = (mean(m.measured) / mean(h.measured), mean(m.pooled) / mean(h.pooled),
                             mean(m.own_fit) / mean(h.own_fit))
    ratios = Table(title="megatron / harmonia step time")
    for col in ("measured", "simulated (pooled fit)", "simulated (own fits)", "simulated / measured",
                f"agree within {AGREEMENT:.0%}"):
        ratios.add_column(col, justify="right")
    gap = pooled / measured - 1
    ratios.add_row(f"{measured:.3f}", f"{pooled:.3f}", f"{own:.3f}", f"{gap:+.1%}",
                   "yes" if abs(gap) <= AGREEMENT else "no")
    console.print(ratios)
    modules = Table(title="Slowest rank's seconds per module per measured step (trainer's 'time' field)")
    modules.add_column("plan")
    names = list(m.module_s)
    for name in names:
        modules.add_column(name, justify="right")
    for name, r in runs.items():
        modules.add_row(name, *(f"{mean(r.module_s[k]):.3f}" for k in names))
    console.print(modules)
    console.print(f"{args.repeats} runs per plan, alternated (ABBA), {args.steps} steps each, the first "
                  f"{WARMUP_STEPS} left out: {len(m.measured)} measured steps per plan. Pooled calibration: "
                  f"{calibration.flops_efficiency['F']:.5f} of the CPU device's peak, fitted on "
                  f"{len(calibration.measurements)} step-1 fits of both plans; own fits: "
                  + ", ".join(f"{n} {Calibration.load(p).flops_efficiency['F']:.5f}"
                              for n, r in runs.items() for p in r.calibrations) + ".", soft_wrap=True)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per plan, alternated ABBA")
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                             f"measured-vs-simulated-{datetime.date.today()}.txt"))
    args = parser.parse_args()
    base = job_config("search", args.steps)
    prepare_data(base)
    plans = search_plans(base)
    WORK.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, plan in plans.items():
        plan.save(WORK / f"{name}-plan.json")
        runs[name] = Runs(name, plan)
    load_before = f"{os.getloadavg()[0]:.1f}"
    order = [n for k in range(args.repeats) for n in (("megatron", "harmonia") if k % 2 == 0 else
                                                        ("harmonia", "megatron"))]
    losses = {}
    for k, name in enumerate(order):
        config = job_config(f"{name}-{k}", args.steps, str(WORK / f"{name}-plan.json"), ASSIGNMENT[name])
        records = train(config)
        losses.setdefault(name, [r["loss"] for r in records])
        collect(runs[name], config, records)
        print(f"{name} run {k}: {mean([r['step_s'] for r in records[WARMUP_STEPS:]]):.3f} s/step", flush=True)
    load_after = f"{os.getloadavg()[0]:.1f}"
    worst = max(abs(a / b - 1) for a, b in zip(losses["megatron"], losses["harmonia"]))
    assert worst <= 1e-5, f"the two plans' losses differ by {worst:.1e}: not the same data stream"
    calibration = pooled_calibration([p for r in runs.values() for p in r.calibrations])
    for r in runs.values():
        for config in r.configs:
            records = [json.loads(line) for line in (Path(config.log.dir) / "metrics.jsonl").read_text().splitlines()]
            steps = [x["step"] for x in records if x["step"] >= WARMUP_STEPS]
            r.pooled += resimulate(config, r.plan, steps, calibration)
    text = report(runs, calibration, (load_before, load_after), args)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
