"""One process of `harmonia train`: the process group, the heartbeat, the plan, the trainer.

Spawned by `harmonia.launch.launch` (which hosts the rendezvous store and watches every rank), or
started by torchrun, where rank 0 first checks the job's files (`harmonia.train.preflight`), holds
the checkpoint lock, prepares the data and the plan, and shares plan and config with the others
(who wait up to ``parallel.prepare_timeout_s``); then every rank checks it can use the job's shared
paths (data, model, checkpoints: `unreachable_path`), and a rank on a host that cannot ends the job
with one line naming it. There each rank also exits with its agent and watches its peers'
heartbeats itself.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
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

log = logging.getLogger(__name__)


PREPARED_KEY = "harmonia/prepared"
"""Where rank 0 puts what it prepared under torchrun (plan and checked config, or its error), in the
attempt's store."""


class PreparationTimeout(HarmoniaError):
    """Under torchrun, rank 0 did not share the data and the plan within ``parallel.prepare_timeout_s``."""


class SharedStorageError(HarmoniaError):
    """A rank cannot use a path every rank reads or writes: the job's files are not on storage every
    node mounts."""


def _shared_plan(config: Config, rank: int, world: int, store: dist.Store, prepare: Callable):
    """Under torchrun: rank 0 runs ``prepare`` (checks the job's files, holding the checkpoint lock until
    the job ends, and prepares the data and the plan) and puts the plan and the checked config in the
    store; the other ranks wait there for them up to ``parallel.prepare_timeout_s``, saying so (a
    collective would give up after ``parallel.collective_timeout_s``, which a long shape pass over a
    large data set or a plan search can outlast). An error of rank 0's is raised on every rank.
    Returns (plan JSON, config, the `Preflight` to close on rank 0 or None)."""
    if rank != 0:
        shared = _wait_for_rank_0(config, rank, store)
        if isinstance(shared, BaseException):
            raise shared
        return shared[0], shared[1], None
    if world > 1:
        from harmonia.train.report import phase_line

        phase_line(f"rank 0 prepares the data and the plan; the other {world - 1} rank{'s' if world > 2 else ''} "
                   f"wait for it (up to {config.parallel.prepare_timeout_s:g} s: parallel.prepare_timeout_s)")
    try:
        plan, checked_config, checked = prepare(config)
    except HarmoniaError as err:
        store.set(PREPARED_KEY, pickle.dumps(err))
        raise
    except BaseException as err:  # the others must not wait for a plan that never comes
        store.set(PREPARED_KEY, pickle.dumps(
            RuntimeError(f"rank 0 failed while preparing the job: {type(err).__name__}: {err}")))
        raise
    try:
        store.set(PREPARED_KEY, pickle.dumps((plan.to_json(), checked_config)))
    except BaseException:
        checked.close()
        raise
    return plan.to_json(), checked_config, checked


def _wait_for_rank_0(config: Config, rank: int, store: dist.Store):
    """What rank 0 shared under `PREPARED_KEY`: (plan JSON, config) or its error. The first rank on
    each host says what it and the host's other ranks wait for.

    Raises:
        PreparationTimeout: nothing came within ``parallel.prepare_timeout_s``.
    """
    wait_s = config.parallel.prepare_timeout_s
    line = (f"rank {rank} waits for rank 0 to prepare the data and the plan (up to {wait_s:g} s: "
            "parallel.prepare_timeout_s)")
    others = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1
    if os.environ.get("LOCAL_RANK", "0") == "0":
        if others:
            line += (f"; so {'does the other rank' if others == 1 else f'do the other {others} ranks'} on host "
                     f"{socket.gethostname()}")
        log.info(line)
    else:
        log.debug(line)
    start = time.monotonic()
    try:
        store.wait([PREPARED_KEY], datetime.timedelta(seconds=wait_s))
    except dist.DistStoreError:
        if time.monotonic() - start < wait_s:  # the store failed, not the wait: a peer (its host) is gone
            raise
        raise PreparationTimeout(
            f"rank {rank} waited {wait_s:g} s for rank 0 to prepare the data and the plan (the shape pass over "
            "data.path, the plan search), which it has not finished: see rank 0's output for where it is, and "
            "raise parallel.prepare_timeout_s where it needs longer") from None
    return pickle.loads(store.get(PREPARED_KEY))


