"""The per-rank training loop: one process of `harmonia train`.

Each rank builds its share of the model from the plan, then for every step takes the iteration the
prefetch thread prepared a step ahead (balanced microbatches, searched schedule, its own tensors),
runs it through the executor, and steps the optimizers with the step's learning rate. Rank 0 logs
metrics, drives the progress bar, and writes the measured and simulated timelines of one step.
Checkpoints are collective (every ``checkpoint.every`` steps and at the end).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from harmonia.config import Config
from harmonia.errors import HarmoniaError
from harmonia.plan.plan import Plan
from harmonia.schedule.graph import LLM
from harmonia.train.iteration import DataOrder, IterationBuilder, PreparedIteration
from harmonia.train.planning import model_spec
from harmonia.train.job import backend_of
from harmonia.train.rank import RankModel, build_rank_model, rank_device, schedule_graph, to_device
from harmonia.train.report import write_timelines
from harmonia.train.state import load_training, save_training

FAULT_ENV = "HARMONIA_FAULT"
"""``<raise|kill|nan>:<rank>:<step>`` makes that rank fail at that step, to exercise fault handling:
raise an exception, die by SIGKILL, or poison its weights so the step's loss is NaN. It fires on a
job's first attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted job gets past it."""


class TrainingError(HarmoniaError):
    """Training cannot go on (a non-finite loss, ...); the message names the step and the batch."""


def learning_rate(config: Config, step: int) -> float:
    """Linear warm-up over ``train.warmup`` steps, then cosine decay to 10% of the peak."""
    peak, warm, total = config.train.lr, config.train.warmup, config.train.steps
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _inject_fault(rank: int, step: int, model: RankModel) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    kind, r, s = spec.split(":")
    if int(r) != rank or int(s) != step:
        return
    if kind == "kill":
        os.kill(os.getpid(), 9)
    if kind == "nan":
        with torch.no_grad():
            next(iter((model.trainable_named() or model.named).values())).fill_(float("nan"))
        return
    raise RuntimeError(f"injected fault on rank {rank} at step {step}")


@dataclass
class StepTimes:
    """Measured action times of one step on this rank, by module, and the busy fraction."""

    step_s: float
    module_s: dict[str, float] = field(default_factory=dict)
    busy_s: float = 0.0


def _step_times(model: RankModel, step_s: float, modules: list[str]) -> StepTimes:
    times = StepTimes(step_s, {m: 0.0 for m in modules})
    for a, start, end in model.executor.action_times or []:
        times.module_s[a.module] += end - start
        times.busy_s += end - start
    return times


def _reduce_times(times: StepTimes, modules: list[str]) -> tuple[dict[str, float], float]:
    """Per module, the slowest rank's time in it; and the bubble fraction over all ranks."""
    t = torch.tensor([times.module_s[m] for m in modules] + [times.busy_s], dtype=torch.float64)
    slowest = t.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    total_busy = t[-1:].clone()
    dist.all_reduce(total_busy)
    world = dist.get_world_size()
    bubble = 1.0 - float(total_busy) / (world * times.step_s) if times.step_s > 0 else 0.0
    return {m: float(slowest[i]) for i, m in enumerate(modules)}, max(0.0, bubble)


