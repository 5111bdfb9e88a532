"""The plan a training job runs: a plan file, or one searched at start-up from the dataset's shapes.

The search is the planner's (`harmonia.plan.search.search_plan`) on the job's own data: whole
global batches drawn from the dataset's sample shapes are what every candidate layout is scored
on. Candidates the executor cannot run and those outside the config's constraints
(``parallel.llm_pp``) are rejected with their reason before simulating.
"""

from __future__ import annotations

from dataclasses import replace

from harmonia.config import PRECISION_MIXED, Config
from harmonia.errors import ConfigError
from harmonia.model.spec import MLLMSpec
from harmonia.model.training_mode import ModuleTraining
from harmonia.schedule.plan import Plan
from harmonia.plan.candidates import check_states_fit
from harmonia.plan.search import PlanReport, search_plan
from harmonia.plan.scenario import Scenario
from harmonia.workload.cost import CostModel
from harmonia.train.backend import job_cluster, process_cores, rank_memory_bytes
from harmonia.workload.devices import cluster_from_string
from harmonia.workload.shapes import SampleShape


def training_modes(config: Config) -> dict[str, str]:
    """Module -> ``frozen`` / ``lora`` from the config (every other module trains fully)."""
    return config.model.training_modes


def model_spec(config: Config) -> MLLMSpec:
    """The MLLM of the job, with its training modes and LoRA settings.

    Raises:
        ConfigError: a LoRA target that names no linear of its module.
    """
    from harmonia.model.mllm import trainable_counts
    from harmonia.model.resolve import resolve_mllm

    spec = resolve_mllm(config.model.source, training=training_modes(config))
    modes = {m: config.model.lora_training(m) if t == "lora" else ModuleTraining(t)
             for m, t in training_modes(config).items()}
    spec = replace(spec, training=modes)
    if config.model.lora:
        trainable_counts(spec)  # LoRA targets checked against the modules, built on meta
    return spec


def executor_limits(plan: Plan) -> str | None:
    """Why the MLLM executor cannot run ``plan``, or None when it can."""
    for module, layout in plan.layouts.items():
        if layout.cp > 1 and module != "llm":
            return f"executor runs encoders with cp=1 ({module} has cp={layout.cp})"
    return None


def check_plan_messages(spec: MLLMSpec, plan: Plan) -> None:
    """Refuse a plan whose point-to-point messages cannot be put in one order both ends of each pair
    derive (`harmonia.runtime.message_program.check_layout_messages`, under the plan's own schedule
    family and microbatch count), before any process starts: NCCL would hang on its first step.

    Raises:
        LayoutError: naming the modules, their ranks and the messages that wait on each other.
    """
    from harmonia.runtime.message_program import check_layout_messages
    from harmonia.schedule.families import build_schedule
    from harmonia.train.rank import schedule_graph

    schedule = build_schedule(schedule_graph(spec, plan), plan.n_microbatches, plan.schedule)
    check_layout_messages(plan.layouts, schedule)


def _constraints(config: Config):
    def accept(plan: Plan) -> str | None:
        pp = config.parallel.llm_pp
        if pp and plan.layouts["llm"].pp != pp:
            return f"llm pp={plan.layouts['llm'].pp} (parallel.llm_pp={pp})"
        family = config.parallel.schedule
        if family != "auto" and plan.schedule != family:
            return f"schedule {plan.schedule} (parallel.schedule={family})"
        return executor_limits(plan)

    return accept


def with_world_size(config: Config) -> Config:
    """The job with ``parallel.world_size`` 0 taken from its cluster's devices (``h100:2x8``: 16)."""
    if config.parallel.world_size:
        return config
    n = cluster_from_string(config.parallel.cluster).world_size
    return replace(config, parallel=replace(config.parallel, world_size=n))