def _paths_every_rank_reads(config: Config) -> list[tuple[str, str]]:
    """(config field, path) of what every rank reads: its samples, their media, the model's weights."""
    d, m = config.data, config.model
    named = [("data.path", d.path), ("data.eval_path", d.eval_path), ("data.media_root", d.media_root),
             ("model.hf", m.hf), ("model.llm", m.llm), *((f"model.encoders.{k}", v) for k, v in m.encoders.items())]
    return [(name, str(path)) for name, path in named if path]


def unreachable_path(config: Config) -> str | None:
    """What this process cannot use of the paths every rank needs, as ``cannot read FIELD=PATH
    (why)``; None where it can use them all. What every rank reads must be readable (a directory
    also searchable); ``checkpoint.dir``, which rank 0 created before sharing the plan, must be
    writable: every rank writes its shards of each checkpoint there and reads the data's cached
    shapes from it. One ``stat`` and ``access`` per path, nothing listed or opened."""
    for name, path in _paths_every_rank_reads(config):
        if not os.path.exists(path):
            return f"cannot read {name}={path} (no such path on this host)"
        if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            return f"cannot read {name}={path} (permission denied)"
    ck = config.checkpoint.dir
    if not os.path.isdir(ck):
        return f"cannot write checkpoint.dir={ck} (no such directory on this host, though rank 0 created it)"
    if not os.access(ck, os.R_OK | os.W_OK | os.X_OK):
        return f"cannot write checkpoint.dir={ck} (permission denied)"
    return None


def storage_refusal(gathered: list[tuple[str, str | None]]) -> str | None:
    """The line every rank ends with where some rank cannot use the job's shared paths, from every
    rank's (host, `unreachable_path`) in rank order; None where every rank can."""
    failed = [(r, host, problem) for r, (host, problem) in enumerate(gathered) if problem]
    if not failed:
        return None
    rank, host, problem = failed[0]
    line = f"rank {rank} on host {host} {problem}: put it on storage every node mounts"
    if gathered[0][0] != host:
        line += f" (rank 0 runs on host {gathered[0][0]})"
    if len(failed) > 1:
        hosts = sorted({h for _, h, _ in failed[1:]})
        line += (f"; {len(failed) - 1} more rank{'s' if len(failed) > 2 else ''} cannot either "
                 f"(host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})")
    return line


def agree_on_storage(config: Config, world: int) -> None:
    """Under torchrun, before the model is built: every rank checks the job's shared paths
    (`unreachable_path`) and all learn every rank's answer (one object all-gather over gloo), so a
    rank on a host without them ends the whole job with one line, the same on every rank.

    Raises:
        SharedStorageError: naming the first such rank, its host and the path.
    """
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (socket.gethostname(), unreachable_path(config)))
    refusal = storage_refusal(gathered)
    if refusal is not None:
        raise SharedStorageError(refusal)


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
        log.warning(oversubscribed)
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
            if plan_json is None:  # torchrun: ranks on other hosts see the job's files only on shared storage
                shared = time.time()
                plan_json, config, checked = _shared_plan(config, rank, world, store, prepare)
                agree_on_storage(config, world)
                phases["data, shape pass and plan (rank 0)"] = time.time() - shared
            built = time.time()
            if rank == 0:
                since = f" {built - launched_at:.1f} s after the launch" if launched_at is not None else ""
                phase_line(f"{world} process{'es' if world > 1 else ''} up{since}; building the model and its data")
            trainer = Trainer(config, Plan.from_json(plan_json), rank)
            beat.status = trainer.model.executor.waiting_on  # a stall's warning names each rank's wait
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
