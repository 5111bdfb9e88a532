"""`harmonia simulate` and `harmonia plan`: scenarios from a job's flags, the recipes' comparison
and a given plan's score, the plan search and its table."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from harmonia.cli.job import console, PROJECT, SHARED_TRACES, _job_config, _job_given

def _plan_summary(d: dict) -> str:
    """A recipe result's plan as `harmonia simulate --layout` reads it, with placement, schedule and recompute."""
    if "plan" not in d:
        return d.get("error", "")
    from harmonia.schedule.layout import Layout

    parts = [f"{m} " + Layout(tp=x["tp"], cp=x["cp"], dp=x["dp"], pp=x["pp"], virtual_stages=x["virtual_stages"],
                              fsdp=x["fsdp"], reshard=x.get("reshard", False)).describe() for m, x in d["plan"].items()]
    recompute = f"; recompute {','.join(d['recompute'])}" if d.get("recompute") else ""
    return f"{d['placement']}, {d['schedule']} x{d['n_microbatches']}: " + "; ".join(parts) + recompute


DEFAULT_SCENARIO = "configs/scenarios/d-qwen7b-internvit-8gpu.toml"
DEVICE_SET_HELP = ("replace fields of the cluster's device preset, comma-separated FIELD=VALUE, e.g. "
                   "flops_efficiency=0.55 (a matmul rate measured on your own runs, as benchmarks/fidelity.py fits the "
                   "H100 preset's to published ones; a scenario file's device table does the same)")
DEFAULT_TRACE = str(SHARED_TRACES / "ai2d.csv")


def trace_path(trace: str) -> str:
    """A ``--trace`` as a scenario holds it: a CSV path given on the command line is the user's, from
    their working directory (a scenario file's relative paths are the project's); a shared trace's
    name (``ai2d``, ``chartqa``: a CSV in ../shared/traces) where no such file is there; a generated
    trace as written."""
    from harmonia.workload.traces import is_generated

    if is_generated(trace):
        return trace
    path, shared = Path(trace), SHARED_TRACES / f"{trace}.csv"
    if not path.exists() and path.name == trace and shared.is_file():
        return str(shared)
    return str(path.resolve())


def _scenario(args: argparse.Namespace, plan=None) -> tuple:
    """The scenario `simulate` runs: a scenario file, or the job's config fields and flags with a trace
    (`_job_config`; a given plan supplies its model, batch and training modes where they do not), and
    the shapes of the job's own dataset where it is profiled instead of a trace (`_profiled_data`; else
    None)."""
    import dataclasses

    from harmonia.errors import ConfigError
    from harmonia.plan.scenario import Scenario, parse_device_changes

    given = _job_given(args) + (["--trace"] if args.trace is not None else [])
    if args.scenario and given:
        raise ConfigError(f"--scenario and {', '.join(given)} both given; describe the scenario with a file or "
                          "with a config and flags, not both")
    shapes = None
    if args.scenario or not (given or plan):
        scenario = Scenario.load(args.scenario or str(PROJECT / DEFAULT_SCENARIO))
    else:
        config = _job_config(args, plan)
        trace, shapes = _profiled_data(args, config)
        scenario = Scenario("simulate", config.model.source, config.parallel.cluster, trace, config.train.global_batch,
                            config.model.training_modes, seed=config.train.seed,
                            mixed_precision=config.train.mixed_precision)
    if args.sequence_parallel:
        scenario = dataclasses.replace(scenario, sequence_parallel=True)
    if args.device_set:
        scenario = dataclasses.replace(scenario, device={**scenario.device, **parse_device_changes(args.device_set)})
    if args.fsdp_per_microbatch:
        scenario = dataclasses.replace(scenario, fsdp_per_microbatch=True)
    if plan is not None and plan.global_batch != scenario.global_batch:
        raise ConfigError(f"the plan's global batch is {plan.global_batch} but the scenario's is "
                          f"{scenario.global_batch}; give --global-batch {plan.global_batch} or another plan")
    return (dataclasses.replace(scenario, iterations=args.iterations) if args.iterations else scenario), shapes


