"""Processor sharing: ranks of a node that outnumber its cores share them while they compute."""

import random

import numpy as np
import pytest

from harmonia.errors import ConfigError, ScheduleError
from harmonia.sim.engine import Task, replay
from harmonia.sim.shared import replay_shared
from harmonia.sim.tasks import simulate_schedule
from harmonia.workload.devices import cluster_from_string
from tests.unit.test_sim_tasks import setup  # noqa: F401  (the fixture)



def _random_lists(rng: random.Random) -> tuple[list[Task], dict[int, list[int]], dict[int, list[int]]]:
    """Three ranks of six tasks each, some on the communication stream, each depending on an earlier one
    at random (with or without a transfer delay); some take no time."""
    tasks: list[Task] = []
    order: dict[int, list[int]] = {r: [] for r in range(3)}
    comm: dict[int, list[int]] = {r: [] for r in range(3)}
    for r in range(3):
        for _ in range(6):
            i = len(tasks)
            deps = [(rng.randrange(i), rng.choice([0.0, 0.01]))] if i and rng.random() < 0.5 else []
            on_comm = rng.random() < 0.2
            tasks.append(Task(f"t{i}", r, rng.choice([0.0, 0.1, 0.25, 0.3]), deps, kind="C" if on_comm else "F"))
            (comm if on_comm else order)[r].append(i)
    return tasks, order, comm


def test_with_a_core_per_rank_it_is_the_plain_replay() -> None:
    rng = random.Random(0)
    for _ in range(100):
        tasks, order, comm = _random_lists(rng)
        plain, shared = replay(tasks, order, comm), replay_shared(tasks, order, comm, lambda r: 0, 3)
        assert np.allclose(shared.start, plain.start) and np.allclose(shared.end, plain.end)
        assert shared.busy_s == pytest.approx(plain.busy_s)
        fewer = replay_shared(tasks, order, comm, lambda r: 0, 1)
        assert fewer.iteration_s >= plain.iteration_s - 1e-12
        work = sum(t.duration for t in tasks if t.kind != "C")
        assert fewer.iteration_s >= work - 1e-12  # one core does all the compute


def test_ranks_computing_at_once_share_the_cores() -> None:
    # rank 0 computes 1 s from 0; rank 1's 1 s is ready at 0.5: alone 0-0.5, halves 0.5-1.5, rank 1 alone to 2.0
    tasks = [Task("a", 0, 1.0), Task("x", 1, 0.0), Task("b", 1, 1.0, [(1, 0.5)])]
    tl = replay_shared(tasks, {0: [0], 1: [1, 2]}, None, lambda r: 0, 1)
    assert list(tl.start) == pytest.approx([0.0, 0.0, 0.5])
    assert list(tl.end) == pytest.approx([1.5, 0.0, 2.0])
    assert tl.busy_s == pytest.approx({0: 1.5, 1: 1.5})
    # the same on two nodes of one core each: no sharing
    apart = replay_shared(tasks, {0: [0], 1: [1, 2]}, None, lambda r: r, 1)
    assert list(apart.end) == pytest.approx([1.0, 0.0, 1.5])


def test_communication_takes_no_core() -> None:
    tasks = [Task("F", 0, 1.0), Task("allreduce", 1, 1.0, kind="C"), Task("F", 1, 1.0, [(1, 0.0)])]
    tl = replay_shared(tasks, {0: [0], 1: [2]}, {1: [1]}, lambda r: 0, 1)
    assert list(tl.end) == pytest.approx([1.0, 1.0, 2.0])


def test_a_ranks_other_work_takes_the_cores_compute_leaves_and_runs_on_after_the_tasks() -> None:
    tasks = [Task("F", 0, 1.0), Task("F", 1, 1.0)]
    # two ranks computing on 2 cores leave none: rank 0's 1 s of other CPU runs after them
    tl = replay_shared(tasks, {0: [0], 1: [1]}, None, lambda r: 0, 2, {0: 1.0})
    assert list(tl.end) == pytest.approx([1.0, 1.0]) and tl.iteration_s == pytest.approx(2.0)
    assert tl.busy_s == pytest.approx({0: 1.0, 1: 1.0})
    # one rank computing leaves a core, which both ranks' other work shares: done with the compute
    alone = replay_shared(tasks[:1], {0: [0], 1: []}, None, lambda r: 0, 2, {0: 0.5, 1: 0.5})
    assert list(alone.end) == pytest.approx([1.0]) and alone.iteration_s == pytest.approx(1.0)


def test_a_deadlock_names_what_waits() -> None:
    tasks = [Task("a", 0, 1.0, [(1, 0.0)]), Task("b", 1, 1.0, [(0, 0.0)])]
    with pytest.raises(ScheduleError, match="rank 0 at a waits for b"):
        replay_shared(tasks, {0: [0], 1: [1]}, None, lambda r: 0, 1)


