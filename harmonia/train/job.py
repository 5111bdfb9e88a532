"""`harmonia train`: a whole job from a config, on local processes or under torchrun.

Started plainly, the job does everything that can fail cheaply before any process starts: it
validates the config and the data path, synthesizes the dataset where `data.synthesize` asks, reads every sample's shape (bad
samples reported and skipped by policy), and loads or searches the plan (printed). Then it spawns
``parallel.world_size`` processes (`harmonia.launch.launch`: a failing rank ends the job with its
message, never a hang), and finally evaluates held-out answer accuracy of the initial and the
trained model from the last checkpoint and prints the summary. Before anything is prepared,
`harmonia.train.preflight` checks the plan file and the directories, locks ``checkpoint.dir`` for
the whole job and decides where training starts (a finished job does not start again). Under
torchrun every process runs `train_worker` directly and rank 0 does the preparation, sharing the
plan with the others.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from harmonia.config import Config
from harmonia.schedule.plan import Plan
from harmonia.plan.search import PlanReport
from harmonia.train.backend import backend_of, hang_timeout
from harmonia.train.data import check_data_path, check_eval_path, data_cache_dir, open_split, prepare_data
from harmonia.train.planning import (check_cluster, check_model_files, load_training_plan, model_spec,
                                     search_training_plan, with_world_size)
from harmonia.train.trackers import check_trackers

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished job reports (the parent's view)."""

    plan: Plan | None
    records: list[dict]
    losses: list[float]
    start_step: int
    accuracy: dict[str, tuple[float, float, int, float]] = field(default_factory=dict)
    report: PlanReport | None = None
    evals: list[dict] = field(default_factory=list)  # train.eval_every's: step, loss, batches, samples


def dataset_shapes(config: Config) -> list:
    """Shapes of every usable training sample (bad ones counted, reported and skipped; the shapes and
    token counts cached for the ranks under ``checkpoint.dir``)."""
    return open_split(config, "train", cache_dir=data_cache_dir(config)).shapes()


def check_eval_data(config: Config) -> None:
    """With ``train.eval_every``, read the evaluation set before any rank starts: a set in no format
    the job reads stops it here with one line (as the training set does), its bad records are
    reported once, its shapes are cached for the ranks, and a set of fewer usable samples than one
    batch is refused here, not in every rank."""
    if config.train.eval_every:
        from harmonia.train.data import open_eval_data
        from harmonia.train.eval_loss import EvalLoss

        dataset, shapes = open_eval_data(config, model_spec(config), log_skips=True)
        if dataset is not None:
            where = config.data.eval_path or f"beside data.path={config.data.path!r}"
            EvalLoss.batches_of(len(shapes), config.train.global_batch, where)


def with_epochs(config: Config, console=None) -> Config:
    """The config with ``train.steps`` set from ``train.epochs`` (when given): ``ceil(epochs x usable
    samples / global_batch)``, said once on ``console``.

    Raises:
        ConfigError: the derived steps do not fit the rest of the config (a longer warm-up, say).
    """
    import math
    from dataclasses import replace

    t = config.train
    if not t.epochs:
        return config
    n = len(dataset_shapes(config))
    steps = max(1, math.ceil(t.epochs * n / t.global_batch))
    if console is not None:
        console.print(f"train.epochs={t.epochs:g} over {n} usable samples at global batch {t.global_batch}: "
                      f"{steps} steps", markup=False)
    return replace(config, train=replace(t, steps=steps))


def resolve_plan(config: Config) -> tuple[Plan, PlanReport | None]:
    """The plan file of the config, or the best plan the search finds on the job's data."""
    if config.parallel.plan != "auto":
        plan = load_training_plan(config)
        dataset_shapes(config)  # the job's one report of bad records; the ranks read the caches it writes
        return plan, None
    report = search_training_plan(config, dataset_shapes(config))
    return report.best, report


def _say_data_position(config: Config, step: int, console) -> None:
    """Where the resumed run's data continues, said where the global batch changed since the checkpoint
    (step ``k`` no longer starts at ``k x global_batch``: `harmonia.train.iteration.DataOrder`)."""
    from harmonia.runtime.checkpoint import read_trainer_state

    position = read_trainer_state(config.checkpoint.dir, step).get("data_position")
    if position is not None and position != step * config.train.global_batch:
        console.print(f"the data continues at sample {position} of the stream, where step-{step} stopped (global "
                      f"batch {config.train.global_batch} now, another before): none skipped, none repeated",
                      markup=False)


