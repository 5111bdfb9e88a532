"""Build one module's pipeline stages on a rank and parallelize them, in torchtitan's order.

For every stage chunk a rank holds, the runtime builds the chunk on ``meta``, then `parallelize_stage`
there, then allocates only its shards (`harmonia.runtime.materialize`); `build_stage_modules` builds
chunks whole from a state dict (the tests' one-process references do, then parallelize):

1. `apply_tp`   — DTensor `parallelize_module` with the model's own TP plan (`plan_tp`) on the
   stage's ``tp`` mesh;
2. `apply_recompute` — activation checkpointing of the plan's share of the blocks;
3. `apply_compile` — ``torch.compile`` per block where the job compiles (``train.compile``);
4. `apply_fsdp` — FSDP2 `fully_shard` per block, then the chunk, on the stage's ``dp`` mesh (only when
   the layout says ``fsdp``; otherwise the executor all-reduces gradients over ``dp``).

Meshes come from `harmonia.runtime.meshes.build_module_meshes`: per module one `DeviceMesh`
``(pp, dp, cp, tp)`` over the layout's ranks, passed around explicitly. Nothing is stored in
module-level state.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from harmonia.errors import LayoutError
from harmonia.model.spec import MLLMSpec
from harmonia.runtime.meshes import ModuleMesh
from harmonia.schedule.layout import Layout


def stage_layers(layout: Layout, n_layers: int) -> list[tuple[int, int]]:
    """Global block range ``[a, b)`` of every stage chunk of a layout."""
    bounds, start = [], 0
    for n in layout.stage_split(n_layers):
        bounds.append((start, start + n))
        start += n
    return bounds


def build_stage_modules(spec: MLLMSpec, name: str, layout: Layout, rank: int,
                        state_dict: dict[str, torch.Tensor] | None = None) -> dict[int, nn.Module]:
    """The stage chunks of module ``name`` that ``rank`` holds (chunk ``c`` sits on pp rank ``c % pp``).

    Args:
        spec: the MLLM.
        name: module name; only modules with blocks (``llm``, encoders) split into stages.
        layout: the module's layout.
        rank: global rank.
        state_dict: the whole module's weights (names as in the one-process model); each chunk loads
            its share, so every layout starts from the same parameters.

    Returns:
        chunk index -> module holding blocks ``[a, b)`` (names match the whole model).
    """
    from harmonia.model.mllm import build_module

    body = spec.llm.body if name == "llm" else spec.encoders[name].body
    pp = layout.coords(rank)["pp"]
    chunks = {}
    for c, layers in enumerate(stage_layers(layout, body.n_layers)):
        if c % layout.pp != pp:
            continue
        module = build_module(spec, name, layers)
        if state_dict is not None:
            own = module.state_dict()
            missing = [k for k in own if k not in state_dict]
            if missing:
                raise LayoutError(f"{name} chunk {c}: weights {missing[:3]} missing from state_dict; "
                                  "pass the whole module's state_dict")
            module.load_state_dict({k: state_dict[k] for k in own})
        chunks[c] = module
    return chunks


def apply_tp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the module's linears and embeddings with its TP plan (`harmonia.model.tp.plan_tp`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from harmonia.model.tp import check_tp_degree, plan_tp, tp_styles

    check_tp_degree(module, tp_mesh.size())
    parallelize_module(module, tp_mesh, tp_styles(plan_tp(module)))


def fsdp_units(module: nn.Module) -> list:
    """FSDP2's units of a stage chunk before its root (torchtitan's): each block, and on an LLM stage
    its embedding and its final norm with the head, each a unit of its own, so resharding gathers a
    vocabulary-sized matrix only while it runs; an embedding the stage's head also multiplies by
    (tied on one stage) stays in the root with the head."""
    from harmonia.model.llm import DecoderLM

    units = list(getattr(module, "layers", {}).values())
    if isinstance(module, DecoderLM):
        tied_here = module.is_last and module.spec.tie_embeddings
        if module.embed is not None and not tied_here:
            units.insert(0, module.embed)
        if module.head is not None:
            units.append([module.norm, module.head])
    return units


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, mixed_precision: bool = False) -> None:
    """FSDP2 per unit (`fsdp_units`), then the chunk; gradients are summed over ``dp`` (the loss is
    already global). ``mixed_precision``: bf16 parameters in forward and backward, fp32 gradient
    reduction."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()
    for unit in fsdp_units(module):
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, mp_policy=policy)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):  # each fully_shard unit reduces its own gradients
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def apply_recompute(module: nn.Module, share: float = 1.0) -> int:
    """Activation checkpointing on the first ``ceil(share x n)`` of a stage module's ``n`` transformer
    blocks; returns how many. Training modes are per module, so a stage's blocks all run a backward
    or none does, and these are the blocks the cost model prices (`CostModel.stage_times`)."""
    from harmonia.model.attention import keep_out_of_compiled_graphs
    from harmonia.model.layers import Block

    keep_out_of_compiled_graphs()
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    chosen = blocks[:min(len(blocks), math.ceil(share * len(blocks) - 1e-9))] if share > 0 else []
    for block in chosen:
        block.recompute = True
    return len(chosen)


def apply_compile(module: nn.Module) -> int:
    """Compile each transformer block of a stage module (torchtitan's per-block ``torch.compile``),
    with dynamic shapes: microbatches differ in length every step and must not recompile. The
    attention kernel stays outside the compiled graphs (`harmonia.model.attention.LayerAttention`).
    Returns how many blocks."""
    from harmonia.model.attention import keep_out_of_compiled_graphs
    from harmonia.model.layers import Block

    keep_out_of_compiled_graphs()
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def hold_frozen_in(module: nn.Module, dtype: torch.dtype) -> int:
    """Hold ``module``'s frozen parameters in ``dtype`` (bf16 under mixed precision: what autocast
    computes with, 2 B instead of fp32's 4; `harmonia.workload.cost`), as Megatron-LM's
    Float16Module and a bf16-loaded transformers model hold them; trained ones keep fp32 master
    weights. Returns how many parameters changed dtype. Before TP and FSDP wrap them."""
    frozen = [p for p in module.parameters() if not p.requires_grad and p.is_floating_point() and p.dtype != dtype]
    for p in frozen:
        p.data = p.data.to(dtype)
    return len(frozen)


def parallelize_stage(module: nn.Module, mesh: ModuleMesh, recompute: float = 0.0,
                      mixed_precision: bool = False, compile: bool = False) -> nn.Module:
    """Frozen weights in bf16 under mixed precision, then TP, activation checkpointing, compilation
    and FSDP, as the plan and the job say for the module. Returns the (same) module, changed in place.

    Args:
        recompute: the share of the blocks that recompute their activations in backward
            (`Plan.recompute_share`; True = every block).
        mixed_precision: frozen parameters held in bf16 (`hold_frozen_in`); with FSDP, gather
            parameters and compute in bf16, reduce gradients in fp32 (FSDP2's
            `MixedPrecisionPolicy`); without FSDP the executor's autocast does it.
        compile: compile each block (`apply_compile`).
    """
    layout = mesh.layout
    if mixed_precision:
        hold_frozen_in(module, torch.bfloat16)
    if layout.tp > 1:
        apply_tp(module, mesh.submesh("tp"))
    if recompute:
        apply_recompute(module, float(recompute))
    if compile:
        apply_compile(module)
    if layout.fsdp and layout.dp > 1:
        apply_fsdp(module, mesh.submesh("dp"), mixed_precision)  # TP DTensors on the root mesh become 2-D
    return module