def test_a_cluster_names_the_cores_its_ranks_share() -> None:
    cluster = cluster_from_string("cpu:1x4@2")
    assert (cluster.world_size, cluster.cores, cluster.shares_cores) == (4, 2, True)
    assert cluster.describe() == "cpu:1x4@2" and cluster_from_string(cluster.describe()) == cluster
    assert not cluster_from_string("cpu:1x4@4").shares_cores and not cluster_from_string("h100:2x8").shares_cores
    for bad in ("cpu:1x4@0", "cpu:1x4@two"):
        with pytest.raises(ConfigError, match="cores a node's ranks share"):
            cluster_from_string(bad)


def test_a_step_on_shared_cores_lasts_at_least_its_compute_over_the_cores(setup) -> None:  # noqa: F811
    plan, cost, iw, schedule = setup
    own = simulate_schedule(plan, cost, cluster_from_string("h100x8"), iw, schedule)
    shared = simulate_schedule(plan, cost, cluster_from_string("h100x8@1"), iw, schedule)
    work = sum(t.duration for t in shared.tasks if t.kind in ("F", "B", "W", "BW"))
    assert shared.iteration_s >= max(own.iteration_s, work) - 1e-12
    assert [t.duration for t in shared.tasks] == [t.duration for t in own.tasks]
    assert simulate_schedule(plan, cost, cluster_from_string("h100x8@8"), iw, schedule).iteration_s == \
        pytest.approx(own.iteration_s)


def test_a_cpu_job_simulates_its_ranks_on_the_cores_the_machine_gives_it(monkeypatch) -> None:
    from pathlib import Path

    from harmonia.config import load_config
    from harmonia.train.backend import job_cluster

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert job_cluster(load_config(demo, ["--parallel.backend=gloo"])).describe() == "cpu:1x4@2"
    given = load_config(demo, ["--parallel.backend=gloo", "--parallel.cluster=cpu:1x4@1"])
    assert job_cluster(given).cores == 1
    on_gpus = load_config(demo, ["--parallel.backend=nccl", "--parallel.cluster=h100:1x4"])
    assert job_cluster(on_gpus).cores is None


def test_what_computes_at_once_is_the_cores_where_ranks_share_them() -> None:
    assert cluster_from_string("cpu:2x4@2").compute_units == 4
    assert cluster_from_string("cpu:2x4@8").compute_units == 8 == cluster_from_string("cpu:2x4").compute_units


def test_mfu_over_the_cores_ranks_share() -> None:
    tasks = [Task("F", r, 1.0, flops=2.0) for r in range(4)]
    tl = replay_shared(tasks, {r: [r] for r in range(4)}, None, lambda r: 0, 2)
    assert tl.iteration_s == pytest.approx(2.0)
    assert tl.mfu(1.0) == pytest.approx(8.0 / (2.0 * 4)) and tl.mfu(1.0, devices=2) == pytest.approx(8.0 / (2.0 * 2))


def test_a_cpu_rank_plans_for_its_share_of_the_host_memory(monkeypatch, tmp_path) -> None:
    """Four CPU ranks on one 24 GiB machine have 6 GiB each; a plan whose states exceed that is
    refused before any process starts, naming the share; GPU ranks keep their device's memory."""
    from pathlib import Path

    from harmonia.config import load_config
    from harmonia.errors import LayoutError
    from harmonia.model.presets import mllm_preset
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
    from harmonia.train import backend
    from harmonia.train.planning import load_training_plan

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
    monkeypatch.setattr(backend, "host_memory_bytes", lambda: 24 * 2**30)
    config = load_config(demo, ["--parallel.backend=gloo"])
    assert backend.rank_memory_bytes(config) == 6 * 2**30
    assert backend.rank_memory_bytes(load_config(demo, ["--parallel.backend=nccl", "--parallel.cluster=h100:1x4"])) \
        is None
    plan = plan_from_layouts(mllm_preset(config.model.preset), config.model.preset,
                             parse_layouts("vision dp4; audio dp4; llm dp4"), 4, config.train.global_batch)
    plan.save(tmp_path / "plan.json")
    given = load_config(demo, ["--parallel.backend=gloo", f"--parallel.plan={tmp_path / 'plan.json'}"])
    load_training_plan(given)  # the demo's model fits 6 GiB
    monkeypatch.setattr(backend, "host_memory_bytes", lambda: 4 * 2**20)
    with pytest.raises(LayoutError, match=r"CPU share \(host memory / ranks\)'s 0.000977 GiB"):
        load_training_plan(given)


def test_a_rank_keeps_the_threads_the_user_or_torchrun_set_and_is_warned_when_they_oversubscribe(monkeypatch):
    import torch

    from harmonia.train import backend

    monkeypatch.setattr(backend, "process_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert backend.cpu_threads(4) == (2, None)  # unset: the host's cores shared by its ranks
    assert backend.cpu_threads(16) == (1, None)  # more ranks than cores: the job's own choice
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun sets it
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert backend.cpu_threads(4) == (None, None)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    threads, warning = backend.cpu_threads(4)
    assert threads is None and "4 ranks x 4 threads on this host's 8 cores" in warning
    assert "OMP_NUM_THREADS=2" in warning