class Trainer:
    """One rank of a training job.

    Args:
        config: the job's config.
        plan: the plan every rank runs.
        rank: this process's rank (the process group is already initialised).
    """

    def __init__(self, config: Config, plan: Plan, rank: int) -> None:
        from harmonia.data.loader import MultimodalDataset
        from harmonia.runtime.meshes import build_module_meshes
        from harmonia.workload.cost import CostModel
        from harmonia.workload.devices import cluster_from_string

        self.config, self.plan, self.rank = config, plan, rank
        self.spec = model_spec(config)
        self.device = rank_device(backend_of(config))
        self.meshes = build_module_meshes(plan, self.device.type)
        tc = config.train
        self.model = build_rank_model(self.spec, plan, self.meshes, tc.seed, self._optimizer,
                                      tc.max_norm or None, self.device, tc.precision,
                                      source=config.model.source if config.model.from_checkpoint else None)
        self.dataset = MultimodalDataset(Path(config.data.path) / "train", self.spec, config.data.max_tokens,
                                         on_error=config.data.on_error)
        usable = [s.sample_id for s in self.dataset.shapes()]
        self.order = DataOrder(usable, tc.global_batch, tc.seed)
        cluster = cluster_from_string(config.parallel.cluster)
        cost = CostModel(self.spec, cluster.device)
        self.builder = IterationBuilder(self.spec, plan, self.dataset, self.order, cost, cluster,
                                        schedule_graph(self.spec, plan), rank,
                                        search_evaluations=config.parallel.schedule_search, simulate=rank == 0)
        self.modules = [LLM, *plan.encoders]
        self.start_step = 0
        self.losses: list[float] = []

    def _optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        tc = self.config.train
        return torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, foreach=False)

    def resume(self) -> None:
        """Load the newest checkpoint of ``checkpoint.dir`` when resuming is on and one exists."""
        from harmonia.runtime.checkpoint import latest_step

        ck = self.config.checkpoint
        if ck.resume and latest_step(ck.dir) is not None:
            state = load_training(ck.dir, self.model)
            self.start_step = int(state["step"])
            self.losses = list(state.get("losses", []))

    def _set_lr(self, step: int) -> None:
        lr = learning_rate(self.config, step)
        for opt in self.model.executor.optimizers.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def _save(self, step: int) -> None:
        save_training(self.config.checkpoint.dir, step, self.model,
                      {"data_position": step * self.config.train.global_batch, "losses": self.losses,
                       "plan": json.loads(self.plan.to_json())})

    def run(self, report) -> None:
        """Train from ``start_step`` to ``train.steps``; ``report`` receives rank 0's per-step records."""
        from harmonia.schedule.prefetch import SchedulePrefetcher

        tc, ck = self.config.train, self.config.checkpoint
        # step start+1 (warm) fits the simulation's cost model; start+4, prepared after that (the
        # prefetcher works up to two steps ahead), is drawn measured beside simulated
        calibration_step, timeline_step = self.start_step + 1, min(self.start_step + 4, tc.steps - 1)
        with SchedulePrefetcher(self.builder, first_step=self.start_step, last_step=tc.steps) as prefetch:
            for step in range(self.start_step, tc.steps):
                it = prefetch.get(step)
                self._set_lr(step)
                _inject_fault(self.rank, step, self.model)
                self.model.executor.action_times = []
                dist.barrier()
                t0 = time.perf_counter()
                batch = it.batch if self.device.type == "cpu" else to_device(it.batch, self.device)
                result = self.model.executor.step(it.schedule, batch)
                step_s = time.perf_counter() - t0
                if not math.isfinite(result.loss):
                    raise TrainingError(f"step {step}: loss is {result.loss} (gradient norm {result.grad_norm}); "
                                        f"batch samples {it.sample_ids}; lower train.lr or check those samples")
                self.losses.append(result.loss)
                times = _step_times(self.model, step_s, self.modules)
                module_s, bubble = _reduce_times(times, self.modules)
                if step in (calibration_step, timeline_step):
                    actions = self._gather_actions(t0)
                    if step == calibration_step and self.rank == 0 and it.predicted is not None:
                        self._calibrate(actions, it)
                    if step == timeline_step and self.rank == 0:
                        write_timelines(Path(self.config.log.dir), step, actions, it.predicted, step_s,
                                        calibrated=it.calibrated)
                if self.rank == 0:
                    report(self._record(step, it, result, step_s, module_s, bubble, prefetch.stats))
                if ck.every and (step + 1) % ck.every == 0 and step + 1 < tc.steps:
                    self._save(step + 1)
        self._save(tc.steps)

    def _record(self, step: int, it: PreparedIteration, result, step_s: float, module_s: dict[str, float],
                bubble: float, stats) -> dict:
        loads = it.assignment.loads
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _rss_bytes()
        return {
            "step": step, "loss": result.loss, "grad_norm": result.grad_norm,
            "lr": learning_rate(self.config, step), "step_s": step_s,
            "tokens_per_s": it.n_tokens / step_s, "samples_per_s": len(it.sample_ids) / step_s,
            "tokens": it.n_tokens, "samples": len(it.sample_ids),
            "time": {m: module_s[m] for m in self.modules}, "bubble_frac": bubble,
            "balance": {"microbatch_imbalance": it.assignment.imbalance(),
                        "microbatch_samples_min": min(map(len, it.assignment.microbatches)),
                        "microbatch_samples_max": max(map(len, it.assignment.microbatches)),
                        "llm_work_max_over_mean": float(loads[:, 0].max() / max(loads[:, 0].mean(), 1e-30))},
            "simulated_step_s": it.predicted.iteration_s if it.predicted is not None else float("nan"),
            "simulated_calibrated": it.calibrated,
            "schedule_prepare_s": it.prepare_s, "schedule_hidden_frac": stats.hidden_frac,
            "peak_memory_bytes": peak, "skipped": it.skipped, **self.dataset.stats.metrics(),
            "epoch": self.order.epoch_of(step + 1),
        }

    def _gather_actions(self, t0: float) -> dict[int, list]:
        """Every rank's measured actions of this step, on rank 0 (rank -> (name, module, kind, start, end))."""
        mine = [(str(a), a.module, a.kind.value, s - t0, e - t0) for a, s, e in self.model.executor.action_times or []]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.rank, mine))
        return dict(gathered)

    def _calibrate(self, actions: dict[int, list], it: PreparedIteration) -> None:
        """Fit the simulation's cost model to this measured step (rank 0)."""
        from harmonia.train.calibrate import fit_calibration

        calibration = fit_calibration(self.builder.cost, actions, it.predicted)
        if calibration is not None:
            self.builder.calibrate(calibration)
            calibration.save(Path(self.config.log.dir) / "calibration.json")