def check_cluster(config: Config) -> None:
    """The planner's cluster must have exactly ``parallel.world_size`` devices, the attention kernel
    asked for must run the model's mask on the job's devices, and a GPU job must find CUDA and NCCL."""
    cluster = cluster_from_string(config.parallel.cluster)
    if cluster.world_size != config.parallel.world_size:
        raise ConfigError(f"config parallel.cluster={config.parallel.cluster!r} has {cluster.world_size} devices "
                          f"but parallel.world_size={config.parallel.world_size}; make them agree")
    from harmonia.model.attention_backend import CAUSAL, MIXED, choose_backend
    from harmonia.train.backend import backend_of

    device = "cuda" if backend_of(config) == "nccl" else "cpu"
    if device == "cuda" and cluster.device.name == "cpu":
        raise ConfigError(f"parallel.cluster={config.parallel.cluster!r} models CPUs but this job runs on GPUs "
                          f"(nccl); name its cluster, e.g. --parallel.cluster=h100:1x{config.parallel.world_size}")
    spec = model_spec(config)
    kind = MIXED if spec.item_attention != "causal" and spec.encoders else CAUSAL
    choose_backend(config.train.attention, device, kind, spec.llm.body.dim_head)
    if device == "cuda":
        import torch
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError(f"parallel.backend=nccl but this machine has no CUDA device with NCCL (torch "
                              f"{torch.__version__}); run the job on GPUs, or use --parallel.backend=gloo")


def check_model_files(config: Config) -> None:
    """Every safetensors file of the job's HF source readable (headers only), before any process starts.

    Raises:
        ConfigError: a truncated or corrupt file, named.
    """
    if not config.model.from_checkpoint:
        return
    from harmonia.model.hf.io import CheckpointFiles
    from harmonia.model.hf.source import parse_source

    src = parse_source(config.model.source)
    dirs = [src.root] if not src.is_composition else [src.llm, *src.encoders.values()]
    for where in [*dirs, *([src.projectors] if src.projectors is not None else [])]:
        CheckpointFiles(where).check()


def search_training_plan(config: Config, shapes: list[SampleShape], top: int = 1) -> PlanReport:
    """Search a plan for the job, profiling whole global batches of its dataset's shapes (``top``:
    plans ranked exactly, `harmonia.plan.search.search_plan`), on the cluster its steps are
    simulated on (`job_cluster`: a CPU job's ranks sharing this machine's cores)."""
    check_cluster(config)
    share = rank_memory_bytes(config)
    scenario = Scenario(name="train", model=config.model.source, cluster=job_cluster(config).describe(),
                        trace=config.data.path, global_batch=config.train.global_batch,
                        training=training_modes(config), iterations=2, search_batches=2, seed=config.train.seed,
                        mixed_precision=PRECISION_MIXED[config.train.precision],
                        device={} if share is None else {"mem_bytes": share})
    report = search_plan(scenario, top=top, accept=_constraints(config), samples=shapes, workers=process_cores())
    check_plan_messages(model_spec(config), report.best)
    return report


def load_training_plan(config: Config) -> Plan:
    """The plan file of ``parallel.plan``, checked against the job's model and world size."""
    plan = Plan.load(config.parallel.plan)
    if plan.world_size != config.parallel.world_size:
        raise ConfigError(f"plan {config.parallel.plan} uses {plan.world_size} ranks but parallel.world_size="
                          f"{config.parallel.world_size}; make them agree or plan again")
    spec = model_spec(config)
    plan.validate(spec)
    reason = executor_limits(plan)
    if reason:
        raise ConfigError(f"plan {config.parallel.plan}: {reason}; plan again with `harmonia train` (plan=auto)")
    check_plan_messages(spec, plan)
    plan = replace(plan, global_batch=config.train.global_batch)
    device = cluster_from_string(config.parallel.cluster).device
    device = replace(device, mixed_precision=PRECISION_MIXED[config.train.precision]) \
        if PRECISION_MIXED[config.train.precision] is not None else device
    share = rank_memory_bytes(config)
    name = device.name if share is None else "CPU share (host memory / ranks)"
    capacity = device.mem_bytes if share is None else share
    check_states_fit(CostModel(spec, device), plan, capacity, name, f"plan {config.parallel.plan}")
    return plan
