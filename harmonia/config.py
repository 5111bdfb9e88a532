"""Typed training configuration: TOML files plus ``--section.key=value`` overrides.

Every field has a one-line doc (the ``help`` metadata) that doubles as CLI help; validation runs
in ``__post_init__``, so a bad config fails before any process starts, naming the field.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from harmonia.data.formats import FORMATS
from harmonia.errors import ConfigError
from harmonia.model.training_mode import LORA_TARGETS, ModuleTraining
from harmonia.schedule.generators import FAMILIES as SCHEDULE_FAMILIES


def _f(default: Any, help: str, **kw) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _spelled(names: tuple[str, ...]) -> str:
    """``a, b or c``: a field's choices as its help and errors say them."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""``train.lr_schedule``'s shapes after the warm-up (`harmonia.train.lr_schedule` computes them)."""

PRECISION_MIXED = {"auto": None, "bf16": True, "fp32": False}
"""``train.precision`` -> whether the cost model prices bf16 mixed precision (None: the device
kind's default, which ``auto`` runs: `harmonia.train.rank.build_rank_model`)."""


def _require(cond: bool, name: str, value: Any, expected: str) -> None:
    if not cond:
        raise ConfigError(f"config {name}={value!r} is invalid: expected {expected}")


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _number(value: Any) -> bool:
    """A finite int or float that is not a bool (a TOML or JSON ``true`` is no number)."""
    return _finite(value) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    preset: str = _f("", "MLLM preset (see `harmonia models`); tiny-omni when no checkpoint is given")
    hf: str = _f("", "HF multimodal checkpoint directory (e.g. a LlavaForConditionalGeneration) to start from")
    llm: str = _f("", "HF LLM checkpoint directory of a composition (with `encoders`; projectors start fresh)")
    encoders: dict = _f({}, "HF encoder checkpoint directories of a composition, e.g. {vision = DIR, audio = DIR}")
    frozen: list = _f(["vision"], "modules whose weights stay fixed")
    lora: list = _f([], "modules trained through LoRA adapters only")
    lora_rank: int = _f(8, "rank of the LoRA adapters")
    lora_alpha: float = _f(0.0, "LoRA scaling numerator: updates are scaled by lora_alpha / lora_rank (0 = the rank, "
                           "a scale of 1)")
    lora_dropout: float = _f(0.0, "dropout on the LoRA adapters' inputs while training")
    lora_targets: list = _f(list(LORA_TARGETS), "names of the linears that get adapters (the last part of their "
                            "module path, as PEFT's target_modules); each must name a linear of every LoRA module")
    lora_modules: dict = _f({}, "per-module LoRA settings overriding the above, e.g. {llm = {rank = 16, alpha = 32, "
                            "dropout = 0.05, targets = ['q_proj', 'v_proj']}} (a [model.lora_modules.llm] table)")

    def __post_init__(self) -> None:
        from harmonia.model.presets import MLLM_PRESETS

        given = [n for n in ("preset", "hf", "llm") if getattr(self, n)]
        _require(len(given) <= 1, "model", {n: getattr(self, n) for n in given},
                 "one of model.preset, model.hf or model.llm (with model.encoders)")
        _require(not self.encoders or self.llm, "model.encoders", self.encoders,
                 "encoders of a composition, given together with model.llm")
        if self.preset:
            _require(self.preset in MLLM_PRESETS, "model.preset", self.preset, f"one of {sorted(MLLM_PRESETS)}")
        for name, path in [("hf", self.hf), ("llm", self.llm), *((f"encoders.{k}", v) for k, v in self.encoders.items())]:
            if path:
                _require(isinstance(path, str) and (Path(path) / "config.json").is_file(), f"model.{name}", path,
                         "an HF checkpoint directory holding config.json")
        _require(not set(self.frozen) & set(self.lora), "model.lora", self.lora, "modules not also frozen")
        _require(self.lora_rank >= 1, "model.lora_rank", self.lora_rank, "an integer >= 1")
        for module in self.lora_modules:
            _require(module in self.lora, f"model.lora_modules.{module}", self.lora_modules[module],
                     f"settings of a module listed in model.lora ({self.lora})")
        for module in self.lora:
            self.lora_training(module)  # each module's settings are checked here, before any process starts

    def lora_training(self, module: str) -> ModuleTraining:
        """The `ModuleTraining` of a LoRA module: the model.lora_* settings with its lora_modules overrides."""
        given = dict(self.lora_modules.get(module, {}))
        unknown = set(given) - {"rank", "alpha", "dropout", "targets"}
        _require(not unknown, f"model.lora_modules.{module}", given, "keys among rank, alpha, dropout, targets")
        rank, alpha = given.get("rank", self.lora_rank), given.get("alpha", self.lora_alpha)
        dropout, targets = given.get("dropout", self.lora_dropout), given.get("targets", self.lora_targets)
        where = f"model.lora_modules.{module}" if given else "model.lora_*"
        _require(isinstance(rank, int) and rank >= 1, where, rank, "a rank >= 1")
        _require(_number(alpha) and alpha >= 0, where, alpha, "an alpha >= 0 (0 = the rank)")
        _require(_number(dropout) and 0 <= dropout < 1, where, dropout, "a dropout in [0, 1)")
        _require(isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets), where,
                 targets, "a non-empty list of linear names")
        return ModuleTraining("lora", lora_rank=rank, lora_alpha=float(alpha) or None, lora_dropout=float(dropout),
                              lora_targets=tuple(targets))

    @property
    def source(self) -> str | dict[str, object]:
        """What the model is built from: a preset name, an HF directory, or a composition
        ``{"llm": DIR, "encoders": {name: DIR}}``."""
        if self.hf:
            return self.hf
        if self.llm:
            return {"llm": self.llm, "encoders": dict(self.encoders)}
        return self.preset or "tiny-omni"

    @property
    def training_modes(self) -> dict[str, str]:
        """Module -> ``frozen`` / ``lora`` (every other module trains fully)."""
        return {**{m: "frozen" for m in self.frozen}, **{m: "lora" for m in self.lora}}

    @property
    def from_checkpoint(self) -> bool:
        """Whether the weights come from HF checkpoints (else from the seed)."""
        return bool(self.hf or self.llm)


