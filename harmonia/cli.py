"""`harmonia` command line: one subcommand per job, each with ``--help``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from harmonia.errors import HarmoniaError

console = Console(width=None if sys.stdout.isatty() else 140)
PROJECT = Path(__file__).resolve().parents[1]
SHARED_TRACES = PROJECT.parent / "shared" / "traces"


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="internvl-8b",
                   help="MLLM preset (see `harmonia models`) or an HF checkpoint directory (config.json is read)")
    p.add_argument("--frozen", default="", help="comma-separated modules to freeze, e.g. vision,audio")
    p.add_argument("--device", default="h100", help="device kind: h100, h200, a100, cpu")
    p.add_argument("--calibration", default=None, help="calibration JSON written by `harmonia profile`")


JOB_FLAGS = {"frozen": "model.frozen", "cluster": "parallel.cluster", "global_batch": "train.global_batch",
             "seed": "train.seed", "schedule": "parallel.schedule"}
"""The flags `plan` and `simulate` share with `train`, each the override of one config field (``--model``
sets ``model.preset``, or ``model.hf`` for a checkpoint directory): their defaults are the config's."""


def _job_args(p: argparse.ArgumentParser, batch_default: str = "") -> None:
    """``--config`` and the flags that override its fields (`JOB_FLAGS`), with the config's help and defaults."""
    from harmonia.config import ModelConfig, ParallelConfig, TrainConfig, field_help

    model, parallel, train = ModelConfig(), ParallelConfig(), TrainConfig()
    p.add_argument("--config", default=None,
                   help="a job's TOML as `harmonia train --config` reads it (default: the built-in defaults): its "
                   "[model], [parallel] and [train] fields; the flags below and --section.key=value override them")
    p.add_argument("--model", default=None, help="MLLM or LLM preset (see `harmonia models`) or an HF checkpoint "
                   f"directory: model.preset, or model.hf for a directory (default {model.source})")
    p.add_argument("--frozen", default=None, help=f"model.frozen, comma-separated: {field_help('model.frozen')} "
                   f"(default {','.join(model.frozen)}, where the model has it)")
    p.add_argument("--cluster", default=None, help=f"parallel.cluster: {field_help('parallel.cluster')} "
                   f"(default {parallel.cluster})")
    p.add_argument("--global-batch", type=int, default=None, help=f"train.global_batch: "
                   f"{field_help('train.global_batch')} (default {train.global_batch}{batch_default})")
    p.add_argument("--seed", type=int, default=None, help=f"train.seed: {field_help('train.seed')}, here the "
                   f"profiled batches' draw (default {train.seed})")


def _source_fields(source: str | dict) -> dict[str, object]:
    """A model source (a plan's ``model``) as the [model] fields that name it."""
    from harmonia.model.resolve import is_checkpoint_dir

    cleared = {"preset": "", "hf": "", "llm": "", "encoders": {}}
    if isinstance(source, dict):
        return {**cleared, "llm": source["llm"], "encoders": dict(source.get("encoders", {}))}
    return {**cleared, ("hf" if is_checkpoint_dir(source) else "preset"): source}


def _job_given(args: argparse.Namespace) -> list[str]:
    """The flags given that describe the job (``--config`` and overrides included; ``--schedule`` is the
    given layouts', not the scenario's)."""
    names = ("config", "model", *(k for k in JOB_FLAGS if k != "schedule"))
    given = [f"--{k.replace('_', '-')}" for k in names if getattr(args, k, None) is not None]
    return given + list(args.overrides)


def _job_config(args: argparse.Namespace, plan=None):
    """The job `plan` and `simulate` describe, as `train` reads it: ``--config`` (or the defaults), its
    ``--section.key=value`` overrides, then the flags; a given plan fills in its model, training modes
    and global batch where none of these set them. ``model.frozen`` left at its default freezes the
    modules of that default the model has (an LLM alone has no vision encoder to freeze)."""
    from harmonia.config import ModelConfig, build_config, config_values

    flags = [f"--{name}={getattr(args, k)}" for k, name in JOB_FLAGS.items() if getattr(args, k, None) is not None]
    values = config_values(args.config, [*args.overrides, *flags])
    model = values.setdefault("model", {})
    if args.model is not None:
        model.update(_source_fields(args.model))
    elif plan is not None and not {"preset", "hf", "llm"} & model.keys():
        model.update(_source_fields(plan.model))
    if plan is not None:
        if not {"frozen", "lora"} & model.keys():
            model["frozen"] = [m for m, t in plan.training.items() if t == "frozen"]
            model["lora"] = [m for m, t in plan.training.items() if t == "lora"]
        values.setdefault("train", {}).setdefault("global_batch", plan.global_batch)
        values.setdefault("parallel", {}).setdefault("world_size", plan.world_size)
    if "frozen" not in model:
        from harmonia.model.resolve import resolve_mllm

        source = build_config({**values, "model": {**model, "frozen": []}}).model.source
        modules = resolve_mllm(source).module_names
        model["frozen"] = [m for m in ModelConfig().frozen if m in modules]
    return build_config(values)


