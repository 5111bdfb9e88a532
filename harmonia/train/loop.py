"""The per-rank training loop: one process of `harmonia train`.

Each rank builds its share of the model from the plan, then for every step takes the iteration the
prefetch thread prepared a step ahead (balanced microbatches, searched schedule, its own tensors,
decoded by its data workers), agrees with the other ranks on samples that failed to decode,
runs it through the executor, and steps the optimizers with the step's learning rate. Rank 0 logs
metrics (every rank's figures of a logged step ride on the next step's agreement:
`harmonia.train.step_figures`), drives the progress bar, and writes the measured and simulated
timelines of one step.
Checkpoints are collective (every ``checkpoint.every`` steps and at the end).

Nothing a rank does can corrupt the run: the step's loss and gradient norm are checked before the
optimizer step (a non-finite step stops the job, or is skipped, by ``train.on_nonfinite``), and
weights are checked before a save. A stop signal is voted on at every step boundary, so every
rank stops after the same step (saving a checkpoint when ``checkpoint.on_signal``) and raises
`StopRequested` with one line that says what happened. A heartbeat thread lets the launcher (or,
under torchrun, the other ranks) name a rank that stopped responding.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from harmonia.config import Config
from harmonia.model.training_mode import Trainability
from harmonia.errors import HarmoniaError
from harmonia.schedule.plan import Plan
from harmonia.runtime.checkpoint import latest_step
from harmonia.model.dtensors import is_dtensor
from harmonia.runtime.grads import LossAndNorm
from harmonia.runtime.watchdog import StopRequested, StopSignals, exit_with_parent, signal_name
from harmonia.schedule.graph import LLM
from harmonia.train.faults import FAULT_ENV, Faults
from harmonia.train.iteration import DataOrder, IterationBuilder, PreparedIteration
from harmonia.train.next_step import NextStep
from harmonia.train.lr_schedule import LRSchedule
from harmonia.train.backend import backend_of, job_cluster, schedule_search
from harmonia.train.calibrate import MeasuredAction, fit_calibration
from harmonia.train.planning import PRECISION_MIXED, model_spec
from harmonia.train.rank_data import StepAgreement, agree_failures
from harmonia.train.step_figures import (LoggedStep, TrainingWindow, is_logged, peak_rss_bytes, step_times,
                                         times_row, with_gathered)
from harmonia.train.hf_exports import BackgroundExports
from harmonia.train.rank import build_rank_model, rank_device, schedule_graph, to_device
from harmonia.train.report import best_effort, write_timelines
from harmonia.train.state import load_training, save_training

__all__ = ["FAULT_ENV", "Trainer", "TrainingError", "build_lr_schedule", "build_optimizer", "learning_rate",
           "set_learning_rates"]

log = logging.getLogger(__name__)

STOP_SETTLE_S = 0.5
"""After a rank asks to stop, the others' signals this long after still count as theirs in the message."""
MAX_SKIPPED_IN_A_ROW = 3
"""With ``train.on_nonfinite=skip``, this many non-finite steps in a row stop the job anyway."""


class TrainingError(HarmoniaError):
    """Training cannot go on (a non-finite loss, ...); the message names the step and the batch."""

    exit_code = 1


def build_lr_schedule(config: Config) -> LRSchedule:
    """The job's learning-rate schedule (``train.lr_schedule``, ``warmup``, ``min_lr_ratio``, ``decay_ratio``)."""
    tc = config.train
    return LRSchedule(tc.lr_schedule, tc.steps, tc.warmup_steps, tc.min_lr_ratio, tc.decay_steps)


def learning_rate(config: Config, step: int, module: str | None = None) -> float:
    """The lr of ``step``: linear warm-up over ``train.warmup_steps``, then ``train.lr_schedule``
    (by default a cosine decay to 10% of the peak), from ``module``'s peak lr (`TrainConfig.lr_of`;
    ``train.lr`` for None)."""
    return build_lr_schedule(config).lr(config.train.lr_of(module), step)