def _rss_bytes() -> int:
    """Peak resident memory of this process (CPU runs)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _shared_plan(config: Config, rank: int) -> str:
    """Under torchrun: rank 0 prepares the data and the plan; every rank gets the plan."""
    from harmonia.train.job import prepare_data, print_plan, resolve_plan
    from harmonia.train.report import console

    box: list = [None]
    if rank == 0:
        try:
            prepare_data(config)
            plan, report = resolve_plan(config)
            print_plan(plan, report, console)
            Path(config.log.dir).mkdir(parents=True, exist_ok=True)
            plan.save(Path(config.log.dir) / "plan.json")
            box[0] = plan.to_json()
        except HarmoniaError as err:
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, its keys prefixed by the torchrun restart attempt.

    A restarted attempt reuses the store of the failed one; without a prefix, gloo's connection
    set-up can read the dead attempt's peer addresses and fail with "connection refused".
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    return dist.PrefixStore(f"harmonia/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def train_worker(config: Config, plan_json: str | None, result_path: str) -> None:
    """Entry point of one rank (spawned by `harmonia.launch.launch` or started by torchrun).

    Args:
        config: the job.
        plan_json: the plan; None under torchrun (rank 0 prepares it).
        result_path: where rank 0 writes its records and losses.
    """
    from harmonia.train.report import ProgressReporter

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend_of(config)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    timeout = datetime.timedelta(minutes=5)
    dist.init_process_group(backend, store=_attempt_store(rank, world, timeout), rank=rank, world_size=world,
                            timeout=timeout)
    try:
        plan = Plan.from_json(plan_json or _shared_plan(config, rank))
        trainer = Trainer(config, plan, rank)
        trainer.resume()
        reporter = ProgressReporter(config, trainer.start_step, enabled=rank == 0)
        with reporter:
            trainer.run(reporter.step)
        if rank == 0:
            Path(result_path).write_text(json.dumps({
                "start_step": trainer.start_step, "losses": trainer.losses,
                "records": reporter.records, "data": trainer.dataset.stats.metrics(),
            }, default=float))
        dist.barrier()
    finally:
        dist.destroy_process_group()
