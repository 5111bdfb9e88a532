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