def _say_replaced_metrics(config: Config, console) -> None:
    """A run starting at step 0 replaces the records an earlier run left in ``log.dir/metrics.jsonl``
    (the writer keeps only the steps before the one a run starts at): said, with how to keep them."""
    from harmonia.metrics import step_records

    path = Path(config.log.dir) / "metrics.jsonl"
    steps = [step for step, _ in step_records(path)]
    if steps:
        console.print(f"{path} holds {len(steps)} records of steps {min(steps)}-"
                      f"{max(steps)} an earlier run wrote; this run, starting at step 0, replaces them (give it "
                      "another log.dir to keep them)", markup=False)


def evaluate(config: Config, checkpoint_step: int | None) -> dict[str, tuple[float, float, int, float]]:
    """Held-out accuracy per task of the initial model and of the checkpoint: (before, after, n, chance)."""
    import torch.distributed.checkpoint as dcp

    from harmonia.data.evaluate import answer_accuracy, chance_accuracy
    from harmonia.train.weights import initial_model

    spec = model_spec(config)
    ds = open_split(config, "heldout", spec)
    if ds is None:
        return {}
    samples = ds.load(list(range(len(ds))))
    source = config.model.source if config.model.from_checkpoint else None
    model = initial_model(spec, config.train.seed, source)
    before = answer_accuracy(model, samples, ds.tokenizer)
    if checkpoint_step is None:
        return {t: (acc, acc, n, chance_accuracy(t)) for t, (acc, n) in before.items()}
    step = Path(config.checkpoint.dir) / f"step-{checkpoint_step}"
    if source is not None:  # the checkpoint holds what training changed; the model has the source's frozen rest
        from harmonia.train.export import load_beside_source

        load_beside_source(model, step, spec, source)
    else:
        state = {"model": dict(model.state_dict())}
        with warnings.catch_warnings():  # loading in one process is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(step), no_dist=True)
    after = answer_accuracy(model, samples, ds.tokenizer)
    return {t: (before[t][0], after[t][0], n, chance_accuracy(t)) for t, (_, n) in after.items()}


def print_plan(plan: Plan, report: PlanReport | None, console, spec=None) -> None:
    """The plan's layouts per module and, with the model's ``spec``, what each module trains and its
    trainable parameters (LoRA adapters counted), then the total."""
    from rich.table import Table

    from harmonia.model.mllm import trainable_counts

    console.print(f"plan: {plan.placement.value}, {plan.schedule}, {plan.n_microbatches} microbatches per LLM "
                  f"replica, global batch {plan.global_batch}")
    counts = trainable_counts(spec) if spec is not None else {}
    table = Table()
    for col in ("module", "ranks", "pp", "dp", "tp", "cp", "fsdp", *(("trains", "trainable / all") if counts else ())):
        table.add_column(col)
    for module, lay in plan.layouts.items():
        table.add_row(module, ",".join(map(str, lay.rank_list())), str(lay.pp), str(lay.dp), str(lay.tp),
                      str(lay.cp), ("reshard" if lay.resharded else "yes") if lay.sharded else "no",
                      *((spec.training_of(module).mode.value, _count_pair(*counts[module])) if counts else ()))
    console.print(table)
    if counts:
        for proj in spec.projectors:
            console.print(f"{proj} (with its encoder's last stage): trains {spec.training_of(proj).mode.value}, "
                          f"{_count_pair(*counts[proj])}", markup=False)
        trained, total = (sum(c[i] for c in counts.values()) for i in (0, 1))
        console.print(f"trainable parameters: {trained:,} of {total:,} ({trained / max(total, 1):.2%})", markup=False)
    if report is not None:
        console.print(f"searched {report.simulated} layouts in the simulator ({report.pruned} pruned by their "
                      f"lower bound, {sum(report.rejected.values())} rejected: {dict(report.rejected)}) "
                      f"in {report.seconds:.1f} s", markup=False)


def _count_pair(trained: int, total: int) -> str:
    return f"{_short(trained)} / {_short(total)}"


