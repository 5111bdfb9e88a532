"""Accelerator and cluster specs used by the cost model and the simulator.

Peak numbers are the vendors' published dense (no sparsity) bf16 rates and memory figures:
- H100 SXM5 80GB: 989 TFLOP/s, HBM3 3.35 TB/s, NVLink 4 900 GB/s total (450 GB/s per direction),
  one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s) — NVIDIA H100 datasheet / DGX H100.
- H200 SXM 141GB: 989 TFLOP/s, HBM3e 4.8 TB/s, NVLink 900 GB/s, 400 Gb/s per GPU — NVIDIA H200 datasheet.
- A100 SXM4 80GB: 312 TFLOP/s, HBM2e 2.039 TB/s, NVLink 3 600 GB/s total (300 GB/s per direction),
  200 Gb/s HDR per GPU (25 GB/s) — NVIDIA A100 datasheet / DGX A100.
The local CPU has nominal figures only; `harmonia profile` measures it and writes a calibration.

Achievable fractions of those peaks (one calibration per device kind, from public measurements; the
cost model adds matmul, attention and memory-bound kernel times, `harmonia.workload.cost`):
- matmuls: H100/H200 SXM training steps sustain 0.60 of the bf16 peak in their matmuls, the one
  rate that best fits five published Llama runs on H100 (3.1 8B TP1 CP2 DP4, 70B TP4 CP2 PP4 VP5
  DP2, 70B CP2 FSDP32 on 8-64 GPUs; Llama 3 405B TP8 PP16 DP64 and DP128 on 8,192 and 16,384 GPUs:
  `benchmarks/fidelity.py`; each run predicted within 9.2% by the rate fitted to the others alone).
  An isolated matmul goes faster: Bekman's benchmark (ml-engineering, "Maximum Achievable Matmul FLOPS") sustains 702.9 TFLOP/s on an H200 alone and 698.6 with all
  eight of a node's GPUs computing (0.71), power-saturated near the 700 W limit. A step loses the
  difference to what the kernel-class rooflines below leave out: launch gaps, matmul shapes below
  the sustained rate, kernels outside the three classes.
- attention: fused attention (FlashAttention-3, cuDNN) on H100 SXM, bf16, head dim 128, 8k tokens:
  backward 518 (cuDNN) to 559 (FA3) TFLOP/s, forward about 600 (Shah et al. 2024, FlashAttention-3,
  figs. 5-6); the backward does two thirds of attention's FLOPs, so 0.55 of peak.
- memory and links: 0.8 of HBM bandwidth for the memory-bound kernels (a plain device copy reaches
  about 0.9) and of NVLink / network bandwidth (NCCL's intra-node all-reduce bus bandwidth on
  H100 is about 360 GB/s of 450).
A100 and the CPU keep one efficiency for matmuls and attention.
- compute beside communication: a compute kernel running while a collective runs on the same GPU
  (NCCL's kernels occupy streaming multiprocessors and memory bandwidth) is on average 18.9% slower
  than alone, at most 40% (Lee et al. 2025, "Characterizing Compute-Communication Overlap in
  GPU-Accelerated Distributed Deep Learning", arXiv 2507.03114: GPT and LLaMA training on 4 A100,
  H100, MI250 and MI210); the GPUs take that average. The CPU's processes share no such units: 0.
- precision: the GPUs train in bf16 mixed precision (`harmonia.train.rank`): compute in bf16, fp32
  master weights, gradients and Adam moments for trained weights, frozen weights held in bf16 as
  Megatron-LM's Float16Module and a bf16-loaded transformers model hold them. The CPU runs fp32.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from harmonia.errors import ConfigError


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    Attributes:
        name: preset name.
        peak_flops: dense bf16 FLOP/s.
        mem_bw: device memory bandwidth, bytes/s.
        mem_bytes: device memory, bytes.
        intra_node_bw: per-direction bandwidth to a peer in the node (NVLink), bytes/s.
        inter_node_bw: per-GPU network bandwidth to another node, bytes/s.
        gpus_per_node: devices per node.
        flops_efficiency: achievable fraction of ``peak_flops`` for large matmuls.
        bw_efficiency: achievable fraction of ``mem_bw`` and of link bandwidths.
        latency_s: per-message latency of a point-to-point transfer.
        attention_efficiency: achievable fraction of ``peak_flops`` for fused attention kernels
            (default: ``flops_efficiency``).
        overlap_slowdown: how much longer compute takes while a collective runs beside it
            (0.189: 18.9% longer); the simulator charges it where it hides a collective behind
            a unit's compute (`harmonia.sim.tasks.collective_extra`).
        mixed_precision: trains in bf16 mixed precision (frozen weights held in bf16, 2 B each)
            rather than fp32 throughout (4 B); what `harmonia.train.rank` runs on the device kind.
        dispatch_s: host seconds eager PyTorch spends dispatching one layer's operators in one
            phase (F, B or W), whatever its size: Python, autograd and the dispatcher per operator,
            about twenty operators a transformer block. A small model's microbatch costs this more
            than its FLOPs, so it decides how many microbatches pay (`CostModel.unit_cost`).
        kernels_on_host: the host thread that dispatches also runs the kernels (the CPU), so a
            phase takes its kernels' time plus its dispatch; on an accelerator the host dispatches
            ahead of the kernels and a phase takes the longer of the two.
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    flops_efficiency: float = 0.6
    bw_efficiency: float = 0.8
    latency_s: float = 10e-6
    attention_efficiency: float | None = None
    overlap_slowdown: float = 0.0
    mixed_precision: bool = True
    dispatch_s: float = 0.0
    kernels_on_host: bool = False
    split_backward_s: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        if self.attention_efficiency is None:
            object.__setattr__(self, "attention_efficiency", self.flops_efficiency)
        for field in ("peak_flops", "mem_bw", "mem_bytes", "intra_node_bw", "inter_node_bw", "gpus_per_node"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"device {self.name!r}: {field} must be positive")
        for field in ("flops_efficiency", "bw_efficiency", "attention_efficiency"):
            if not 0 < getattr(self, field) <= 1:
                raise ConfigError(f"device {self.name!r}: {field} must be in (0, 1]")
        if self.dispatch_s < 0:
            raise ConfigError(f"device {self.name!r}: dispatch_s={self.dispatch_s} must be >= 0")
        try:  # a scenario's TOML gives a list
            object.__setattr__(self, "split_backward_s", tuple(float(x) for x in self.split_backward_s))
        except (TypeError, ValueError):
            raise ConfigError(f"device {self.name!r}: split_backward_s={self.split_backward_s!r} must be two "
                              "seconds >= 0 (B's and W's per layer)") from None
        if len(self.split_backward_s) != 2 or min(self.split_backward_s) < 0:
            raise ConfigError(f"device {self.name!r}: split_backward_s={self.split_backward_s} must be two "
                              "seconds >= 0 (B's and W's per layer)")
        if any(self.split_backward_s) and not self.kernels_on_host:
            raise ConfigError(f"device {self.name!r}: split_backward_s is host time priced where the host runs "
                              "the kernels (kernels_on_host); an accelerator's dispatch runs ahead of them")
        if self.overlap_slowdown < 0:
            raise ConfigError(f"device {self.name!r}: overlap_slowdown={self.overlap_slowdown} must be >= 0")


GB = 1e9
CPU_DISPATCH_S = 3e-4
"""Host seconds per layer and phase on the CPU (`DeviceSpec.dispatch_s`), from
`benchmarks/dispatch.py` (`benchmarks/results/dispatch-2026-11-27.txt`): a tiny LLM's layer at 4
tokens, where its kernels take 8-16 us, measured 0.37 ms forward and 0.43 ms backward (B and W
together) on one thread of this machine's cores; 0.3 ms per phase prices the pair 0.9 ms against
0.8 measured."""
CPU_SPLIT_BACKWARD_S = (2.7e-4, 4.4e-4)
"""Host seconds per layer a split backward adds to B and to W on the CPU
(`DeviceSpec.split_backward_s`), from `benchmarks/dispatch.py` (`benchmarks/results/dispatch-2026-11-29.txt`,
its second table): the tiny LLM's last stage at 4-64 tokens on one thread, B by ``stage_backward_input``
and W by ``stage_backward_weight``, took 0.274 ms and 0.442 ms per layer more than half the fused
backward each (mean over the three loads): the split costs 2.4-2.8x the fused backward there."""
OVERLAP_SLOWDOWN = 0.189
"""Compute's average slowdown beside a collective on a GPU (module docstring)."""
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 989e12, 3.35e12, 80 * 2**30, 450 * GB, 50 * GB, flops_efficiency=0.60,
                       attention_efficiency=0.55, overlap_slowdown=OVERLAP_SLOWDOWN),
    # memory: what torch's allocator reports on one (139.80 GiB, torch 2.11; the 141 GB of the data sheet
    # are decimal and include what the driver keeps)
    "h200": DeviceSpec("h200", 989e12, 4.8e12, 139.8 * 2**30, 450 * GB, 50 * GB, flops_efficiency=0.60,
                       attention_efficiency=0.55, overlap_slowdown=OVERLAP_SLOWDOWN),
    "a100": DeviceSpec("a100", 312e12, 2.039e12, 80 * 2**30, 300 * GB, 25 * GB, overlap_slowdown=OVERLAP_SLOWDOWN),
    # Nominal figures for a laptop/server CPU core pair (fp32); calibrate with `harmonia profile`.
    "cpu": DeviceSpec("cpu", 200e9, 20 * GB, 16 * 2**30, 5 * GB, 1 * GB, gpus_per_node=8,
                      flops_efficiency=0.5, bw_efficiency=0.5, latency_s=50e-6, mixed_precision=False,
                      dispatch_s=CPU_DISPATCH_S, kernels_on_host=True, split_backward_s=CPU_SPLIT_BACKWARD_S),
}