@dataclass(frozen=True)
class DataConfig:
    path: str = _f("runs/data/synthetic", "dataset: a file or directory (harmonia manifest, LLaVA JSON/JSONL, "
                   "messages JSONL, webdataset shards, a mixture YAML/JSON), or with `synthesize`, where to write a "
                   "synthetic set")
    format: str = _f("auto", f"record format: auto (detected per record), {_spelled(FORMATS[1:])}")
    chat_template: str = _f("", "a Jinja chat template file replacing the tokenizer's own")
    media_root: str = _f("", "directory media paths are relative to (default: the dataset file's directory)")
    allow_outside_root: bool = _f(False, "allow media paths that resolve outside the media root")
    synthesize: int = _f(0, "write a synthetic learnable set of this many training samples at `path` (which must "
                         "not exist yet, or hold one harmonia wrote from the same request); 0 = train on `path`")
    heldout: int = _f(96, "held-out samples synthesized beside the training set")
    eval_path: str = _f("", "the evaluation set of train.eval_every: a file or directory in a format data.path "
                        "takes (empty = the held-out split beside a synthesized set, where there is one)")
    trace: str = _f("", "size mix of synthesized samples: a trace CSV path, or empty for the default mix")
    max_tokens: int = _f(512, "longest sample in LLM tokens; what happens to a longer one is data.truncation")
    truncation: str = _f("skip", "a sample longer than data.max_tokens: skip (a counted bad record, too_long) or "
                         "truncate (cut to its first max_tokens tokens; items after the cut dropped, a cut inside "
                         "an item or one leaving nothing learned still skips)")
    max_frames: int = _f(8, "frames sampled uniformly from each video; for a Qwen2-VL / Qwen2.5-VL tower the most "
                         "its video processor samples at its own rate (fps, min_frames, max_frames)")
    frames_fps: float = _f(0.0, "frame rate of the videos given as lists of frame files, which have none of their "
                           "own (0 = unknown: a tower that samples by rate, Qwen2-VL's and Qwen2.5-VL's, counts "
                           "them as bad records)")
    max_pixels: int = _f(8192 * 8192, "images with more pixels are bad records, found from the header")
    on_error: str = _f("skip", "bad samples: skip (counted and reported) or fail")
    num_workers: int = _f(0, "worker processes reading media headers for the shape index and decoding each "
                           "rank's samples one step ahead (0 = in the job's process)")
    cache_mb: int = _f(1024, "decoded samples each rank keeps in memory, least recently used dropped first, so a "
                       "sample it trains again (a later epoch) is not decoded again (0 = none)")

    def __post_init__(self) -> None:
        _require(self.format in FORMATS, "data.format", self.format, _spelled(FORMATS))
        if self.chat_template:
            _require(Path(self.chat_template).is_file(), "data.chat_template", self.chat_template,
                     "an existing Jinja template file")
        _require(self.synthesize >= 0 and self.heldout >= 0, "data.synthesize", self.synthesize, ">= 0")
        _require(self.max_tokens > 0, "data.max_tokens", self.max_tokens, "a positive integer")
        _require(self.truncation in ("skip", "truncate"), "data.truncation", self.truncation, "'skip' or 'truncate'")
        _require(self.max_frames > 0, "data.max_frames", self.max_frames, "a positive integer")
        _require(self.frames_fps >= 0, "data.frames_fps", self.frames_fps, "0 or a positive frame rate")
        _require(self.max_pixels > 0, "data.max_pixels", self.max_pixels, "a positive integer")
        _require(self.on_error in ("skip", "fail"), "data.on_error", self.on_error, "'skip' or 'fail'")
        _require(self.num_workers >= 0, "data.num_workers", self.num_workers, ">= 0")
        _require(self.cache_mb >= 0, "data.cache_mb", self.cache_mb, ">= 0")


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = _f(0, "processes; spawned locally when not started by torchrun (0 = the cluster's "
                         "devices when a cluster is given, else 4)")
    plan: str = _f("auto", "plan JSON written by `harmonia plan`, or auto to search at start-up")
    cluster: str = _f("", "device kind and shape the planner models, e.g. cpu:1x4 or h100:4x8 (cpu:1x4@2: "
                      "4 ranks sharing 2 cores; a CPU job simulates its ranks on the cores it is given); empty = "
                      "cpu:1xN for world_size N (a GPU job names its cluster)")
    schedule: str = _f("auto", "pipeline schedule family the plan search must use: auto (the search decides), "
                       f"{_spelled(SCHEDULE_FAMILIES)}")
    backend: str = _f("auto", "process-group backend: auto (nccl on GPUs, gloo on CPU), gloo or nccl")
    llm_pp: int = _f(0, "LLM pipeline stages the plan search must use (0 = the search decides)")
    timeout_s: float = _f(0.0, "time limit of the job: past it every rank stops as on SIGTERM (0 = no limit)")
    hang_timeout_s: float = _f(0.0, "a rank without a heartbeat for this long is named and the job stopped "
                               "(0 = auto: 300 s on GPUs, 60 s on CPU)")
    collective_timeout_s: float = _f(600.0, "process-group timeout: a collective waiting longer fails")
    prepare_timeout_s: float = _f(1800.0, "under torchrun, how long the other ranks wait for rank 0 to prepare the "
                                  "data and the plan (the shape pass over the data, the plan search) before they fail")
    schedule_search: int = _f(-1, "schedules the per-batch microbatch-order search replays each step, in the "
                              "background (0 = keep the balancer's order; -1 = auto: 16 on GPUs, 0 on CPU, "
                              "where every rank's search takes its time from the ranks' own compute)")

    def __post_init__(self) -> None:
        _require(self.world_size >= 0, "parallel.world_size", self.world_size, "an integer >= 1 (0 = the cluster's)")
        if not self.cluster:  # a CPU job of world_size processes (a given cluster sets world_size 0 at
            object.__setattr__(self, "world_size", self.world_size or 4)  # start: `with_world_size`)
            object.__setattr__(self, "cluster", f"cpu:1x{self.world_size}")
        _require(self.schedule in ("auto", *SCHEDULE_FAMILIES), "parallel.schedule", self.schedule,
                 _spelled(("auto", *SCHEDULE_FAMILIES)))
        _require(self.backend in ("auto", "gloo", "nccl"), "parallel.backend", self.backend, "auto, gloo or nccl")
        _require(self.llm_pp >= 0, "parallel.llm_pp", self.llm_pp, ">= 0")
        for name in ("timeout_s", "hang_timeout_s"):
            value = getattr(self, name)
            _require(_finite(value) and value >= 0, f"parallel.{name}", value, "a finite number >= 0")
        for name in ("collective_timeout_s", "prepare_timeout_s"):
            value = getattr(self, name)
            _require(_finite(value) and value > 0, f"parallel.{name}", value, "a finite number > 0")
        _require(self.schedule_search >= -1, "parallel.schedule_search", self.schedule_search, ">= 0, or -1 (auto)")
        if self.plan != "auto":
            _require(Path(self.plan).is_file(), "parallel.plan", self.plan, "an existing plan JSON or 'auto'")


