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
  with its per-iteration balancing, run as a job runs by default (``parallel.schedule_search``
  auto: on CPU no per-batch order and sub-microbatch search, whose CPU would come out of the
  ranks' compute on this machine's shared cores).

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

Shared cores. The job's ranks outnumber this machine's cores, so the trainer simulates them sharing
the cores (`harmonia.train.backend.job_cluster`, `harmonia.sim.shared`): its fit is to the compute
actions' CPU seconds, and each rank's process's CPU outside them in the calibration step (the
prefetch thread preparing the next step, the optimizer, the collectives' threads) runs beside its
compute on the same cores; each run is simulated with its own such measurement.

With ``--diagnose`` two more variants run in turn with them (`DIAGNOSTIC`): harmonia's plan with
the per-batch search a GPU job runs, and harmonia's plan under the sequential assignment, to tell
which part of a gap between measured and simulated comes from where.

    nice -n 5 python benchmarks/measured_vs_simulated.py [--repeats 2] [--steps 12] [--diagnose] [--cluster cpu:1x2]
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from harmonia.config import Config, load_config
from harmonia.plan.scenario import Scenario
from harmonia.plan.search import search_plan
from harmonia.schedule.plan import Plan
from harmonia.train import run_training
from harmonia.train.backend import job_cluster, schedule_search
from harmonia.train.data import open_training_data, prepare_data
from harmonia.train.iteration import DataOrder, IterationBuilder
from harmonia.train.job import dataset_shapes
from harmonia.train.planning import _constraints, model_spec, search_training_plan, training_modes
from harmonia.train.rank import schedule_graph
from harmonia.workload.calibration import PHASES, Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "runs" / "bench" / "measured-vs-simulated"
WARMUP_STEPS = 3
"""Steps left out: step 0 (start-up), step 1 (the calibration step) and step 2 (prepared before it)."""
AGREEMENT = 0.10
AUTO = -1
"""``parallel.schedule_search`` as a job runs by default: 16 evaluations on GPUs, none on CPU
(`harmonia.train.backend.schedule_search`)."""
SEARCH_GPU = 16


@dataclass(frozen=True)
class Variant:
    """How a run trains: whose searched plan, the trainer's assignment, and its per-batch search."""

    plan: str
    assignment: str
    search: int = AUTO


VARIANTS = {"megatron": Variant("megatron", "sequential"), "harmonia": Variant("harmonia", "balanced")}
DIAGNOSTIC = {"harmonia, per-batch search as on GPUs": Variant("harmonia", "balanced", SEARCH_GPU),
              "harmonia's plan, sequential": Variant("harmonia", "sequential")}
"""With ``--diagnose``: harmonia's plan with the per-batch order and sub-microbatch search a GPU job
runs (every rank searches in its prefetch thread; here its CPU comes out of the ranks' compute),
and with the recipe's assignment (its schedule and layer split alone)."""


@dataclass
class Runs:
    """One plan's runs: measured and simulated seconds of each measured step."""

    name: str
    variant: Variant
    plan: Plan
    measured: list[float] = field(default_factory=list)
    own_fit: list[float] = field(default_factory=list)  # the trainer's simulated_step_s (its own calibration)
    pooled: list[float] = field(default_factory=list)  # simulated again with the pooled calibration
    pooled_busy: list[float] = field(default_factory=list)  # its compute seconds summed over ranks
    prepare_cpu: float = 0.0  # CPU seconds every rank's preparation of a step takes, summed over ranks
    calibrations: list[Path] = field(default_factory=list)
    configs: list[Config] = field(default_factory=list)
    module_s: dict[str, list[float]] = field(default_factory=dict)
    bubble: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)  # measured compute seconds summed over ranks