def _given_plan(args: argparse.Namespace, run):
    """The plan `--layout` describes on the scenario's cluster and model (None without one)."""
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts

    recompute = tuple(filter(None, args.recompute.split(",")))
    training = {m: t.mode.value for m, t in run.mllm.training.items()}
    schedule = None if args.schedule in (None, "auto") else args.schedule
    return plan_from_layouts(run.mllm, run.scenario.model, parse_layouts(args.layout), run.cluster.world_size,
                             run.scenario.global_batch, args.microbatch_size, schedule, recompute, training)


def _check_world(scenario, plan, layout: str | None) -> None:
    """Refuse a given plan or layout that does not fill the scenario's cluster before its trace is
    loaded, naming both sizes."""
    from harmonia.errors import LayoutError
    from harmonia.plan.layout_text import parse_layouts, place_layouts
    from harmonia.workload.devices import cluster_from_string

    world = cluster_from_string(scenario.cluster).world_size
    if layout:
        place_layouts(parse_layouts(layout), world)
    if plan is not None and plan.world_size != world:
        raise LayoutError(f"the plan uses {plan.world_size} ranks but cluster {scenario.cluster} has {world}; give "
                          "a cluster of the plan's size")


def cmd_simulate(args: argparse.Namespace) -> int:
    """Score a given plan (--plan, --layout), or run a scenario under each recipe and compare them."""
    from harmonia.errors import ConfigError
    from harmonia.plan.compare import MFU_NOTE, run_recipe, score_plan
    from harmonia.plan.recipes import RECIPES
    from harmonia.plan.scenario import ScenarioRun
    from harmonia.schedule.plan import Plan

    if args.plan and args.layout:
        raise ConfigError("--plan and --layout both given; score one plan at a time")
    loaded = Plan.load(args.plan) if args.plan else None
    scenario, shapes = _scenario(args, loaded)
    _check_world(scenario, loaded, args.layout)
    runner = ScenarioRun(scenario, shapes)
    given = loaded or (_given_plan(args, runner) if args.layout else None)
    recipes = tuple(filter(None, (args.recipes or ("harmonia" if given else ",".join(RECIPES))).split(",")))
    results = {}
    for recipe in recipes:
        with console.status(f"simulating {recipe}" if given else f"searching {recipe} layouts"):
            results[recipe] = score_plan(runner, given, recipe) if given else run_recipe(runner, recipe)
    bound = float(runner.profile.batch_costs[: scenario.iterations].sum(axis=1).mean()) / \
        runner.cluster.compute_units
    console.print(_given_table(scenario, runner, results, bound) if given
                  else _comparison_table(scenario, results, bound))
    console.print(MFU_NOTE)
    if args.json:
        import dataclasses
        import json

        Path(args.json).write_text(json.dumps({
            "scenario": dataclasses.asdict(scenario),
            "recipes": {k: v.as_dict() for k, v in results.items()},
            "lower_bound_s": bound,
        }, indent=1))
    if args.timeline:
        _write_timelines(args.timeline, scenario.name, results)
    return 0


def _comparison_table(scenario, results: dict, bound: float) -> Table:
    table = Table(title=f"{scenario.name}: {scenario.iterations} iterations of {scenario.global_batch} samples "
                        f"({_profiled(scenario)})")
    for col in ("recipe", "iteration s", "samples/s", "vs megatron", "bubble", "MFU", "plan", "searched"):
        table.add_column(col, justify="left" if col in ("recipe", "plan") else "right")
    base = results.get("megatron")
    for recipe, r in results.items():
        d = r.as_dict()
        if r.candidate is None:  # no plan of this recipe fits: say why instead of NaN cells
            table.add_row(recipe, "-", "-", "-", "-", "-", _plan_summary(d), f"{r.tried} in {r.search_s:.1f}s")
            continue
        speed = f"{base.iteration_s / r.iteration_s:.2f}x" if base and base.candidate else "-"
        table.add_row(recipe, f"{r.iteration_s:.3f}", f"{r.samples_per_s:.1f}", speed,
                      f"{r.bubble_frac:.1%}", f"{r.mfu:.1%}", _plan_summary(d),
                      f"{r.tried} in {r.search_s:.1f}s")
    table.add_row("lower bound", f"{bound:.3f}", f"{scenario.global_batch / bound:.1f}", "", "0.0%", "",
                  "all work spread evenly over every rank (core, where ranks share them) at the cost model's efficiency",
                  "")
    return table