MODULE_OPTIMIZER_KEYS = ("lr", "weight_decay")
"""What a ``train.modules`` entry may set for its module."""


def _check_module_optimizer(module: Any, values: Any) -> None:
    """One ``train.modules`` entry: a table of a positive lr and/or a weight decay >= 0."""
    name = f"train.modules.{module}"
    _require(isinstance(values, dict), name, values, f"a table of {' and/or '.join(MODULE_OPTIMIZER_KEYS)}, "
             "e.g. {lr = 1e-3}")
    unknown = sorted(set(values) - set(MODULE_OPTIMIZER_KEYS))
    _require(not unknown, name, values, f"only the keys {list(MODULE_OPTIMIZER_KEYS)} (not {unknown})")
    lr, decay = values.get("lr", 1.0), values.get("weight_decay", 0.0)
    _require(_number(lr) and lr > 0, f"{name}.lr", lr, "a finite positive number")
    _require(_number(decay) and decay >= 0, f"{name}.weight_decay", decay, "a finite number >= 0")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(120, "optimizer steps (with train.epochs, set from the usable samples instead)")
    epochs: float = _f(0.0, "passes over the usable training samples, instead of train.steps: steps = ceil(epochs "
                       "x samples / global_batch), said at the start (0 = train.steps)")
    global_batch: int = _f(32, "samples per step over all data-parallel replicas")
    n_microbatches: int = _f(4, "microbatches per LLM replica (the planner may change it)")
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup: int = _f(-1, "linear warm-up steps; -1 = 3% of train.steps, at least 1")
    lr_schedule: str = _f("cosine", "the lr after the warm-up: cosine (decay to train.min_lr_ratio x lr), linear "
                          "(the same, in a straight line), constant, or wsd (constant, then a linear decay to "
                          "train.min_lr_ratio x lr over the last train.decay_ratio of the steps)")
    min_lr_ratio: float = _f(0.1, "where cosine, linear and wsd decay to, as a fraction of the peak lr, in [0, 1]")
    decay_ratio: float = _f(0.1, "wsd: the share of train.steps its decay takes, at the end, in (0, 1]")
    modules: dict = _f({}, "per-module peak lr and weight decay, e.g. {vision_proj = {lr = 1e-3, weight_decay = "
                       "0.01}} (in TOML a [train.modules.vision_proj] table); a module's lr follows "
                       "train.lr_schedule from its own peak; unnamed modules take train.lr and train.weight_decay")
    max_norm: float = _f(1.0, "gradient clipping on the global norm over all modules (0 = off)")
    seed: int = _f(0, "seed of weights, data order and schedules")
    precision: str = _f("auto", "compute precision: auto (bf16 mixed precision on GPUs, fp32 on CPU), fp32 or bf16")
    attention: str = _f("auto", "the LLM's attention kernel: auto (FlashAttention varlen on GPUs where every token "
                        "attends causally, compiled flex attention where items attend their whole item, the exact "
                        "per-segment kernel on CPU), segments, varlen or flex")
    compile: str = _f("auto", "torch.compile each transformer block (dynamic shapes, no recompilation as "
                      "microbatch lengths change): auto (on GPUs), on or off")
    eval_every: int = _f(0, "steps between evaluations of the loss over the evaluation set (data.eval_path), "
                         "and one after the last step; 0 = none")
    on_nonfinite: str = _f("stop", "a step whose loss or gradient norm is not finite: stop (before the weights "
                           "change) or skip its update (the job still stops after 3 such steps in a row)")
    assignment: str = _f("balanced", "how each step's batch becomes microbatches: balanced (every module's work "
                         "balanced over replicas and microbatches, the per-batch order and sub-microbatch search) "
                         "or sequential (fixed-size microbatches in data order, as Megatron-LM: no balancing, "
                         "no order search, no sub-microbatches)")

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "train.steps", self.steps, "an integer >= 1")
        _require(_number(self.epochs) and self.epochs >= 0, "train.epochs", self.epochs, "a number >= 0")
        _require(self.precision in ("auto", "fp32", "bf16"), "train.precision", self.precision,
                 "auto, fp32 or bf16")
        _require(self.attention in ("auto", "segments", "varlen", "flex"), "train.attention", self.attention,
                 "auto, segments, varlen or flex")
        _require(self.compile in ("auto", "on", "off"), "train.compile", self.compile, "auto, on or off")
        _require(self.global_batch >= 1, "train.global_batch", self.global_batch, "an integer >= 1")
        _require(self.eval_every >= 0, "train.eval_every", self.eval_every, "an integer >= 0 (0 = no evaluation)")
        _require(self.n_microbatches >= 1, "train.n_microbatches", self.n_microbatches, "an integer >= 1")
        _require(_finite(self.lr) and self.lr > 0, "train.lr", self.lr, "a finite positive number")
        _require(_finite(self.weight_decay) and self.weight_decay >= 0, "train.weight_decay", self.weight_decay,
                 "a finite number >= 0")
        _require(_finite(self.max_norm) and self.max_norm >= 0, "train.max_norm", self.max_norm,
                 "a finite number >= 0")
        _require(self.on_nonfinite in ("stop", "skip"), "train.on_nonfinite", self.on_nonfinite, "'stop' or 'skip'")
        _require(self.assignment in ("balanced", "sequential"), "train.assignment", self.assignment,
                 "'balanced' or 'sequential'")
        _require(self.warmup == -1 or 0 <= self.warmup <= self.steps, "train.warmup", self.warmup,
                 f"-1 (3% of the steps) or 0..train.steps ({self.steps})")
        self._check_lr_schedule()
        for module, values in self.modules.items():
            _check_module_optimizer(module, values)

    def _check_lr_schedule(self) -> None:
        _require(self.lr_schedule in LR_SCHEDULES, "train.lr_schedule", self.lr_schedule, _spelled(LR_SCHEDULES))
        _require(_finite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio",
                 self.min_lr_ratio, "a number in [0, 1]")
        _require(_finite(self.decay_ratio) and 0 < self.decay_ratio <= 1, "train.decay_ratio", self.decay_ratio,
                 "a number in (0, 1]")

    @property
    def mixed_precision(self) -> bool | None:
        """Whether the cost model prices bf16 mixed precision (`PRECISION_MIXED`; None: the device's default)."""
        return PRECISION_MIXED[self.precision]

    @property
    def warmup_steps(self) -> int:
        """The warm-up in steps: ``warmup``, or for -1 3% of ``steps`` rounded up (4 of 120)."""
        return self.warmup if self.warmup >= 0 else max(1, math.ceil(0.03 * self.steps))

    @property
    def decay_steps(self) -> int:
        """``wsd``'s decay in steps: ``decay_ratio`` of ``steps`` to the nearest step, at least 1 (12 of 120)."""
        return max(1, round(self.decay_ratio * self.steps))

    def lr_of(self, module: str | None = None) -> float:
        """The peak lr of ``module``: its ``modules`` entry, else ``lr`` (also for None)."""
        return float(self.modules.get(module, {}).get("lr", self.lr))

    def weight_decay_of(self, module: str | None = None) -> float:
        """The weight decay of ``module``: its ``modules`` entry, else ``weight_decay`` (also for None)."""
        return float(self.modules.get(module, {}).get("weight_decay", self.weight_decay))


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = _f("runs/demo/checkpoints", "checkpoint directory")
    every: int = _f(0, "save every N steps (0 = only at the end)")
    resume: bool = _f(True, "resume from the newest checkpoint in `dir` when one exists (it must be of the same "
                      "model and trained modules)")
    keep: int = _f(3, "newest checkpoints kept; older ones are deleted after each save (0 = keep all)")
    on_signal: bool = _f(True, "save a checkpoint when SIGTERM, SIGINT or SIGHUP stops the job")
    on_existing: str = _f("refuse", "resume=false into a directory holding checkpoints: refuse, new_dir (write to "
                          "<dir>-2, <dir>-3, ...) or replace (delete its checkpoints; only in a directory harmonia "
                          "created)")
    export_every: int = _f(0, "also write the model as an HF directory (as `harmonia export` does) every N steps, "
                           "into <dir>/hf/step-N, beside training; a multiple of checkpoint.every (0 = never)")

    def __post_init__(self) -> None:
        _require(self.every >= 0, "checkpoint.every", self.every, ">= 0")
        _require(self.export_every >= 0 and (not self.export_every or (self.every and self.export_every % self.every == 0)),
                 "checkpoint.export_every", self.export_every, f"0, or a multiple of checkpoint.every ({self.every})")
        _require(self.keep >= 0, "checkpoint.keep", self.keep, ">= 0")
        _require(self.on_existing in ("refuse", "new_dir", "replace"), "checkpoint.on_existing", self.on_existing,
                 "refuse, new_dir or replace")