def _build_cost(args: argparse.Namespace):
    from harmonia.model.resolve import resolve_mllm
    from harmonia.workload.calibration import Calibration
    from harmonia.workload.cost import CostModel
    from harmonia.workload.devices import device_preset

    frozen = {m: "frozen" for m in filter(None, args.frozen.split(","))}
    mllm = resolve_mllm(args.model, training=frozen)
    calibration = Calibration.load(args.calibration) if args.calibration else None
    return CostModel(mllm, device_preset(args.device), calibration)


def cmd_models(args: argparse.Namespace) -> int:
    """List model presets with parameter counts."""
    from harmonia.model.presets import ENCODERS, LLMS, MLLM_PRESETS, mllm_preset

    table = Table(title="module presets")
    for col in ("preset", "kind", "parameters", "published", "source"):
        table.add_column(col)
    for kind, presets in (("encoder", ENCODERS), ("llm", LLMS)):
        for name, p in presets.items():
            table.add_row(name, kind, f"{p.spec.n_params() / 1e9:.3f}B", f"{p.params / 1e9:.3f}B", p.source)
    console.print(table)
    mt = Table(title="MLLM presets")
    for col in ("preset", "modules (parameters)"):
        mt.add_column(col)
    for name in MLLM_PRESETS:
        counts = mllm_preset(name).n_params()
        mt.add_row(name, ", ".join(f"{m} {n / 1e6:,.1f}M" for m, n in counts.items()))
    console.print(mt)
    return 0


