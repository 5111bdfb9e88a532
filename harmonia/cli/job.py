"""The job flags every `harmonia` subcommand shares (model, frozen modules, cluster, batch, config
overrides), the job config they make, and the console the commands print to."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 140)
PROJECT = Path(__file__).resolve().parents[2]
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