@dataclass(frozen=True)
class LogConfig:
    dir: str = _f("runs/demo", "metrics.jsonl, TensorBoard events, timelines and the summary go here")
    every: int = _f(1, "log every N steps (and the last): only those steps' records go to metrics.jsonl, "
                       "TensorBoard and trackers, gather every rank's module times and memory (a collective) "
                       "and are simulated beside the measured step; on CPU jobs of several ranks the other steps "
                       "agree on the next one in their own loss collective, one collective a step fewer")
    tensorboard: bool = _f(True, "also write TensorBoard events")
    wandb: bool = _f(False, "also log to Weights & Biases (the wandb package; WANDB_MODE=offline keeps the run in "
                            "<dir>/wandb, WANDB_* variables apply)")
    mlflow: bool = _f(False, "also log to MLflow (mlflow or mlflow-skinny) at log.mlflow_uri")
    mlflow_uri: str = _f("", "MLflow tracking URI (http://host:5000, sqlite:///path/mlflow.db, ...); empty: "
                             "MLFLOW_TRACKING_URI")
    project: str = _f("harmonia", "the W&B project and MLflow experiment the run is logged to")
    run_name: str = _f("", "the W&B / MLflow run name (empty: the last part of log.dir); a resumed job logs "
                           "to a new run '<name> from step-N' beside it")
    memory: bool = _f(False, "on CPU, count each step's tensor bytes per rank (every operator pays a Python call) "
                             "and record them beside the planner's prediction; GPUs always record their "
                             "allocator's peak")

    def __post_init__(self) -> None:
        _require(self.every >= 1, "log.every", self.every, "an integer >= 1")