def build_optimizer(config: Config, param_groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW over one runner's param groups (`ModuleRunner.param_groups`), each at its module's peak
    lr and weight decay (`TrainConfig.lr_of`, `TrainConfig.weight_decay_of`): torch's fused kernel
    (one pass over each parameter, no temporaries the size of the states; about 3.5x faster per
    step than the per-parameter loop on a small model's ~50 tensors) where the parameters are all
    plain tensors or all DTensors of one mesh, which it takes together; the per-parameter loop
    otherwise (TP keeps norms whole beside its sharded weights)."""
    tc = config.train
    groups = [{**g, "lr": tc.lr_of(g.get("module")), "weight_decay": tc.weight_decay_of(g.get("module"))}
              for g in param_groups]
    meshes = {p.device_mesh if is_dtensor(p) else None for g in groups for p in g["params"]}
    fused = {"fused": True} if len(meshes) <= 1 else {"foreach": False}
    return torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay, **fused)


def set_learning_rates(optimizers: dict[str, torch.optim.Optimizer], config: Config, step: int) -> None:
    """Give every param group its module's lr of ``step`` (a group without a ``module`` the global one)."""
    for opt in optimizers.values():
        for group in opt.param_groups:
            group["lr"] = learning_rate(config, step, group.get("module"))


@dataclass
class StepOutcome:
    """What one step gave: the global loss and gradient norm, and whether its update was skipped."""

    loss: float
    grad_norm: float
    skipped: bool = False
    ahead_s: float = 0.0  # wall seconds of it spent preparing the next step (`harmonia.train.next_step`)
    ahead_cpu_s: float = 0.0  # and this process's CPU seconds


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (dataclasses, lists, tuples, dicts walked)."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


@contextlib.contextmanager
def frozen_heap():
    """The objects built before training (imports, model, dataset index, plan, tokenizer: 0.4 million
    on the tiny LLaVA) kept out of the garbage collector's full passes while the steps run: the young
    generations collected, then everything frozen (``gc.freeze``), unfrozen after. Without it every
    full pass walks them all again (0.22 s each on that job), and where one falls inside training it
    falls at a different step on each rank, which the others then wait for at the next collective.
    Garbage already in the oldest generation waits for the end of the run, as where a framework
    collects only the young generations during training; ranks forked from the fork server start
    with the imports already frozen (`harmonia.train.frozen_imports`)."""
    t0 = time.perf_counter()
    gc.collect(1)
    gc.freeze()
    log.debug("garbage collected and %d objects frozen in %.3f s", gc.get_freeze_count(), time.perf_counter() - t0)
    try:
        yield
    finally:
        gc.unfreeze()


def _worker_exits_with_rank(rank_pid: int) -> None:
    """A data worker process stops with the rank that forked it (5 s to finish a sample)."""
    exit_with_parent(rank_pid, grace_s=5.0)


class Trainer:
    """One rank of a training job.

    Args:
        config: the job's config.
        plan: the plan every rank runs.
        rank: this process's rank (the process group is already initialised).
    """

    def __init__(self, config: Config, plan: Plan, rank: int) -> None:
        from harmonia.data.decode import SampleDecoder
        from harmonia.runtime.meshes import build_module_meshes
        from harmonia.train.data import open_training_data
        from harmonia.train.preflight import run_fingerprint
        from harmonia.train.source_state import source_provided
        from harmonia.workload.cost import CostModel

        self.config, self.plan, self.rank = config, plan, rank
        self.spec = model_spec(config)
        self.device = rank_device(backend_of(config))
        self.meshes = build_module_meshes(plan, self.device.type)
        tc = config.train
        self.model = build_rank_model(self.spec, plan, self.meshes, tc.seed, partial(build_optimizer, config),
                                      tc.max_norm or None, self.device, tc.precision,
                                      source=config.model.source if config.model.from_checkpoint else None,
                                      attention=tc.attention, compile=tc.compile)
        self.dataset, shapes = open_training_data(config, self.spec, rank)
        self.order = DataOrder(list(shapes), tc.global_batch, tc.seed)
        self.data_group = dist.new_group(backend="gloo")  # the ranks agree on samples that failed to decode
        cluster = job_cluster(config)
        if PRECISION_MIXED[tc.precision] is not None:
            cluster = cluster.with_device(mixed_precision=PRECISION_MIXED[tc.precision])
        cost = CostModel(self.spec, cluster.device)
        self.builder = IterationBuilder(self.spec, plan, self.dataset, self.order, cost, cluster,
                                        schedule_graph(self.spec, plan), rank,
                                        search_evaluations=schedule_search(config), simulate=rank == 0,
                                        simulate_steps=self._simulated, shapes=shapes,
                                        decoder=SampleDecoder(self.dataset, config.data.num_workers,
                                                              _worker_exits_with_rank, config.data.cache_mb * 2**20),
                                        agree=self._agree,
                                        assignment=tc.assignment,
                                        predict_peaks=self.device.type == "cuda" or config.log.memory)
        self.evaluation = self._evaluation(cost, cluster) if tc.eval_every else None
        self.report_eval = lambda record: None
        self.modules = [LLM, *plan.encoders]
        self.fingerprint = run_fingerprint(config)
        source = config.model.source if config.model.from_checkpoint else None
        self.from_source = frozenset(source_provided(self.spec, source, self.model.named, self.model.owner))
        self.source_modules = [] if source is None else [  # the same list on every rank, for trainer.json
            m for m in self.spec.module_names if self.spec.training_of(m).mode is not Trainability.FULL]
        self.faults = Faults(rank)
        self.start_step = 0
        self.saved_step = 0  # the newest step with a checkpoint (0: none, or the initial weights)
        self.nonfinite_in_a_row = 0
        self.losses: list[float] = []
        self.first_step_at: float | None = None  # time.time() when this run's first step began
        self.exports = BackgroundExports(config.checkpoint.dir, config.checkpoint.export_every)
        self.timeline: tuple | None = None  # rank 0: the measured step drawn beside its simulation, after training

    def _evaluation(self, cost, cluster):
        """The evaluation set's batches (`harmonia.train.eval_loss.EvalLoss`), prepared like the
        training's with the order search off."""
        from harmonia.data.decode import SampleDecoder
        from harmonia.train.data import open_eval_data
        from harmonia.train.eval_loss import EvalLoss

        tc = self.config.train
        dataset, shapes = open_eval_data(self.config, self.spec)
        where = self.config.data.eval_path or f"beside data.path={self.config.data.path!r}"
        if dataset is None:
            raise HarmoniaError(f"train.eval_every={tc.eval_every}: no evaluation set {where}; set data.eval_path")
        n_batches, left_out = EvalLoss.batches_of(len(shapes), tc.global_batch, where)
        builder = IterationBuilder(self.spec, self.plan, dataset, DataOrder(list(shapes), tc.global_batch, tc.seed),
                                   cost, cluster, schedule_graph(self.spec, self.plan, forward_only=True), self.rank,
                                   search_evaluations=0, shapes=shapes, decoder=SampleDecoder(dataset, 0),
                                   agree=self._agree,
                                   assignment=tc.assignment)
        return EvalLoss(builder, n_batches, left_out)

    def _simulated(self, step: int) -> bool:
        """Whether rank 0 simulates ``step`` on the cluster model: where it is logged, fits the cost
        model (the run's second step) or is drawn beside its simulation (its fifth), as `run` says."""
        last = self.config.train.steps - 1
        return is_logged(self.config, step) or step in (self.start_step + 1, min(self.start_step + 4, last))

    def _evaluate(self, done: int) -> None:
        """The evaluation loss after ``done`` steps (collective), reported by rank 0."""
        result = self.evaluation.run(self.model, self.device)
        if self.rank == 0:
            self.report_eval({"step": done, "loss": result.loss, "batches": result.batches,
                              "samples": result.samples, "left_out": self.evaluation.left_out})

    def resume(self) -> None:
        """Load the newest checkpoint of ``checkpoint.dir`` when resuming is on and one exists."""
        ck = self.config.checkpoint
        if ck.resume and latest_step(ck.dir) is not None:
            state = load_training(ck.dir, self.model, omit=self.from_source)
            self.start_step = self.saved_step = int(state["step"])
            self.losses = list(state.get("losses", []))
            position = int(state.get("data_position", self.start_step * self.config.train.global_batch))
            self.order.resume_at(self.start_step, position)  # where the stream stopped, whatever the batch was

    def _save(self, step: int) -> None:
        ck = self.config.checkpoint
        if self.rank == 0:
            self.exports.wait()  # the export reads a checkpoint this save may delete
        save_training(ck.dir, step, self.model,
                      {"data_position": self.order.position(step), "losses": self.losses,
                       "plan": json.loads(self.plan.to_json()), "fingerprint": self.fingerprint,
                       "from_source": self.source_modules},
                      keep=ck.keep, before_commit=lambda: self.faults.inside_save(step), omit=self.from_source)
        self.saved_step = step
        if self.rank == 0:
            self.exports.after_save(step)

    def run(self, report, stops: StopSignals | None = None, progress=None, report_eval=None) -> None:
        """Train from ``start_step`` to ``train.steps``.

        Args:
            report: receives rank 0's per-step records.
            stops: the stop signals of this process; a signal stops every rank at the next step
                boundary (`StopRequested` is raised after the optional checkpoint).
            progress: called with the number of finished steps after each step (the heartbeat).
            report_eval: receives rank 0's evaluation records (``train.eval_every``).
        """
        from harmonia.schedule.prefetch import SchedulePrefetcher

        if report_eval is not None:
            self.report_eval = report_eval
        tc = self.config.train
        # step start+1 (warm) fits the simulation's cost model; start+4, prepared after that (the
        # prefetcher works a step ahead), is drawn measured beside simulated
        calibration_step, timeline_step = self.start_step + 1, min(self.start_step + 4, tc.steps - 1)
        # on CPU the preparation competes with the step for the GIL and the cores (`SchedulePrefetcher`)
        with frozen_heap(), SchedulePrefetcher(self.builder, first_step=self.start_step, last_step=tc.steps,
                                               background=self.device.type != "cpu") as prefetch:
            try:
                self._steps(report, stops, progress, prefetch, calibration_step, timeline_step)
            finally:
                self.builder.close()
                if self.evaluation is not None:
                    self.evaluation.close()
        if tc.steps > self.saved_step:
            self._save(tc.steps)
        if self.timeline is not None:
            step, actions, predicted, step_s, calibrated = self.timeline
            best_effort("the timelines", write_timelines, Path(self.config.log.dir), step, actions, predicted, step_s,
                        calibrated=calibrated)
        self.exports.wait()

    def _steps(self, report, stops: StopSignals | None, progress, prefetch, calibration_step: int,
               timeline_step: int) -> None:
        tc, ck = self.config.train, self.config.checkpoint
        self.first_step_at = time.time()
        window = TrainingWindow(time.perf_counter())
        done: LoggedStep | None = None  # the step before, its figures not gathered yet
        ahead: NextStep | None = None  # this step, prepared during the one before
        overlap, merges = self._overlaps(prefetch), dist.get_backend() == "gloo"
        try:
            for step in range(self.start_step, tc.steps):
                self.faults.before_step(step, self.model)
                # collective, the step's barrier: failed samples dropped alike, stop signals heard by
                # every rank, every rank's figures of the step before gathered
                it = ahead.take() if ahead is not None else prefetch.get(step)
                if ahead is None or not ahead.settled:
                    it = self.builder.settle(it, stops.signum if stops is not None else 0,
                                             done.row if done is not None else None)
                if done is not None:
                    self._report(report, done, it.rows)
                    done = None
                self._stop_if_asked(step, stops, it.stops)
                set_learning_rates(self.model.executor.optimizers, self.config, step)
                self.model.executor.action_times = []
                t0, cpu0 = time.perf_counter(), time.process_time()
                batch = it.batch if self.device.type == "cpu" else to_device(it.batch, self.device)
                ahead = NextStep(prefetch.get, step + 1) if overlap and step + 1 < tc.steps else None
                # the dataset's counts through this step, before the next one is agreed inside it
                data = self.dataset.stats.metrics() if self.rank == 0 else {}
                with self._peak_count(batch) as measured:  # a step not logged carries the next one's agreement
                    result = self._step(step, it, batch, ahead, stops, merges and not is_logged(self.config, step))
                # the next step's preparation counts as its own (its data wait), not as this step's time
                # (a wait for the gradient reductions it ran beside is not counted in either)
                step_s = time.perf_counter() - t0 - result.ahead_s
                step_cpu = time.process_time() - cpu0 - result.ahead_cpu_s
                self.losses.append(result.loss)
                peaks = (measured.get("held", 0), self.builder.states.get(self.rank, 0.0), measured.get("peak", 0),
                         it.predicted_peak)
                row = (times_row(step_times(self.model.executor.action_times, step_s, self.modules), self.modules,
                                 peaks) if is_logged(self.config, step) else None)
                done = LoggedStep(step, step_s, None, row, measured)
                if self.rank == 0:
                    done.record = {**self._record(step, it, result, step_s, prefetch.stats, data),
                                   **window.add(it.n_tokens, len(it.sample_ids), time.perf_counter())}
                if step in (calibration_step, timeline_step):
                    actions, process_cpu = self._gather_actions(t0, step_cpu)
                    if step == calibration_step and self.rank == 0 and it.predicted is not None:
                        best_effort("calibration.json", self._calibrate, actions, process_cpu, it)
                    if step == timeline_step and self.rank == 0:  # drawn after the last step, outside the window
                        self.timeline = (step, actions, it.predicted, step_s, it.calibrated)
                if progress is not None:
                    progress(step + 1)
                saving = ck.every and (step + 1) % ck.every == 0 and step + 1 < tc.steps
                evaluating = self.evaluation is not None and ((step + 1) % tc.eval_every == 0 or step + 1 == tc.steps)
                if saving or evaluating or step + 1 == tc.steps:  # its record first
                    self._report(report, done, self._gathered(done.row))
                    done = None
                if saving:
                    self._save(step + 1)
                if evaluating:
                    self._evaluate(step + 1)
        finally:
            if done is not None and done.record is not None:  # stopped before its gather: its own figures
                report(done.record)

    def _overlaps(self, prefetch) -> bool:
        """Whether each step prepares the next between its backward and its optimizer step
        (`harmonia.train.next_step`): where the preparation runs in the training's thread
        (`SchedulePrefetcher`'s ``background=False``) and there are other ranks to agree with; not
        while ``log.memory`` counts the step's tensors (the next batch would count in them)."""
        return not prefetch.background and dist.get_world_size() > 1 and not self.config.log.memory

    def _agree(self, failed: list, stop: int, row: torch.Tensor | None,
               extra: torch.Tensor | None = None) -> StepAgreement:
        """`harmonia.train.rank_data.agree_failures` on the data group (collective)."""
        return agree_failures(failed, self.data_group, stop, row, extra)

    def _gathered(self, row: torch.Tensor | None) -> torch.Tensor | None:
        """Every rank's ``row`` (collective on the data group where one is passed; every rank passes
        one, or none does)."""
        return None if row is None else self._agree([], 0, row).rows

    def _report(self, report, done: LoggedStep, rows: torch.Tensor | None) -> None:
        """Rank 0 reports ``done``'s record, with every rank's module times, bubble and memory where
        they were gathered (``rows``)."""
        if self.rank == 0:
            report(done.record if rows is None else with_gathered(done, rows, self.modules))

    @contextlib.contextmanager
    def _peak_count(self, batch):
        """Count the step's peak tensor bytes into the yielded dict's ``peak``: the CUDA allocator's
        (the batch already on the device), or on the CPU with ``log.memory``
        `harmonia.runtime.memory_count.TensorBytes` from what the rank holds between steps (weights,
        gradients, optimizer states: ``held``) and the step's batch; empty otherwise."""
        out: dict[str, int] = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield out
            out["peak"] = torch.cuda.max_memory_allocated(self.device)
            return
        if not self.config.log.memory:
            yield out
            return
        from harmonia.runtime.memory_count import TensorBytes

        counter = TensorBytes()
        counter.begin(self._held())
        out["held"] = counter.live
        counter.begin([*self._held(), *_tensors(batch)])
        with counter:
            yield out
        out["peak"] = counter.peak

    def _held(self) -> list[torch.Tensor]:
        """Every tensor the rank holds between steps: weights, their gradients, optimizer states."""
        ex = self.model.executor
        tensors = list(self.model.named.values())
        tensors += [p.grad for p in self.model.trainable_named().values() if p.grad is not None]
        tensors += [v for opt in ex.optimizers.values() for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor)]
        return tensors

    def _step(self, step: int, it: PreparedIteration, batch, ahead: NextStep | None = None,
              stops: StopSignals | None = None, merged: bool = False) -> StepOutcome:
        """Forward, backward and gradient norm; the optimizer step only when loss and norm are finite.
        ``ahead`` (the next step) is prepared between them (`harmonia.train.next_step`), while the
        step's last gradient reductions are in flight; ``merged``, it is agreed on in one collective
        with the loss and norm."""
        ex = self.model.executor
        share = ex.loss_share(it.schedule, batch, ahead.prepare if ahead is not None else None)
        self.faults.after_backward(step, self.model)
        if ahead is not None and merged:
            local = LossAndNorm.local(share, ex.norm_share())
            signum = stops.signum if stops is not None else 0
            reduction = LossAndNorm(ahead.agree(self.builder, self._agree, signum, local), None)
        else:
            reduction = LossAndNorm.start(share, ex.norm_share(), ex.norm_group)
        spent = {} if ahead is None else {"ahead_s": ahead.prepare_s, "ahead_cpu_s": ahead.prepare_cpu_s}
        loss, norm = reduction.clip(ex.trainable, ex.max_norm)
        if math.isfinite(loss) and math.isfinite(norm):
            ex.optimizer_step()
            self.nonfinite_in_a_row = 0
            return StepOutcome(loss, norm, **spent)
        self.nonfinite_in_a_row += 1
        what = (f"loss is {loss} (gradient norm {norm})" if not math.isfinite(loss) else
                f"gradient norm is {norm} (loss {loss})")
        message = f"step {step}: {what}; batch samples {it.sample_ids}"
        if self.config.train.on_nonfinite == "skip" and self.nonfinite_in_a_row < MAX_SKIPPED_IN_A_ROW:
            if self.rank == 0:
                log.warning("%s; its update was skipped (train.on_nonfinite=skip)", message)
            return StepOutcome(loss, norm, skipped=True, **spent)
        newest = f"step-{self.saved_step}" if self.saved_step else "none yet"
        again = f" ({self.nonfinite_in_a_row} steps in a row)" if self.nonfinite_in_a_row > 1 else ""
        raise TrainingError(f"{message}{again}; the weights were not updated, so the newest checkpoint ({newest}) "
                            "holds finite weights; lower train.lr, check those samples, or set "
                            "train.on_nonfinite=skip")

    def _stop_votes(self, stops: StopSignals | None) -> dict[int, int]:
        """Every rank's pending stop signal, gathered (collective): rank -> signal, for ranks that have one."""
        mine = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=self.device)
        mine[self.rank] = stops.signum if stops is not None else 0
        dist.all_reduce(mine)
        return {r: int(s) for r, s in enumerate(mine.tolist()) if s}

    def _stop_if_asked(self, step: int, stops: StopSignals | None, asked: dict[int, int]) -> None:
        """Stop here if any rank has a stop signal (``asked``, as every rank agreed: collective then);
        the message says which ranks got one."""
        if not asked:
            return
        time.sleep(STOP_SETTLE_S)  # a signal sent to every rank reaches them a moment apart
        asked = self._stop_votes(stops)
        first = min(asked)
        signum = asked[first]
        who = (f"stopped by {signal_name(signum)}" if len(asked) == dist.get_world_size() else
               f"rank {first} received {signal_name(signum)}" + (f" (and ranks {sorted(asked)[1:]} too)"
                                                                 if len(asked) > 1 else "")
               + ": every rank stopped")
        where = f"{who} at step {step}/{self.config.train.steps}"
        ck = self.config.checkpoint
        if ck.on_signal and step > self.saved_step:
            self._save(step)
            raise StopRequested(f"{where}; saved checkpoint step-{step} in {ck.dir}; run the same command to resume",
                                signum)
        kept = (f"the newest checkpoint is step-{self.saved_step} in {ck.dir}" if self.saved_step else
                "no checkpoint was saved")
        why = "" if ck.on_signal or step == self.saved_step else " (checkpoint.on_signal=false)"
        raise StopRequested(f"{where}; {kept}{why}", signum)

    def _record(self, step: int, it: PreparedIteration, result: StepOutcome, step_s: float, stats,
                data: dict) -> dict:
        """Rank 0's record of ``step``; ``data``: the dataset's counts through it (`DataStats.metrics`)."""
        loads = it.assignment.loads
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else peak_rss_bytes()
        return {
            "step": step, "loss": result.loss, "grad_norm": result.grad_norm, "update_skipped": result.skipped,
            "lr": learning_rate(self.config, step), "step_s": step_s,
            **({"lr_modules": {m: learning_rate(self.config, step, m) for m in self.config.train.modules}}
               if self.config.train.modules else {}),
            "step_tokens_per_s": it.n_tokens / step_s, "step_samples_per_s": len(it.sample_ids) / step_s,
            "tokens": it.n_tokens, "samples": len(it.sample_ids),
            "balance": {"microbatch_imbalance": it.assignment.imbalance(),
                        "microbatch_samples_min": min(map(len, it.assignment.microbatches)),
                        "microbatch_samples_max": max(map(len, it.assignment.microbatches)),
                        "llm_work_max_over_mean": float(loads[:, 0].max() / max(loads[:, 0].mean(), 1e-30))},
            "simulated_step_s": it.predicted.iteration_s if it.predicted is not None else float("nan"),
            "simulated_calibrated": it.calibrated,
            "schedule_prepare_s": it.prepare_s, "schedule_hidden_frac": stats.hidden_frac,
            "sub_microbatches": it.n_sub,
            "microbatches": it.assignment.n_microbatches,  # per LLM replica: the plan's, or more for a heavy step
            "data_wait_s": next((w for k, _, w in reversed(stats.per_step) if k == step), 0.0) + it.settle_s,
            "peak_memory_bytes": peak, "skipped": it.skipped, **data,
            "epoch": self.order.epoch_of(step + 1),
        }

    def _gather_actions(self, t0: float, step_cpu: float) -> tuple[dict[int, list[MeasuredAction]], dict[int, float]]:
        """Every rank's measured compute actions of this step, and its process's CPU seconds over the
        step (all its threads), on every rank."""
        mine = [MeasuredAction(str(a), a.module, a.kind.value, s - t0, e - t0, cpu)
                for a, s, e, cpu in self.model.executor.action_times or []]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.rank, mine, step_cpu))
        return {r: acts for r, acts, _ in gathered}, {r: cpu for r, _, cpu in gathered}

    def _calibrate(self, actions: dict[int, list[MeasuredAction]], process_cpu: dict[int, float],
                   it: PreparedIteration) -> None:
        """Fit the simulation's cost model to this measured step (rank 0)."""
        calibration = fit_calibration(self.builder.cost, actions, it.predicted,
                                      cpu_time=self.builder.cluster.shares_cores, process_cpu_s=process_cpu)
        if calibration is not None:
            self.builder.calibrate(calibration)
            calibration.save(Path(self.config.log.dir) / "calibration.json")
