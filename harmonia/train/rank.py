"""One rank's share of the MLLM: its stage chunks of every module, projectors, executor, named state.

Every rank builds the stage chunks its layouts give it on the ``meta`` device, applies training
modes (frozen, LoRA), then TP / FSDP as the plan says, and only then allocates and fills its own
shards (`harmonia.runtime.materialize`), each tensor's value from the job's seed or the checkpoint
(`harmonia.train.weights.chunk_values`): every layout starts from the same parameters as one process
would, and no rank ever holds more than its shards plus one whole tensor. Parameters keep their whole-model
names (``llm.layers.3.attn.q.weight``), which is what checkpoints are keyed by: a checkpoint written
under one plan loads under another.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch import nn

from harmonia.model.spec import MLLMSpec
from harmonia.schedule.plan import Plan
from harmonia.runtime.meshes import ModuleMeshes
from harmonia.runtime.mllm_executor import MLLMExecutor, OptimizerFactory
from harmonia.schedule.graph import LLM, StageGraph, fused_backward


def prefix_of(module: str) -> str:
    """Whole-model name prefix of a module's parameters (``llm.``, ``encoders.vision.``, ``projectors.x.``)."""
    if module == LLM:
        return "llm."
    if module.endswith("_proj"):
        return f"projectors.{module}."
    return f"encoders.{module}."


@dataclass
class RankModel:
    """What one rank trains.

    Attributes:
        executor: runs the iteration's actions and the optimizer steps.
        named: whole-model name -> this rank's parameter or buffer (a DTensor when sharded).
        owner: whole-model name of each trainable parameter -> the module whose optimizer holds it.
    """

    executor: MLLMExecutor
    named: dict[str, torch.Tensor]
    owner: dict[str, str]

    def trainable_named(self) -> dict[str, nn.Parameter]:
        return {n: t for n, t in self.named.items() if n in self.owner}


def stage_flags(spec: MLLMSpec, plan: Plan) -> dict[str, tuple[bool, ...] | bool]:
    """Per module, whether each stage chunk has anything to train (its projector counts on the last)."""
    flags: dict[str, tuple[bool, ...] | bool] = {LLM: spec.training_of(LLM).trains}
    for e in plan.encoders:
        n = plan.layouts[e].n_stages
        flags[e] = tuple(spec.training_of(e).trains or (c == n - 1 and spec.training_of(f"{e}_proj").trains)
                         for c in range(n))
    return flags


def schedule_graph(spec: MLLMSpec, plan: Plan, forward_only: bool = False) -> StageGraph:
    """One LLM replica's stage graph: trainable chunks from the spec (none with ``forward_only``: an
    evaluation's schedules hold forward actions alone), fused backwards by `fused_backward`."""
    flags = {m: False for m in plan.layouts} if forward_only else stage_flags(spec, plan)
    return StageGraph.from_layouts(plan.layouts, flags, replica=0,
                                   fused=fused_backward(plan.layouts, spec.llm.tie_embeddings))


def rank_device(backend: str) -> torch.device:
    """This process's device: its local GPU under NCCL (made current), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def to_device(obj, device: torch.device):
    """``obj`` with every tensor inside (dataclasses, lists, tuples, dicts) moved to ``device``, but
    for dataclass fields marked to stay on the host (`harmonia.model.batch.HOST`: what the step plans
    from there, so that it reads nothing back from the device)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: getattr(obj, f.name) if f.metadata.get("host") else
                                           to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def build_rank_model(spec: MLLMSpec, plan: Plan, meshes: ModuleMeshes, seed: int,
                     optimizer: OptimizerFactory,
                     max_norm: float | None, device: torch.device = torch.device("cpu"),
                     precision: str = "auto", source: str | dict | None = None, attention: str = "auto",
                     compile: str = "auto") -> RankModel:
    """Build this rank's chunks, projectors and executor on ``device`` (collective: every rank calls it).

    The plan's ``recompute`` modules checkpoint their blocks' activations; ``precision`` ``bf16``
    (``auto``: on GPUs) runs every forward under bf16 autocast, holds frozen weights in bf16 and
    gathers FSDP parameters in bf16, with fp32 trained weights, gradient reduction and optimizer
    states. Chunks are built on ``meta`` and sharded before any memory is allocated; each rank then
    fills only its shards, from ``source`` (an HF checkpoint directory or a composition: each tensor
    read alone) or from ``seed`` (`harmonia.train.weights.chunk_values`). ``attention``
    is the LLM's kernel (`harmonia.model.attention_backend.choose_backend`); ``compile`` ``on`` (``auto``: on
    GPUs) compiles every block (`harmonia.runtime.parallelize.apply_compile`).
    """
    from harmonia.model.lora import apply_training
    from harmonia.model.mllm import build_module
    from harmonia.runtime.materialize import materialize
    from harmonia.runtime.parallelize import hold_frozen_in, parallelize_stage, stage_layers
    from harmonia.train.backend import runs_mixed
    from harmonia.train.weights import chunk_values

    rank = meshes.rank
    chunks: dict[str, dict[int, nn.Module]] = {}
    projectors: dict[str, nn.Module] = {}
    named: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    mixed = runs_mixed(precision, device.type)
    compiled = compile == "on" or (compile == "auto" and device.type == "cuda")

    def keep(module: nn.Module, prefix: str, owned_by: str) -> None:
        for n, t in [*module.named_parameters(), *module.named_buffers()]:
            named[prefix + n] = t
        owner.update({prefix + n: owned_by for n, p in module.named_parameters() if p.requires_grad})

    def on_meta(name: str, layers: tuple[int, int] | None) -> nn.Module:
        with torch.device("meta"):
            module = build_module(spec, name, layers)
        apply_training(module, spec.training_of(name))
        return module

    for name in meshes.modules():
        layout, mesh, prefix = plan.layouts[name], meshes.module_mesh(name), prefix_of(name)
        body = spec.llm.body if name == LLM else spec.encoders[name].body
        layers_of = stage_layers(layout, body.n_layers)
        pp = layout.coords(rank)["pp"]
        chunks[name] = {}
        for c in range(len(layers_of)):
            if c % layout.pp != pp:
                continue
            module = on_meta(name, layers_of[c])
            values = chunk_values(module, spec, name, seed, source)  # checks the checkpoint first
            parallelize_stage(module, mesh, recompute=plan.recompute_share(name), mixed_precision=mixed,
                              compile=compiled)
            materialize(module, device, values)
            chunks[name][c] = module
            keep(module, prefix, name)
        if name != LLM and layout.n_stages - 1 in chunks[name]:
            proj = on_meta(f"{name}_proj", None)
            values = chunk_values(proj, spec, f"{name}_proj", seed, source)
            if mixed:
                hold_frozen_in(proj, torch.bfloat16)
            materialize(proj, device, values)
            projectors[name] = proj
            keep(proj, prefix_of(f"{name}_proj"), name)
    executor = MLLMExecutor(meshes, chunks, spec.llm.hidden, projectors, optimizer=optimizer, max_norm=max_norm,
                            autocast=torch.bfloat16 if mixed else None, attention=attention,
                            row_widths=boundary_widths(spec), head_dim=spec.llm.body.dim_head)
    return RankModel(executor, named, owner)


def boundary_widths(spec) -> dict[str, int]:
    """Encoder -> width of the rows it sends the LLM: the LLM's hidden size, times one plus the
    DeepStack feature sets its projector adds (Qwen3-VL)."""
    return {e: spec.llm.hidden * (1 + spec.projectors[f"{e}_proj"].deepstack) for e in spec.encoders}