def _given_table(scenario, runner, results: dict, bound: float) -> Table:
    """A given plan under each recipe's batch assignment: time, throughput, MFU, memory, share of the bound."""
    from harmonia.plan.layout_text import describe_layouts

    plan = next(iter(results.values())).candidate.plan
    recompute = f", recompute {','.join(plan.recompute_text())}" if plan.recompute else ""
    table = Table(title=f"{scenario.name}: {describe_layouts(plan.layouts)} ({plan.placement.value}, {plan.schedule} "
                        f"x{plan.n_microbatches}{recompute}) on {scenario.cluster}, {scenario.iterations} iterations "
                        f"of {scenario.global_batch} samples ({_profiled(scenario)})")
    for col in ("recipe", "iteration s", "samples/s", "tokens/s/GPU", "bubble", "MFU", "peak GiB/rank",
                "bound / time"):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    world, capacity = runner.cluster.world_size, runner.cluster.device.mem_bytes
    for recipe, r in results.items():
        over = " (over)" if r.peak_bytes > capacity else ""
        table.add_row(recipe, f"{r.iteration_s:.3f}", f"{r.samples_per_s:.1f}", f"{r.tokens_per_s / world:,.0f}",
                      f"{r.bubble_frac:.1%}", f"{r.mfu:.1%}", f"{r.peak_bytes / 2**30:.1f}{over}",
                      f"{bound / r.iteration_s:.1%}")
    table.add_row("lower bound", f"{bound:.3f}", f"{scenario.global_batch / bound:.1f}", "", "0.0%", "", "", "100%")
    return table


def _profiled(scenario) -> str:
    """What a scenario's batches are drawn from, in a table's title: a trace's file name or spec."""
    trace = scenario.trace
    return Path(trace).name if trace.endswith(".csv") else trace


def _write_timelines(directory: str, name: str, results: dict) -> None:
    from harmonia.sim.timeline import plot_timeline, to_chrome_trace

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for recipe, r in results.items():
        if r.timeline is not None:
            title = f"{name} — {recipe}"
            to_chrome_trace(r.timeline, out / f"{recipe}.trace.json", title=title)
            plot_timeline(r.timeline, out / f"{recipe}.png", title=title)
    console.print(f"timelines in {out}")


def _job_cluster(config) -> str:
    """The cluster `harmonia train` would plan the job for (`harmonia.train.backend.job_cluster`): a CPU
    cluster whose ranks outnumber this machine's cores, naming no ``@cores``, shares those cores."""
    from harmonia.train.backend import job_cluster

    named, spec = config.parallel.cluster, job_cluster(config)
    if spec.describe() != named and spec.world_size > spec.cores:  # ranks sharing cores: say so
        console.print(f"{named}: {spec.world_size} ranks on this machine's {spec.cores} cores, planned as "
                      f"{spec.describe()} as harmonia train plans it; name @CORES (e.g. {named}@8) to plan for "
                      "another machine")
    return spec.describe()


def _profiled_data(args: argparse.Namespace, config) -> tuple[str, list | None]:
    """What `plan` and `simulate` profile: ``(data.path, its shapes)`` where the job names its own
    training set (``data.path`` in ``--config`` or an override) and no ``--trace`` is given: `harmonia
    train` profiles them, so the plan is the one it would search for; read as training reads it (bad
    records counted and left out), nothing cached. Otherwise ``(the trace, None)`` (also for a set
    ``data.synthesize`` has not written yet)."""
    from harmonia.config import config_values

    trace = trace_path(args.trace or DEFAULT_TRACE)
    if args.trace is not None or "path" not in config_values(args.config, args.overrides).get("data", {}):
        return trace, None
    if config.data.synthesize and not Path(config.data.path).exists():
        return trace, None
    from harmonia.train.data import open_split

    return config.data.path, open_split(config, "train", cache_dir=None, log_skips=False).shapes()