def device_preset(name: str) -> DeviceSpec:
    """A device spec by name (``h100``, ``h200``, ``a100``, ``cpu``)."""
    key = name.lower()
    if key not in DEVICES:
        raise ConfigError(f"unknown device {name!r}; known devices: {sorted(DEVICES)}")
    return DEVICES[key]


@dataclass(frozen=True)
class ClusterSpec:
    """Homogeneous nodes of one device kind; ranks fill node 0 first.

    ``cores``: where a node's ranks share fewer compute units than they are (a CPU job's processes
    on one machine's cores), how many; the simulator then runs the compute a node's ranks do at once
    at ``min(1, cores / running)`` of its rate each (processor sharing: `harmonia.sim.shared`). None:
    every rank computes on a device of its own.
    """

    device: DeviceSpec
    n_nodes: int = 1
    gpus_per_node: int | None = None
    cores: int | None = None
    _bandwidths: dict = field(init=False, repr=False, compare=False, default_factory=dict)  # group -> bytes/s

    def __post_init__(self) -> None:
        if self.n_nodes < 1:
            raise ConfigError(f"cluster n_nodes={self.n_nodes} must be >= 1")
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", self.device.gpus_per_node)
        if self.gpus_per_node < 1:
            raise ConfigError(f"cluster gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.cores is not None and self.cores < 1:
            raise ConfigError(f"cluster cores={self.cores} must be >= 1")

    @property
    def compute_units(self) -> int:
        """What computes at once: every rank, or where a node's ranks share fewer cores, the cores."""
        return self.units_of(range(self.world_size))

    def units_of(self, ranks: Iterable[int]) -> int:
        """What ``ranks`` compute on at once: a device each, or on each node at most its `cores`."""
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        cap = self.cores if self.shares_cores else self.gpus_per_node
        return sum(min(cap, n) for n in per_node.values())

    @property
    def shares_cores(self) -> bool:
        """Whether a node's ranks outnumber its compute units (`cores`)."""
        return self.cores is not None and self.cores < self.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.n_nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def p2p_bandwidth(self, src: int, dst: int) -> float:
        """Achievable bytes/s between two ranks (NVLink inside a node, the NIC across nodes)."""
        d = self.device
        raw = d.intra_node_bw if self.node_of(src) == self.node_of(dst) else d.inter_node_bw
        return raw * d.bw_efficiency

    def group_bandwidth(self, ranks: tuple[int, ...] | list[int]) -> float:
        """Bus bandwidth of a ring collective over ``ranks``.

        Within a node, NVLink's. Across nodes, each node's ring hop goes over the network; NCCL runs
        one ring channel per NIC, each GPU on its own rail, so the ``g`` ranks a node holds drive
        ``g`` NICs at once and the ring moves ``g x inter_node_bw`` through every node (capped by
        NVLink), ``g`` counted on the node holding fewest. An 8-rank-per-node group of 400 Gb/s
        NICs thus reaches 8 x 50 GB/s, as NCCL's multi-node bus bandwidth does; a group with one
        rank per node, 50 GB/s.
        """
        key = tuple(ranks)
        if key not in self._bandwidths:
            self._bandwidths[key] = self._group_bandwidth(key)
        return self._bandwidths[key]

    def _group_bandwidth(self, ranks: tuple[int, ...]) -> float:
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        d = self.device
        if len(per_node) <= 1:
            return d.intra_node_bw * d.bw_efficiency
        return min(d.intra_node_bw, min(per_node.values()) * d.inter_node_bw) * d.bw_efficiency

    def with_device(self, **changes) -> ClusterSpec:
        return replace(self, device=replace(self.device, **changes))

    def describe(self) -> str:
        """The form `cluster_from_string` reads: ``h100:4x8``, ``cpu:1x4@2``."""
        shared = f"@{self.cores}" if self.cores is not None else ""
        return f"{self.device.name}:{self.n_nodes}x{self.gpus_per_node}{shared}"


def cluster_from_string(spec: str) -> ClusterSpec:
    """Parse ``h100x8`` (one node of 8), ``h100:4x8`` (4 nodes of 8), ``cpu:1x4``, or any of them
    followed by ``@C``: a node's ranks share ``C`` cores (``cpu:1x4@2``: 4 processes on 2 cores)."""
    spec, at, cores = spec.partition("@")
    if at:
        if not cores.isdigit() or int(cores) < 1:
            raise ConfigError(f"cluster {spec}@{cores}: after '@' give the cores a node's ranks share, e.g. cpu:1x4@2")
        return replace(cluster_from_string(spec), cores=int(cores))
    name, sep, shape = spec.replace(":", "x", 1).partition("x") if ":" in spec else spec.partition("x")
    device = device_preset(name)
    try:
        if "x" in shape:
            nodes, per = (int(v) for v in shape.split("x"))
        else:
            nodes, per = 1, int(shape) if shape else device.gpus_per_node
    except ValueError:
        raise ConfigError(f"cluster {spec!r}: expected DEVICE[xGPUS] or DEVICE:NODESxGPUS, e.g. h100:4x8") from None
    return ClusterSpec(device, nodes, per)
