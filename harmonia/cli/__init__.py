"""`harmonia` command line: one subcommand per job, each with ``--help``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import signal
import sys

import numpy as np
from rich.table import Table
from rich.text import Text

from harmonia.cli.job import SHARED_TRACES, _build_cost, _job_args, _model_args, console
from harmonia.cli.plan import DEFAULT_SCENARIO, DEVICE_SET_HELP, cmd_plan, cmd_simulate, trace_path
from harmonia.errors import HarmoniaError


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
    samples = load_trace(trace_path(args.trace), n_samples=args.samples, seed=args.seed)
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
        if row["seconds"] is None:  # a difference of two timings within their noise: not in the fit
            table.add_row(str(row["tokens"]), row["phase"], "-", "within noise")
            continue
        table.add_row(str(row["tokens"]), row["phase"], f"{row['seconds'] * 1e3:.2f}",
                      f"{row['flops'] / row['seconds'] / 1e12:.3f}")
    console.print(table)
    console.print(f"efficiency {calibration.flops_efficiency} -> {args.out}")
    unmeasured = [p for p in ("F", "B", "W") if p not in calibration.flops_efficiency]
    if unmeasured:
        device = device_preset(args.device)
        console.print(f"{'/'.join(unmeasured)}: within the timings' noise at every length, not calibrated: the "
                      f"{device.name} preset's rate ({device.flops_efficiency:g} of peak) prices it; time longer "
                      "sequences (--lengths) or more repeats (--repeats) to measure it", markup=False)
    return 0


DEMO_OVERRIDES = ["--model.preset=tiny-omni", "--data.synthesize=480", "--parallel.llm_pp=2", "--checkpoint.every=60"]
"""The demo is the default config on a synthesized set, with the LLM pipelined over 2 stages and a
checkpoint half-way (configs/demo.toml spells the same job out field by field)."""
DEMO_FRESH = ["--checkpoint.resume=false", "--checkpoint.on_existing=replace"]
"""`harmonia demo` starts afresh each time, replacing the previous demo's checkpoints."""


def _train(config) -> int:
    from harmonia.train import run_training
    from harmonia.train.report import summary_table
    from harmonia.train.trackers import TRACKERS, enabled_trackers

    result = run_training(config, console)
    if result is None:  # a rank other than 0 under torchrun: rank 0 reports
        return 0
    if result.records:
        console.print(summary_table(result.records, result.accuracy, result.evals))
        events = "TensorBoard events, " if config.log.tensorboard else ""
        trackers = "".join(f"; also logged to {TRACKERS[key].name}" for key in enabled_trackers(config))
        console.print(f"metrics.jsonl, {events}timeline.png and summary.json in {config.log.dir}/{trackers}",
                      markup=False)
    else:
        console.print(f"nothing to train: the checkpoint in {config.checkpoint.dir} is already at step "
                      f"{result.start_step} (train.steps={config.train.steps}); raise train.steps, or start afresh "
                      "in another checkpoint.dir", markup=False, soft_wrap=True)
    return 0


@contextlib.contextmanager
def _imports_first():
    """A training command's imports and config (torch, transformers, the trainer: 0.4 million objects
    that live as long as the process) with the garbage collector off, then frozen (``gc.freeze``)
    and the collector on again: each full pass it makes while they grow walks every object made so
    far (0.8 s of the command's start), and every later one would walk them again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def cmd_train(args: argparse.Namespace) -> int:
    """Train as the config says (see `harmonia train --help` for every field)."""
    with _imports_first():
        from harmonia.config import load_config
        importlib.import_module("harmonia.train.job")  # the trainer's imports too, with the collector off

        config = load_config(args.config, args.overrides)
    return _train(config)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on its embedded default: train the tiny omni MLLM on 4 local processes.

    A fresh run each time: the previous demo's checkpoints are replaced, only in a checkpoint
    directory harmonia created (checked, with the rest of the config, before anything is deleted);
    the synthesized data stays.
    """
    with _imports_first():
        from harmonia.config import load_config
        importlib.import_module("harmonia.train.job")  # the trainer's imports too, with the collector off

        config = load_config(None, DEMO_OVERRIDES + DEMO_FRESH + args.overrides)
    return _train(config)


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
                   help="CSV path, a shared trace's name (ai2d, chartqa), or synthetic[:kind=p,...] (kinds: "
                   "text,image,multi_image,video,audio,image_audio)")
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
    p.add_argument("--trace", default=None, help="the sample shapes profiled: a CSV path, a shared trace's name "
                   "(ai2d, chartqa), synthetic[:mix] or text:N (default: where --config or an override names "
                   "data.path, that dataset read as `harmonia train` reads it, whose plan this then is; else ai2d)")
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
    p.add_argument("--workers", type=int, default=None,
                   help="processes that refine candidates at once once the search has run "
                   "harmonia.plan.refiners.PARALLEL_AFTER_S seconds; the ranking is the same for any number "
                   "(default: the cores this process may use)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("simulate", help="score a given plan (--plan, --layout), or run a scenario under each "
                       "recipe and compare")
    p.add_argument("--scenario", default=None,
                   help=f"scenario TOML (see configs/scenarios/; default {DEFAULT_SCENARIO} when neither a config, "
                   "a job flag, a trace nor a plan is given)")
    _job_args(p, batch_default=", or the plan's")
    p.add_argument("--trace", default=None,
                   help="CSV path, a shared trace's name (ai2d, chartqa), synthetic[:mix], or text:N (every "
                   "sample N text tokens); default: where --config or an override names data.path, that dataset "
                   "read as `harmonia train` reads it; else ai2d")
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
