"""Per-process facts every part of a job agrees on: the process-group backend, the cluster its
simulation models, the hang timeout and the per-batch schedule search's evaluations."""

from __future__ import annotations

import os
from dataclasses import replace

from harmonia.config import Config
from harmonia.workload.devices import ClusterSpec, cluster_from_string


def backend_of(config: Config) -> str:
    """The process-group backend: the config's, or nccl where GPUs are visible and gloo elsewhere."""
    import torch

    if config.parallel.backend != "auto":
        return config.parallel.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def runs_mixed(precision: str, device_type: str) -> bool:
    """Whether ``train.precision`` runs bf16 mixed precision on a device kind: ``bf16``, or ``auto``
    on GPUs (frozen weights then held in bf16)."""
    return precision == "bf16" or (precision == "auto" and device_type == "cuda")


def process_group_backend(backend: str) -> str:
    """What `torch.distributed.init_process_group` is given: on GPUs NCCL for CUDA tensors and gloo
    beside it for the host-side ones (the loss, the gradient norm, step timings), which every group
    made from the default one inherits; gloo alone on CPUs."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def process_group_device(backend: str):
    """The device `torch.distributed.init_process_group` binds the process group to (``device_id``):
    on GPUs this rank's ``cuda:LOCAL_RANK``, so NCCL creates each group's communicator when the group
    is made (every rank makes them in one order, from the plan) instead of at its first collective,
    where a rank busy elsewhere would keep the others waiting; None on CPUs (gloo binds nothing)."""
    import torch

    if backend != "nccl":
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def job_cluster(config: Config) -> ClusterSpec:
    """The cluster the job's simulated steps run on: ``parallel.cluster``; for a CPU job (gloo on CPU
    devices) whose ranks outnumber the cores this machine gives the process, and that names no
    ``@cores`` of its own, those cores (its processes share them: `harmonia.sim.shared`)."""
    cluster = cluster_from_string(config.parallel.cluster)
    if cluster.cores is not None or cluster.device.name != "cpu" or backend_of(config) != "gloo":
        return cluster
    return replace(cluster, cores=process_cores())


def process_cores() -> int:
    """The cores this process may run on (its affinity; all of the machine's where that is unknown)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(local_ranks: int) -> tuple[int | None, str | None]:
    """A rank's intra-op CPU threads: None where ``OMP_NUM_THREADS`` is set (by the user, or by
    torchrun, which sets 1): torch already runs that many and they stay; else this process's cores
    shared by the ``local_ranks`` ranks on this host (at least one). And a warning where a thread
    setting makes the host's ranks run more threads than it has cores (each waits for cores the
    others hold)."""
    import torch

    cores, given = process_cores(), os.environ.get("OMP_NUM_THREADS")
    threads = None if given else max(1, cores // local_ranks)
    running = torch.get_num_threads() if given else threads
    if running * local_ranks <= cores or not given:  # more ranks than cores: the job's choice (`job_cluster`)
        return threads, None
    fair = max(1, cores // local_ranks)
    return threads, (f"OMP_NUM_THREADS={given}: {local_ranks} ranks x {running} threads on this host's {cores} cores "
                     f"oversubscribe them; OMP_NUM_THREADS={fair} (or unset) gives each rank its share")


def host_memory_bytes() -> int:
    """This machine's memory as the process may use it: physical memory, or a smaller cgroup limit."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def rank_memory_bytes(config: Config) -> int | None:
    """A CPU job's per-rank device memory: this host's memory shared by the job's ranks on it (four
    ranks on a 24 GiB machine: 6 GiB each). None for GPU jobs (the device's own memory)."""
    cluster = cluster_from_string(config.parallel.cluster)
    if cluster.device.name != "cpu" or backend_of(config) != "gloo":
        return None
    return host_memory_bytes() // max(1, min(config.parallel.world_size or cluster.world_size, cluster.gpus_per_node))


def hang_timeout(config: Config) -> float:
    """Seconds without a heartbeat after which a rank is hung: ``parallel.hang_timeout_s``, or (auto)
    300 s on GPUs and 60 s on CPU."""
    if config.parallel.hang_timeout_s:
        return config.parallel.hang_timeout_s
    return 300.0 if backend_of(config) == "nccl" else 60.0


SCHEDULE_SEARCH_GPU = 16


def schedule_search(config: Config) -> int:
    """Schedules the per-batch order search replays: ``parallel.schedule_search``, or (auto) 16 on GPUs
    and 0 on CPU. Every rank searches in its prefetch thread; on GPUs the host CPU is otherwise idle,
    on CPU the search takes its time from the ranks' compute (measured on the demo job, 4 processes on
    2 cores: 0.38 s of step time for 0.004 s of simulated gain, `benchmarks/measured_vs_simulated.py`)."""
    if config.parallel.schedule_search >= 0:
        return config.parallel.schedule_search
    return SCHEDULE_SEARCH_GPU if backend_of(config) == "nccl" else 0