def _workers(given: int | None) -> int:
    """``--workers``, checked; by default the cores this process may use."""
    from harmonia.errors import ConfigError
    from harmonia.train.backend import process_cores

    if given is None:
        return process_cores()
    if given < 1:
        raise ConfigError(f"--workers {given}: give at least 1 (1 searches in this process alone)")
    return given


def cmd_plan(args: argparse.Namespace) -> int:
    """Search one static layout for a model, cluster and trace; write the best plan where ``--json`` says."""
    from harmonia.plan.search import search_plan
    from harmonia.plan.scenario import Scenario, parse_device_changes
    from harmonia.workload.devices import cluster_from_string

    from harmonia.errors import ConfigError

    config = _job_config(args)
    if args.json and not Path(args.json).resolve().parent.is_dir():  # refused before minutes of search
        raise ConfigError(f"--json {args.json}: its directory {Path(args.json).parent} does not exist; create it "
                          "or write the plan elsewhere")
    model, cluster, batch = config.model.source, config.parallel.cluster, config.train.global_batch
    planned = _job_cluster(config)
    trace, shapes = _profiled_data(args, config)
    scenario = Scenario("plan", model, planned, trace, batch, config.model.training_modes,
                        iterations=1, search_batches=args.batches, memory_batches=args.memory_batches,
                        seed=config.train.seed, mixed_precision=config.train.mixed_precision,
                        device=parse_device_changes(args.device_set))
    accept = None
    if config.parallel.llm_pp or config.parallel.schedule != "auto":  # the job's constraints, as train applies
        from harmonia.train.planning import _constraints  # them (the trainer, and torch, imported only then)

        accept = _constraints(config)
    with console.status("profiling batches and searching layouts"):
        report = search_plan(scenario, top=args.top, accept=accept, samples=shapes, workers=_workers(args.workers))
    name = model if isinstance(model, str) else "the composition of " + ", ".join([model["llm"],
                                                                                  *model["encoders"].values()])
    profiled = f"data.path={trace} ({len(shapes)} usable samples)" if shapes is not None else args.trace or "ai2d"
    table = Table(title=f"best {len(report.ranked)} plans for {name} on {cluster} "
                        f"(global batch {batch}), simulated on {args.batches} profiled batches of {profiled}")
    for col in ("#", "iteration s", "samples/s", "peak GiB/rank", "plan"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    capacity = cluster_from_string(cluster).device.mem_bytes
    for i, ((secs, rate, cand), peak) in enumerate(zip(report.ranked, report.peak_bytes), 1):
        plan = cand.plan
        layouts = "; ".join(f"{m} {x.describe()}" + (f" split{list(x.stage_layers)}" if x.stage_layers else "")
                            for m, x in plan.layouts.items())
        over = " (over)" if peak > capacity else ""
        recompute = f"; recompute {','.join(plan.recompute_text())}" if plan.recompute else ""
        table.add_row(str(i), f"{secs:.3f}", f"{rate:.1f}", f"{peak / 2**30:.1f}{over}",
                      f"{plan.placement.value}, {plan.schedule} x{plan.n_microbatches}: {layouts}{recompute}")
    console.print(table)
    rejected = ", ".join(f"{n} {why}" for why, n in report.rejected.most_common()) or "none"
    console.print(f"{report.simulated + report.pruned} candidates: {report.simulated} simulated "
                  f"({report.timelines} single-batch simulations), {report.pruned} pruned by lower bounds; "
                  f"rejected: {rejected}; {report.seconds:.1f} s"
                  + (f" ({report.workers} worker processes)" if report.workers > 1 else ""))
    if args.json:
        report.best.save(args.json)
        console.print(f"plan written to {args.json}")
    else:
        console.print("plan not written: give --json PATH to write the best plan for `harmonia train "
                      "--parallel.plan=PATH`", markup=False)
    return 0
