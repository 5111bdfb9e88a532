"""One process of `harmonia train`: the process group, the heartbeat, the plan, the trainer.

Spawned by `harmonia.launch.launch` (which hosts the rendezvous store and watches every rank), or
started by torchrun, where rank 0 first checks the job's files (`harmonia.train.preflight`), holds
the checkpoint lock, prepares the data and the plan, and shares plan and config with the others;
there each rank also exits with its agent and watches its peers' heartbeats itself.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from harmonia.config import Config
from harmonia.errors import HarmoniaError
from harmonia.schedule.plan import Plan
from harmonia.runtime.watchdog import StopSignals
from harmonia.train.backend import backend_of, cpu_threads, hang_timeout, process_group_backend, process_group_device
from harmonia.train.loop import Trainer


def _shared_plan(config: Config, rank: int, prepare: Callable):
    """Under torchrun: rank 0 runs ``prepare`` (checks the job's files, holding the checkpoint lock until
    the job ends, and prepares the data and the plan); every rank gets the plan and the checked config.
    Returns (plan JSON, config, the `Preflight` to close on rank 0 or None)."""
    box: list = [None]
    checked = None
    if rank == 0:
        try:
            plan, checked_config, checked = prepare(config)
            box[0] = (plan.to_json(), checked_config)
        except HarmoniaError as err:
            box[0] = err
        except BaseException as err:  # the others must not wait for a plan that never comes
            box[0] = RuntimeError(f"rank 0 failed while preparing the job: {type(err).__name__}: {err}")
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0][0], box[0][1], checked


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> tuple[dist.Store, str]:
    """The rendezvous store, its keys prefixed by the restart attempt every rank agreed on, and that attempt.

    A restarted attempt reuses the store of the failed one; without a prefix, gloo's connection
    set-up can read the dead attempt's peer addresses and fail with "connection refused".
    """
    from harmonia.runtime.attempt import ATTEMPT_ENV, agree_attempt

    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = str(agree_attempt(store, rank, world, timeout.total_seconds()))
    os.environ[ATTEMPT_ENV] = attempt  # what this process's faults read (`current_attempt`)
    return dist.PrefixStore(f"harmonia/attempt-{attempt}", store), attempt


def _heartbeat(config: Config, rank: int, world: int, attempt: str):
    """This rank's heartbeat in the job's store; under torchrun it also watches the other ranks."""
    from harmonia.launch import LAUNCHER_ENV
    from harmonia.runtime.watchdog import Heartbeat, connect_store, exit_with_parent

    torchrun = LAUNCHER_ENV not in os.environ
    if torchrun:  # under the local launcher, its entry point did this
        exit_with_parent(os.getppid())
    store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    return Heartbeat(store, rank, world, hang_timeout(config), attempt=attempt, detect=torchrun)


def train_worker(config: Config, plan_json: str | None, prepare: Callable | None = None,
                 launched_at: float | None = None) -> dict | None:
    """Entry point of one rank (spawned by `harmonia.launch.launch` or started by torchrun).

    Args:
        config: the job.
        plan_json: the plan; None under torchrun, where rank 0 gets it from ``prepare``.
        prepare: under torchrun, what rank 0 runs to check the files and make the plan
            (`harmonia.train.job.prepare_shared`).
        launched_at: ``time.time()`` when the launcher started the processes (None: unknown).

    Returns:
        On rank 0, what it saw: ``start_step``, ``losses``, per-step ``records``, ``data`` statistics,
        the ``plan`` JSON, the ``config`` it ran and ``startup``, its start-up phases in seconds
        (None on the other ranks).

    Raises:
        StopRequested: a stop signal ended the job at a step boundary.
    """
    from harmonia.runtime.comm_record import recording_from_env

    with recording_from_env(int(os.environ["RANK"])):  # HARMONIA_COMM_RECORD: what the suite replays
        return _train_rank(config, plan_json, prepare, launched_at)


def _train_rank(config: Config, plan_json: str | None, prepare: Callable | None,
                launched_at: float | None) -> dict | None:
    """`train_worker` inside its communication record (if any)."""
    from harmonia.train.report import ProgressReporter, phase_line

    entered = time.time()
    stops = StopSignals.install()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend_of(config)
    threads, oversubscribed = cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if threads is not None:
        torch.set_num_threads(threads)
    if oversubscribed and rank == 0:
        logging.getLogger(__name__).warning(oversubscribed)
    timeout = datetime.timedelta(seconds=config.parallel.collective_timeout_s)
    store, attempt = _attempt_store(rank, world, timeout)
    device = process_group_device(backend)
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(backend), store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device)
    phases = {"process start": entered - launched_at} if launched_at is not None else {}
    phases["process group"] = time.time() - entered
    checked = None
    try:
        with _heartbeat(config, rank, world, attempt) as beat:
            if plan_json is None:
                plan_json, config, checked = _shared_plan(config, rank, prepare)
            built = time.time()
            if rank == 0:
                since = f" {built - launched_at:.1f} s after the launch" if launched_at is not None else ""
                phase_line(f"{world} process{'es' if world > 1 else ''} up{since}; building the model and its data")
            trainer = Trainer(config, Plan.from_json(plan_json), rank)
            trainer.resume()
            phases["model build and resume"] = time.time() - built
            if rank == 0:
                phase_line(f"model built in {phases['model build and resume']:.1f} s; training from step "
                           f"{trainer.start_step}")
            built = time.time()
            reporter = ProgressReporter(config, trainer.start_step, enabled=rank == 0)
            with reporter:
                trainer.run(reporter.step, stops, beat.progress, reporter.evaluation)
            dist.barrier()
            if rank == 0:
                phase_line(f"trained to step {config.train.steps}; checkpoint step-{trainer.saved_step} in "
                           f"{config.checkpoint.dir}")
        if rank != 0:
            return None
        if trainer.first_step_at is not None:
            phases["to the first step"] = trainer.first_step_at - built
        return {"start_step": trainer.start_step, "losses": trainer.losses, "records": reporter.records,
                "evals": reporter.evals,
                "data": trainer.dataset.stats.metrics(), "plan": plan_json, "config": config, "startup": phases}
    finally:
        dist.destroy_process_group()
        if checked is not None:
            checked.close()