def _short(n: int) -> str:
    """``1.5B``, ``4.2M``, ``12.3K``, ``512``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def run_training(config: Config, console) -> TrainResult | None:
    """Run the job on local processes (or in this process under torchrun); returns what rank 0 saw
    (None on the other ranks under torchrun).

    Raises:
        HarmoniaError: a config, plan or directory that would fail (before any process starts);
            `harmonia.launch.LaunchError` when a rank fails or hangs; `harmonia.launch.JobStopped`
            when a signal or the time limit stops it.
    """
    from harmonia.launch import launch, under_torchrun, warm_ranks

    config = with_world_size(config)
    if config.parallel.world_size > 1 and not under_torchrun():  # the ranks' imports beside this process's
        warm_ranks(hf=bool(config.model.hf or config.model.llm))
    from harmonia.train.preflight import preflight
    from harmonia.train.report import best_effort
    from harmonia.train.worker import train_worker

    if under_torchrun():
        out = train_worker(config, None, prepare_shared)
        if out is None:
            return None
        return _finish(out["config"], Plan.from_json(out["plan"]), out, None)
    phases = PhaseClock()
    check_cluster(config)
    check_data_path(config)
    check_eval_path(config)
    check_model_files(config)
    check_trackers(config)
    phases.mark("checks")
    with preflight(config) as checked:
        config = checked.config
        phases.mark("preflight")
        if checked.finished:
            return TrainResult(None, [], [], checked.start_step)
        if checked.start_step:
            console.print(f"resumed from step-{checked.start_step} in {config.checkpoint.dir} (train.steps="
                          f"{config.train.steps}; the learning-rate schedule runs to that step)", markup=False)
            _say_data_position(config, checked.start_step, console)
        else:
            _say_replaced_metrics(config, console)
        t0 = time.perf_counter()
        if prepare_data(config):
            console.print(f"synthesized {config.data.synthesize} training and {config.data.heldout} held-out samples "
                          f"in {config.data.path} ({time.perf_counter() - t0:.1f} s)", markup=False)
        config = with_epochs(config, console)
        phases.mark("data")
        plan, report = resolve_plan(config)
        check_eval_data(config)
        phases.mark("shape pass and plan")
        print_plan(plan, report, console, model_spec(config))
        from harmonia.train.report import phase_line

        n = config.parallel.world_size
        phase_line(f"starting {n} processes ({backend_of(config)} backend)" if n > 1 else
                   f"training in this process: one rank ({backend_of(config)} backend)")
        best_effort("plan.json", plan.save, Path(config.log.dir) / "plan.json")
        out = launch(train_worker, config.parallel.world_size, (config, plan.to_json(), None, time.time()),
                     timeout=config.parallel.timeout_s or None, hang_timeout=hang_timeout(config), in_process=True)
        out["startup"] = {**phases.seconds, **out.get("startup", {})}
        return _finish(config, plan, out, report)


class PhaseClock:
    """Seconds of each start-up phase of the launcher, in order (`mark` ends the current one)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now


def prepare_shared(config: Config):
    """Under torchrun, on rank 0: check the files (the returned `Preflight` holds the checkpoint lock),
    prepare the data and the plan (printed and saved). Returns (plan, checked config, preflight)."""
    from harmonia.train.preflight import preflight
    from harmonia.train.report import best_effort, console

    check_data_path(config)
    check_eval_path(config)
    check_model_files(config)
    check_trackers(config)
    checked = preflight(config)
    try:
        prepare_data(checked.config)
        config = with_epochs(checked.config, console)
        plan, report = resolve_plan(config)
        check_eval_data(config)
        print_plan(plan, report, console, model_spec(config))
        best_effort("plan.json", plan.save, Path(config.log.dir) / "plan.json")
        return plan, config, checked
    except BaseException:
        checked.close()
        raise


def _throughput(records: list[dict]) -> dict | None:
    """Real tokens and samples this run trained over the wall-clock seconds from its first step's
    start to its last step's end (`harmonia.train.step_figures.TrainingWindow`), and the seconds of
    that window inside the steps (forward, backward, optimizer: every step's ``step_s``)."""
    if not records:
        return None
    last = records[-1]
    return {"steps": len(records), "elapsed_s": last["elapsed_s"], "in_steps_s": sum(r["step_s"] for r in records),
            "tokens": sum(r["tokens"] for r in records),
            "samples": sum(r["samples"] for r in records), "tokens_per_s": last["tokens_per_s"],
            "samples_per_s": last["samples_per_s"]}


def _finish(config: Config, plan: Plan, out: dict, report: PlanReport | None) -> TrainResult:
    """Held-out accuracy from the newest checkpoint, and ``summary.json`` (a failed write only warns)."""
    from harmonia.runtime.checkpoint import latest_step
    from harmonia.train.report import best_effort

    from harmonia.train.report import phase_line

    phase_line("held-out evaluation and summary")
    accuracy = evaluate(config, latest_step(config.checkpoint.dir))
    result = TrainResult(plan, out["records"], out["losses"], out["start_step"], accuracy, report, out.get("evals", []))
    summary = json.dumps({
        "plan": json.loads(plan.to_json()), "losses": result.losses, "start_step": result.start_step,
        "eval_losses": result.evals,
        "accuracy": {t: dict(zip(("before", "after", "n", "chance"), v)) for t, v in accuracy.items()},
        "throughput": _throughput(result.records), "startup": out.get("startup"),
        "last": result.records[-1] if result.records else None}, indent=1, default=float)
    best_effort("summary.json", (Path(config.log.dir) / "summary.json").write_text, summary)
    if out.get("startup"):
        log.debug("start-up: " + ", ".join(f"{k} {v:.2f} s" for k, v in out["startup"].items()))
    return result