@dataclass(frozen=True)
class Config:
    """The whole job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        from harmonia.model.resolve import resolve_mllm

        mllm = resolve_mllm(self.model.source)
        for name in ("frozen", "lora"):
            unknown = set(getattr(self.model, name)) - set(mllm.module_names)
            _require(not unknown, f"model.{name}", sorted(unknown), f"module names among {mllm.module_names}")
        unknown = set(self.train.modules) - set(mllm.module_names)
        _require(not unknown, "train.modules", sorted(unknown), f"module names among {mllm.module_names}")
        _require(not self.checkpoint.export_every or self.model.from_checkpoint, "checkpoint.export_every",
                 self.checkpoint.export_every, "0 for a preset model (an HF export needs model.hf or model.llm)")

    def to_dict(self) -> dict:
        return {f.name: {g.name: getattr(getattr(self, f.name), g.name) for g in fields(getattr(self, f.name))}
                for f in fields(self)}


def _coerce(section: str, key: str, raw: Any, kind: type) -> Any:
    name = f"{section}.{key}"
    if isinstance(raw, str) and kind is not str:
        text = raw.strip()
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text.lower() in ("true", "1", "yes")
            if kind is list:  # a TOML/JSON list of strings, or its items comma-separated
                if not text.startswith("["):
                    return [x.strip() for x in text.split(",") if x.strip()]
                value = json.loads(text)
                if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                    raise ValueError
                return value
            if kind is dict:
                value = json.loads(text)
                if not isinstance(value, dict):
                    raise ValueError
                return value
            return kind(text)
        except ValueError:
            hint = {dict: " (a JSON object, e.g. '{\"vision\": \"DIR\"}')",
                    list: " (names comma-separated, e.g. 'vision,audio', or a list, e.g. '[\"vision\"]')"}.get(kind, "")
            raise ConfigError(f"config {name}={raw!r} is invalid: expected {kind.__name__}{hint}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise ConfigError(f"config {name}={raw!r} is invalid: expected {kind.__name__}")
    return raw


def build_config(values: dict[str, dict[str, Any]]) -> Config:
    """A validated config from ``{section: {key: value}}`` (unknown names are errors)."""
    sections = {f.name: f for f in fields(Config)}
    built = {}
    for section, entries in values.items():
        if section not in sections:
            raise ConfigError(f"unknown config section [{section}]; sections are {sorted(sections)}")
        if not isinstance(entries, dict):
            raise ConfigError(f"config section [{section}] must be a table of key = value")
        cls = sections[section].default_factory  # type: ignore[misc]
        hints = get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        for key in entries:
            if key not in known:
                raise ConfigError(f"unknown config key {section}.{key}; [{section}] has {sorted(known)}")
        built[section] = cls(**{k: _coerce(section, k, v, hints[k]) for k, v in entries.items()})
    return Config(**built)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML config (or the defaults) and apply ``section.key=value`` overrides."""
    return build_config(config_values(path, overrides))


def config_values(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}`` as a TOML config (or nothing) and ``section.key=value`` overrides set
    them, not yet checked: what the job sets, apart from the defaults."""
    values: dict[str, dict[str, Any]] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass a TOML file such as configs/demo.toml")
        try:
            values = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {p} is not valid TOML: {err}") from None
    for item in overrides or []:
        text = item.removeprefix("--")
        key, sep, value = text.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"override {item!r}: expected --section.key=value, e.g. --train.steps=10")
        values.setdefault(section, {})[name] = value
    return values


def config_fields() -> list[tuple[str, Any, str]]:
    """``(section.key, default, help)`` of every field, in the order of the sections and their fields."""
    out = []
    for section in fields(Config):
        cls = section.default_factory  # type: ignore[misc]
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            out.append((f"{section.name}.{f.name}", default, f.metadata.get("help", "")))
    return out


def field_help(name: str) -> str:
    """The help of config field ``section.key``, e.g. ``parallel.cluster``."""
    return next(text for key, _, text in config_fields() if key == name)


def help_lines() -> list[str]:
    """``section.key (default): help`` for every field, for ``harmonia train --help``."""
    return [f"--{name}={default!r}: {text}" for name, default, text in config_fields()]

