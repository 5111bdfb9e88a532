"""The process group a job starts: NCCL for a GPU job's device tensors with gloo beside it for its
host-side collectives (loss, gradient norm, step timings), gloo alone on CPUs."""

import datetime

import torch
import torch.distributed as dist

from harmonia.train.backend import process_group_backend


def test_a_gpu_job_pairs_nccl_with_gloo_and_a_cpu_job_keeps_gloo() -> None:
    assert process_group_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("gloo") == "gloo"


def test_the_per_device_form_takes_host_tensors_in_the_default_group_and_its_subgroups() -> None:
    """The device:backend form torch parses here; a host tensor's collective goes to its cpu backend."""
    store = dist.HashStore()
    dist.init_process_group("cpu:gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        total = torch.ones((), dtype=torch.float64)
        dist.all_reduce(total)
        dist.all_reduce(total, group=dist.new_group([0]))
        assert float(total) == 1.0
    finally:
        dist.destroy_process_group()


def test_an_nccl_job_without_a_gpu_stops_before_any_process_starts(monkeypatch) -> None:
    import pytest

    from harmonia.config import load_config
    from harmonia.errors import ConfigError
    from harmonia.train.planning import check_cluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config(None, ["--model.preset=tiny-vlm", "--parallel.backend=nccl", "--parallel.cluster=h100:1x1",
                                "--parallel.world_size=1"])
    with pytest.raises(ConfigError, match="parallel.backend=nccl but this machine has no CUDA device with NCCL"):
        check_cluster(config)


def test_process_group_binds_this_ranks_gpu_under_nccl(monkeypatch) -> None:
    """NCCL groups are bound to the rank's GPU (eager communicators); gloo binds none."""
    import torch

    from harmonia.train.backend import process_group_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert process_group_device("nccl") == torch.device("cuda", 3)
    assert process_group_device("gloo") is None