def cmd_workload(args: argparse.Namespace) -> int:
    """Per-module work of a trace under the cost model: what the balancer and planner see."""
    from harmonia.workload.traces import load_trace
    from harmonia.workload.work import load_arrays

    cost = _build_cost(args)
    samples = load_trace(args.trace, n_samples=args.samples, seed=args.seed)
    tokens, pairs = load_arrays(samples, cost.mllm)
    costs = cost.costs_from_loads(tokens, pairs)
    table = Table(title=f"{args.trace}: {len(samples)} samples, {cost.mllm.name} on {cost.device.name}")
    for col in ("module", "params", "trains", "tokens/sample", "F+B+W ms/sample (mean)", "p99", "CV",
                "share of work"):
        table.add_column(col, justify="right")
    total = costs.sum()
    for j, module in enumerate(cost.modules):
        c = costs[:, j] * 1e3
        params, trainable = cost.param_count(module)
        cv = c.std() / c.mean() if c.mean() > 0 else 0.0
        table.add_row(module, f"{params / 1e6:,.0f}M", "yes" if trainable else "no",
                      f"{tokens[:, j].mean():,.0f}", f"{c.mean():.3f}", f"{np.percentile(c, 99):.3f}",
                      f"{cv:.2f}", f"{costs[:, j].sum() / total:.1%}")
    console.print(table)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure F/B/W of a reference block on this device and write a calibration JSON."""
    from harmonia.model.presets import encoder_preset, llm_preset
    from harmonia.workload.devices import device_preset
    from harmonia.workload.profile import profile_device

    try:
        spec = llm_preset(args.layer).body
    except HarmoniaError:
        spec = encoder_preset(args.layer).body
    lengths = tuple(int(v) for v in args.lengths.split(","))
    calibration = profile_device(device_preset(args.device), spec, lengths, repeats=args.repeats)
    calibration.save(args.out)
    table = Table(title=f"{args.layer} block on {args.device}: achieved fraction of peak")
    for col in ("tokens", "phase", "ms", "TFLOP/s"):
        table.add_column(col, justify="right")
    for row in calibration.measurements:
        table.add_row(str(row["tokens"]), row["phase"], f"{row['seconds'] * 1e3:.2f}",
                      f"{row['flops'] / row['seconds'] / 1e12:.3f}")
    console.print(table)
    console.print(f"efficiency {calibration.flops_efficiency} -> {args.out}")
    return 0


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


def _trace_path(trace: str) -> str:
    """A ``--trace`` as a scenario holds it: a CSV path given on the command line is the user's, from
    their working directory (a scenario file's relative paths are the project's); a generated
    trace as written."""
    from harmonia.workload.traces import is_generated

    return trace if is_generated(trace) else str(Path(trace).resolve())


def _scenario(args: argparse.Namespace, plan=None):
    """The scenario `simulate` runs: a scenario file, or the job's config fields and flags with a trace
    (`_job_config`; a given plan supplies its model, batch and training modes where they do not)."""
    import dataclasses

    from harmonia.errors import ConfigError
    from harmonia.plan.scenario import Scenario, parse_device_changes

    given = _job_given(args) + (["--trace"] if args.trace is not None else [])
    if args.scenario and given:
        raise ConfigError(f"--scenario and {', '.join(given)} both given; describe the scenario with a file or "
                          "with a config and flags, not both")
    if args.scenario or not (given or plan):
        scenario = Scenario.load(args.scenario or str(PROJECT / DEFAULT_SCENARIO))
    else:
        config = _job_config(args, plan)
        scenario = Scenario("simulate", config.model.source, config.parallel.cluster,
                            _trace_path(args.trace or DEFAULT_TRACE), config.train.global_batch,
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
    return dataclasses.replace(scenario, iterations=args.iterations) if args.iterations else scenario


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
    scenario = _scenario(args, loaded)
    _check_world(scenario, loaded, args.layout)
    runner = ScenarioRun(scenario)
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
    table = Table(title=f"{scenario.name}: {scenario.iterations} iterations of {scenario.global_batch} samples")
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
                        f"of {scenario.global_batch} samples")
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
    scenario = Scenario("plan", model, cluster, _trace_path(args.trace), batch, config.model.training_modes,
                        iterations=1, search_batches=args.batches, memory_batches=args.memory_batches,
                        seed=config.train.seed, mixed_precision=config.train.mixed_precision,
                        device=parse_device_changes(args.device_set))
    accept = None
    if config.parallel.llm_pp or config.parallel.schedule != "auto":  # the job's constraints, as train applies
        from harmonia.train.planning import _constraints  # them (the trainer, and torch, imported only then)

        accept = _constraints(config)
    with console.status("profiling batches and searching layouts"):
        report = search_plan(scenario, top=args.top, accept=accept)
    name = model if isinstance(model, str) else "the composition of " + ", ".join([model["llm"],
                                                                                  *model["encoders"].values()])
    table = Table(title=f"best {len(report.ranked)} plans for {name} on {cluster} "
                        f"(global batch {batch}), simulated on {args.batches} profiled batches")
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
                  f"rejected: {rejected}; {report.seconds:.1f} s")
    if args.json:
        report.best.save(args.json)
        console.print(f"plan written to {args.json}")
    else:
        console.print("plan not written: give --json PATH to write the best plan for `harmonia train "
                      "--parallel.plan=PATH`", markup=False)
    return 0


DEMO_OVERRIDES = ["--model.preset=tiny-omni", "--data.synthesize=480", "--parallel.llm_pp=2", "--checkpoint.every=60"]
"""The demo is the default config on a synthesized set, with the LLM pipelined over 2 stages and a
checkpoint half-way (configs/demo.toml spells the same job out field by field)."""
DEMO_FRESH = ["--checkpoint.resume=false", "--checkpoint.on_existing=replace"]
"""`harmonia demo` starts afresh each time, replacing the previous demo's checkpoints."""


def _train(config) -> int:
    from harmonia.train import run_training
    from harmonia.train.report import summary_table

    result = run_training(config, console)
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    if result.records:
        console.print(summary_table(result.records, result.accuracy, result.evals))
        events = "TensorBoard events, " if config.log.tensorboard else ""
        console.print(f"metrics.jsonl, {events}timeline.png and summary.json in {config.log.dir}/",
                      markup=False)
    else:
        console.print(f"nothing to train: the checkpoint in {config.checkpoint.dir} is already at step "
                      f"{result.start_step} (train.steps={config.train.steps}); raise train.steps, or start afresh "
                      "in another checkpoint.dir", markup=False, soft_wrap=True)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train as the config says (see `harmonia train --help` for every field)."""
    from harmonia.config import load_config

    return _train(load_config(args.config, args.overrides))


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on its embedded default: train the tiny omni MLLM on 4 local processes.

    A fresh run each time: the previous demo's checkpoints are replaced, only in a checkpoint
    directory harmonia created (checked, with the rest of the config, before anything is deleted);
    the synthesized data stays.
    """
    from harmonia.config import load_config

    return _train(load_config(None, DEMO_OVERRIDES + DEMO_FRESH + args.overrides))