def job_config(name: str, steps: int, plan: str = "auto", variant: Variant = VARIANTS["harmonia"],
               cluster: str | None = None) -> Config:
    """The demo job on the benchmark's data, trained as ``variant`` says, logging under ``WORK / name``
    (on ``cluster``'s processes, default the demo's 4)."""
    run = WORK / name.replace(" ", "-").replace(",", "").replace("'", "")
    sized = ([f"--parallel.cluster={cluster}", f"--parallel.world_size={cluster_from_string(cluster).world_size}"]
             if cluster else [])
    return load_config(ROOT / "configs" / "demo.toml", [*sized,
        f"--data.path={WORK / 'data'}", "--data.heldout=0", f"--train.steps={steps}",
        f"--log.dir={run}", f"--checkpoint.dir={run / 'ck'}", "--checkpoint.every=0", "--checkpoint.resume=false",
        "--log.tensorboard=false", f"--parallel.plan={plan}", f"--train.assignment={variant.assignment}",
        f"--parallel.schedule_search={variant.search}"])


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
    (= the runs' simulated FLOPs over peak x their measured compute seconds, summed). Each run is
    then simulated with it and its own measured CPU outside compute (``host_cpu_s``: a measurement
    of that run's step, as its step time is, not a fitted rate)."""
    fits = [Calibration.load(p) for p in paths]
    seconds = [fit.measurements[0]["measured_compute_s"] for fit in fits]
    efficiency = sum(f.flops_efficiency["F"] * s for f, s in zip(fits, seconds)) / sum(seconds)
    return Calibration(fits[0].device, {p: efficiency for p in PHASES},
                       [m for f in fits for m in f.measurements])


def rank_builder(config: Config, plan: Plan, rank: int) -> IterationBuilder:
    """The iteration builder of ``rank`` as the trainer makes it (rank 0 simulates)."""
    spec = model_spec(config)
    dataset, shapes = open_training_data(config, spec, rank)
    cluster = job_cluster(config)
    return IterationBuilder(spec, plan, dataset, DataOrder(list(shapes), config.train.global_batch, config.train.seed),
                            CostModel(spec, cluster.device), cluster, schedule_graph(spec, plan), rank,
                            search_evaluations=schedule_search(config), simulate=rank == 0, shapes=shapes,
                            assignment=config.train.assignment)


def resimulate(config: Config, plan: Plan, steps: list[int], calibration: Calibration) -> list[tuple[float, float]]:
    """(simulated seconds, compute seconds summed over ranks) of ``steps`` as the trainer's rank 0
    prepares them, priced with ``calibration``."""
    builder = rank_builder(config, plan, 0)
    builder.calibrate(calibration)
    try:
        return [(t.iteration_s, sum(t.busy_s.values())) for t in (builder.build(k).predicted for k in steps)]
    finally:
        builder.close()


def preparation_cpu(config: Config, plan: Plan, steps: list[int]) -> float:
    """CPU seconds the ranks' preparations of one step take together (rank 0's, which simulates, plus
    rank 1's for every other rank), timed here in one process without contention."""
    total, threads = 0.0, torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of the job runs (`harmonia.train.worker`)
    try:
        for rank, copies in ((0, 1), (1, plan.world_size - 1)):
            builder = rank_builder(config, plan, rank)
            try:
                builder.build(steps[0] - 1)  # warm caches
                t0 = time.process_time()
                for k in steps:
                    builder.build(k)
                total += copies * (time.process_time() - t0) / len(steps)
            finally:
                builder.close()
    finally:
        torch.set_num_threads(threads)
    return total


def collect(runs: Runs, config: Config, records: list[dict]) -> None:
    """Keep one run's measured steps and check that the offline rebuild reproduces its simulated ones."""
    kept = [r for r in records if r["step"] >= WARMUP_STEPS]
    runs.measured += [r["step_s"] for r in kept]
    runs.own_fit += [r["simulated_step_s"] for r in kept]
    runs.bubble += [r["bubble_frac"] for r in kept]
    runs.busy += [(1 - r["bubble_frac"]) * runs.plan.world_size * r["step_s"] for r in kept]
    for r in kept:
        for m, s in r["time"].items():
            runs.module_s.setdefault(m, []).append(s)
    assert all(r["simulated_calibrated"] for r in kept), "a measured step was simulated before calibration"
    calibration = Path(config.log.dir) / "calibration.json"
    runs.calibrations.append(calibration)
    runs.configs.append(config)
    again = resimulate(config, runs.plan, [r["step"] for r in kept], Calibration.load(calibration))
    worst = max(abs(a / r["simulated_step_s"] - 1) for (a, _), r in zip(again, kept))
    assert worst < 1e-9, f"{config.log.dir}: the rebuilt steps simulate {worst:.2e} away from the trainer's"


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def spread(xs: list[float]) -> str:
    return f"{mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{mean(xs):.3f}"


def report(runs: dict[str, Runs], calibration: Calibration, load: tuple[str, str], args) -> str:
    """The tables as text."""
    out = io.StringIO()
    console = Console(file=out, width=150, force_terminal=False)
    m = runs["megatron"]
    table = Table(title=f"Measured vs simulated step time, tiny-omni on {m.plan.world_size} CPU processes (gloo), "
                  f"global batch 32 — timed under load (1-min load average {load[0]} before, {load[1]} after, on "
                  f"{os.cpu_count() or 1} shared cores)")
    for col in ("plan", "schedule", "assignment", "measured s/step", "simulated s/step (pooled fit)",
                "simulated s/step (run's own fit)", "bubble (measured)"):
        table.add_column(col, justify="left" if col in ("plan", "schedule", "assignment") else "right")
    for name, r in runs.items():
        llm, v = r.plan.layouts["llm"], r.variant
        search = schedule_search(r.configs[0])
        table.add_row(f"{name}: {r.plan.placement.value}, llm {llm.describe()}", r.plan.schedule,
                      f"{v.assignment}, {r.plan.n_microbatches} mb" + (f", search {search}" if search else ", no search"),
                      spread(r.measured), spread(r.pooled), spread(r.own_fit), f"{mean(r.bubble):.2f}")
    console.print(table)
    console.print(_ratios(runs))
    cores = os.cpu_count() or 1
    work = Table(title=f"Where the CPU goes per step: the job's {m.plan.world_size} ranks share {cores} cores")
    for col in ("plan", "compute s, all ranks (measured)", "compute s, all ranks (simulated, pooled fit)",
                "preparation CPU s, all ranks (timed alone)", "slowest rank's llm / vision / audio s (measured)"):
        work.add_column(col, justify="left" if col == "plan" else "right")
    for name, r in runs.items():
        work.add_row(name, spread(r.busy), spread(r.pooled_busy), f"{r.prepare_cpu:.3f}",
                     " / ".join(f"{mean(r.module_s[k]):.3f}" for k in r.module_s))
    console.print(work)
    console.print("Compute s: the compute actions' seconds (F, B, W, fused BW) summed over the ranks, measured as "
                  "wall time of each action (a rank descheduled mid-action counts); the simulator prices the same "
                  "FLOPs at one fitted rate and, where the ranks share cores, stretches each action by the "
                  "compute and other CPU running beside it. Preparation: one step "
                  "prepared by every rank's iteration builder (decoding its samples, balancing, the per-batch "
                  "search; rank 0 also simulates), CPU seconds timed here in one process; in training it runs in "
                  "each rank's prefetch thread on the same cores as the ranks' compute.", soft_wrap=True)
    if all(name in runs for name in DIAGNOSTIC):
        console.print(_diagnosis(runs))
    console.print(f"{args.repeats} runs per plan, alternated (ABCD DCBA ...), {args.steps} steps each, the first "
                  f"{WARMUP_STEPS} left out: {len(m.measured)} measured steps per plan. Pooled calibration: "
                  f"{calibration.flops_efficiency['F']:.5f} of the CPU device's peak, fitted on "
                  f"{len(calibration.measurements)} step-1 fits of the two plans' runs; own fits: "
                  + ", ".join(f"{n} {Calibration.load(p).flops_efficiency['F']:.5f}"
                              for n, r in runs.items() for p in r.calibrations) + ".", soft_wrap=True)
    return out.getvalue()


def _ratios(runs: dict[str, Runs]) -> Table:
    """megatron over harmonia (and over each diagnostic variant), measured and simulated."""
    ratios = Table(title="Step time ratios (a / b)")
    for col in ("a / b", "measured (± standard error)", "simulated (pooled fit)", "simulated (own fits)",
                "simulated / measured", f"agree within {AGREEMENT:.0%}"):
        ratios.add_column(col, justify="left" if col == "a / b" else "right")
    pairs = [("megatron", "harmonia")] + [("megatron", n) for n in runs if n not in VARIANTS]
    for a, b in pairs:
        ra, rb = runs[a], runs[b]
        measured = mean(ra.measured) / mean(rb.measured)
        pooled, own = mean(ra.pooled) / mean(rb.pooled), mean(ra.own_fit) / mean(rb.own_fit)
        gap = pooled / measured - 1
        ratios.add_row(f"{a} / {b}", f"{measured:.3f} ± {measured * _relative_error(ra.measured, rb.measured):.3f}",
                       f"{pooled:.3f}", f"{own:.3f}", f"{gap:+.1%}", "yes" if abs(gap) <= AGREEMENT else "no")
    return ratios


def _relative_error(a: list[float], b: list[float]) -> float:
    """Relative standard error of ``mean(a) / mean(b)`` (steps taken as independent)."""
    return ((statistics.stdev(a) / mean(a)) ** 2 / len(a) + (statistics.stdev(b) / mean(b)) ** 2 / len(b)) ** 0.5


def _diagnosis(runs: dict[str, Runs]) -> Table:
    """From the Megatron-LM recipe's run to harmonia's, one change at a time: what each costs or saves
    per step, measured and simulated (pooled fit)."""
    table = Table(title="From megatron to harmonia one change at a time: seconds per step each change adds")
    for col in ("change", "from", "to", "measured", "simulated (pooled fit)", "preparation CPU s, all ranks"):
        table.add_column(col, justify="left" if col in ("change", "from", "to") else "right")
    path = [("harmonia's schedule and layer split (zb, frozen-aware)", "megatron", "harmonia's plan, sequential"),
            ("per-iteration balancing (balancer's order, unsplit)", "harmonia's plan, sequential", "harmonia"),
            ("per-batch order and sub-microbatch search (as on GPUs)", "harmonia",
             "harmonia, per-batch search as on GPUs")]
    for change, a, b in path:
        ra, rb = runs[a], runs[b]
        table.add_row(change, a, b, f"{mean(rb.measured) - mean(ra.measured):+.3f}",
                      f"{mean(rb.pooled) - mean(ra.pooled):+.3f}", f"{rb.prepare_cpu - ra.prepare_cpu:+.3f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per variant, in turn, the order reversed every other round")
    parser.add_argument("--steps", type=int, default=12, help="steps per run")
    parser.add_argument("--diagnose", action="store_true", help="also run the `DIAGNOSTIC` variants")
    parser.add_argument("--cluster", default=None,
                        help="processes to train on, e.g. cpu:1x2 (default the demo's cpu:1x4); where they "
                        "outnumber this machine's cores the simulator shares the cores among them")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" /
                                             f"measured-vs-simulated-{datetime.date.today()}.txt"))
    args = parser.parse_args()
    base = job_config("search", args.steps, cluster=args.cluster)
    prepare_data(base)
    plans = search_plans(base)
    WORK.mkdir(parents=True, exist_ok=True)
    for name, plan in plans.items():
        plan.save(WORK / f"{name}-plan.json")
    variants = {**VARIANTS, **(DIAGNOSTIC if args.diagnose else {})}
    runs = {name: Runs(name, v, plans[v.plan]) for name, v in variants.items()}
    load_before = f"{os.getloadavg()[0]:.1f}"
    names = list(runs)
    order = [n for k in range(args.repeats) for n in (names if k % 2 == 0 else names[::-1])]
    losses = {}
    for k, name in enumerate(order):
        variant = runs[name].variant
        config = job_config(f"{name}-{k}", args.steps, str(WORK / f"{variant.plan}-plan.json"), variant, args.cluster)
        records = train(config)
        losses.setdefault(name, [r["loss"] for r in records])
        collect(runs[name], config, records)
        print(f"{name} run {k}: {mean([r['step_s'] for r in records[WARMUP_STEPS:]]):.3f} s/step", flush=True)
    load_after = f"{os.getloadavg()[0]:.1f}"
    worst = max(abs(a / b - 1) for name in names for a, b in zip(losses[name], losses["harmonia"]))
    assert worst <= 1e-5, f"the runs' losses differ by {worst:.1e}: not the same data stream"
    calibration = pooled_calibration([p for name in VARIANTS for p in runs[name].calibrations])
    for r in runs.values():
        for config, own in zip(r.configs, r.calibrations):
            records = [json.loads(line) for line in (Path(config.log.dir) / "metrics.jsonl").read_text().splitlines()]
            steps = [x["step"] for x in records if x["step"] >= WARMUP_STEPS]
            measured_host = replace(calibration, host_cpu_s=Calibration.load(own).host_cpu_s)
            for step_s, busy_s in resimulate(config, r.plan, steps, measured_host):
                r.pooled.append(step_s)
                r.pooled_busy.append(busy_s)
        r.prepare_cpu = preparation_cpu(r.configs[0], r.plan, list(range(WARMUP_STEPS, args.steps)))
    text = report(runs, calibration, (load_before, load_after), args)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