def cmd_export(args: argparse.Namespace) -> int:
    """Write a training checkpoint as an HF directory in its source's format."""
    from harmonia.train.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, args.dtype, adapter=args.adapter)
    console.print(f"exported {args.checkpoint} to {out}", markup=False, highlight=False)
    return 0


HF_TOOLS = {"tiny-llava": "harmonia.train.tiny_llava", "tiny-qwen-vl": "harmonia.train.tiny_qwen_vl",
            "generate": "harmonia.train.hf_generate"}


def cmd_hf(args: argparse.Namespace) -> int:
    """HF checkpoint tools: write a tiny random-weight LLaVA, or answer held-out records with generate."""
    import importlib

    importlib.import_module(HF_TOOLS[args.tool]).main(args.rest)
    return 0


DATA_TOOLS = {"inspect": "harmonia.data.inspect", "synth": "harmonia.data.synth"}


def cmd_data(args: argparse.Namespace) -> int:
    """Dataset tools: inspect a dataset without training, or write the synthetic learnable one."""
    import importlib

    importlib.import_module(DATA_TOOLS[args.tool]).main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from harmonia.schedule.generators import FAMILIES as SCHEDULE_FAMILIES

    parser = argparse.ArgumentParser(prog="harmonia", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list model presets and parameter counts")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("workload", help="per-module work of a trace under the cost model")
    _model_args(p)
    p.add_argument("--trace", default=str(SHARED_TRACES / "ai2d.csv"),
                   help="CSV path, or synthetic[:kind=p,...] (kinds: text,image,multi_image,video,audio,image_audio)")
    p.add_argument("--samples", type=int, default=4096, help="samples to draw for a synthetic trace")
    p.add_argument("--seed", type=int, default=0, help="seed of a synthetic trace")
    p.set_defaults(func=cmd_workload)

    p = sub.add_parser("profile", help="measure F/B/W times on this device; write a calibration")
    p.add_argument("--layer", default="tiny-llm", help="preset whose block is timed")
    p.add_argument("--device", default="cpu", help="device kind whose peak the efficiencies refer to")
    p.add_argument("--lengths", default="128,256,512", help="comma-separated sequence lengths")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement")
    p.add_argument("--out", default="calibration.json", help="output JSON path")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="search one static layout from batch-level profiling; write plan.json")
    _job_args(p)
    p.add_argument("--trace", default=DEFAULT_TRACE, help="the sample shapes profiled: a CSV path, synthetic[:mix] "
                   "or text:N (default ai2d; `harmonia train` profiles its dataset instead)")
    p.add_argument("--batches", type=int, default=2, help="profiled global batches each candidate is scored on")
    p.add_argument("--memory-batches", type=int, default=8,
                   help="further profiled batches a plan must fit device memory on before it is ranked: "
                   "the heaviest of a draw MEMORY_POOL times larger (harmonia.plan.profiling; heavier "
                   "batches than the scored ones need more)")
    p.add_argument("--top", type=int, default=3,
                   help="plans ranked exactly (the best is always exact; each further one may cost simulations, "
                   "about a second each on 64 GPUs)")
    p.add_argument("--json", default=None, help="where the best plan is written (default: not written)")
    p.add_argument("--device-set", default="", help=DEVICE_SET_HELP)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="score a given plan (--plan, --layout), or run a scenario under each "
                       "recipe and compare")
    p.add_argument("--scenario", default=None,
                   help=f"scenario TOML (see configs/scenarios/; default {DEFAULT_SCENARIO} when neither a config, "
                   "a job flag, a trace nor a plan is given)")
    _job_args(p, batch_default=", or the plan's")
    p.add_argument("--trace", default=None,
                   help="CSV path, synthetic[:mix], or text:N (every sample N text tokens); default ai2d")
    p.add_argument("--plan", default=None, help="score this plan.json (as `harmonia plan` writes it) unsearched")
    p.add_argument("--layout", default=None,
                   help="score these layouts unsearched, one module after another as Layout.describe prints them, "
                   "e.g. 'llm tp4 cp2 pp4 v5 dp2' or 'vision tp1 pp1 dp8; llm tp4 pp2 dp1': sizes adding up to "
                   "the cluster are disjoint rank blocks in that order; an LLM on every rank makes them colocated")
    p.add_argument("--microbatch-size", type=int, default=1,
                   help="with --layout: samples per microbatch of an LLM replica (global batch / (llm dp x this) "
                   "microbatches per replica)")
    p.add_argument("--schedule", default=None, choices=("auto", *SCHEDULE_FAMILIES),
                   help="with --layout: parallel.schedule, the schedule family (auto: interleaved when the LLM has "
                   "virtual stages, else 1f1b)")
    p.add_argument("--recompute", default="", help="with --layout: comma-separated modules whose activations are "
                   "recomputed in backward, e.g. llm; module:share recomputes the first share of each stage's blocks, "
                   "e.g. llm:0.5")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="price TP as Megatron-LM's sequence parallelism: norms, residual adds and their "
                   "activations split over the TP ranks' tokens (harmonia's runtime runs TP without it)")
    p.add_argument("--fsdp-per-microbatch", action="store_true",
                   help="price every FSDP layout as ZeRO-3 (FSDP2's default), as published runs use it: weights "
                   "gathered before every forward and backward, every state sharded (harmonia's runtime does so for "
                   "an LLM laid out 'fsdp reshard'; its plain 'fsdp' gathers once per step and keeps weights and "
                   "gradients whole until the step's reduce-scatter)")
    p.add_argument("--device-set", default="", help=DEVICE_SET_HELP)
    p.add_argument("--recipes", default=None,
                   help="comma-separated recipes to run (default all four; with a given plan, harmonia: whose "
                   "batch assignment and ordering score it)")
    p.add_argument("--iterations", type=int, default=0, help="override the scenario's iteration count")
    p.add_argument("--json", default=None, help="write the comparison as JSON to this file")
    p.add_argument("--timeline", default=None, help="directory for per-recipe PNG timelines and traces")
    p.set_defaults(func=cmd_simulate)

    from harmonia.config import help_lines

    p = sub.add_parser("train", help="train an MLLM as a config says (spawns the processes itself)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="config fields (TOML [section] key = value, or --section.key=value):\n  "
                       + "\n  ".join(help_lines()))
    p.add_argument("--config", default=None, help="TOML config (default: the built-in demo defaults)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="write a training checkpoint (a job started from HF checkpoints) as an "
                       "HF directory transformers loads: config, safetensors shards, tokenizer and processor files")
    p.add_argument("--checkpoint", required=True, help="checkpoint.dir of the job (its newest step) or a step-N dir")
    p.add_argument("--out", required=True, help="a new or empty directory to write")
    p.add_argument("--dtype", default="source", choices=("source", "float32", "bfloat16", "float16"),
                   help="dtype of the written weights (source: the source checkpoint's)")
    p.add_argument("--adapter", action="store_true", help="write the LoRA adapters as a PEFT adapter directory "
                   "(adapter_config.json, adapter_model.safetensors) for the source checkpoint, not the merged model")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("hf", help="HF checkpoint tools: tiny-llava OUT / tiny-qwen-vl OUT (a tiny random-weight LLaVA "
                       "or Qwen2.5-VL with tokenizer and processor), generate CHECKPOINT RECORDS (transformers answers held-out records)")
    p.add_argument("tool", choices=sorted(HF_TOOLS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the tool's own arguments (--help for them)")
    p.set_defaults(func=cmd_hf)

    p = sub.add_parser("data", help="dataset tools: inspect PATH (read every record, decode every media file, "
                       "report counts and bad records by kind), synth OUT (the synthetic learnable dataset)")
    p.add_argument("tool", choices=sorted(DATA_TOOLS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the tool's own arguments (--help for them)")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("demo", help="the main job on its embedded default (configs/demo.toml); "
                       "takes the same --section.key=value overrides as train")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "demo", "plan", "simulate"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except HarmoniaError as err:
        from harmonia.runtime.watchdog import StopRequested

        if isinstance(err, StopRequested):  # a requested stop, said once (by rank 0 under torchrun)
            if os.environ.get("RANK", "0") == "0":
                console.print(Text(str(err)), soft_wrap=True)
        else:
            _print_error(str(err))
        return getattr(err, "exit_code", 2)
    except KeyboardInterrupt:
        _print_error("interrupted")
        return 128 + signal.SIGINT
    except RuntimeError as err:  # under torchrun: a peer gone is one line per rank, not a traceback
        from harmonia.launch import PEER_ERRORS, under_torchrun

        lost = PEER_ERRORS.search(str(err)) if under_torchrun() else None
        if lost is None:
            raise
        _print_error(f"rank {os.environ['RANK']} lost its connection to another rank ({lost.group(0)}): that rank "
                     "failed or was killed; torchrun names it, and restarts the workers if --max-restarts allows")
        return 1


def _print_error(message: str) -> None:
    """``error: message``, the message verbatim (never read as rich markup), unwrapped."""
    console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
