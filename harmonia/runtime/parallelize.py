"""Build one module's pipeline stages on a rank and parallelize them, in torchtitan's order.

For every stage chunk a rank holds: build the chunk (`build_stage_modules`), load the whole model's
weights into it, then `parallelize_stage`:

1. `apply_tp`   — DTensor `parallelize_module` with the model's own TP plan (`plan_tp`) on the
   stage's ``tp`` mesh;
2. `apply_fsdp` — FSDP2 `fully_shard` per block, then the chunk, on the stage's ``dp`` mesh (only when
   the layout says ``fsdp``; otherwise the executor all-reduces gradients over ``dp``).

Meshes come from `build_module_mesh`: one `DeviceMesh` ``(pp, dp, cp, tp)`` over the layout's ranks,
passed around explicitly. Nothing is stored in module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from harmonia.errors import LayoutError
from harmonia.model.spec import MLLMSpec
from harmonia.plan.layout import AXES, Layout


@dataclass
class ModuleMesh:
    """One module's device mesh on one rank, and the process group of all its ranks.

    Attributes:
        name: module name (``llm``, ``vision``, ...).
        layout: the module's layout.
        mesh: ``(pp, dp, cp, tp)`` mesh over the layout's ranks.
        group: every rank of the layout (loss reporting, default group of the gradient norm).
        rank: this process's global rank.
        dp_cp_group: the ranks of this rank's ``(pp, tp)`` position over ``dp`` and ``cp`` together,
            where both exceed 1 (`grad_group`).
    """

    name: str
    layout: Layout
    mesh: DeviceMesh
    group: dist.ProcessGroup
    rank: int
    dp_cp_group: dist.ProcessGroup | None = None

    @property
    def coords(self) -> dict[str, int]:
        """This rank's ``pp``, ``dp``, ``cp``, ``tp`` coordinates in the layout."""
        return self.layout.coords(self.rank)

    def submesh(self, axis: str) -> DeviceMesh:
        """The 1-D mesh along ``axis`` through this rank."""
        return self.mesh[axis]

    def group_of(self, axis: str) -> dist.ProcessGroup:
        """The process group along ``axis`` through this rank."""
        return self.mesh.get_group(axis)

    def grad_group(self) -> dist.ProcessGroup:
        """The ranks holding the same weights: gradients of replicated weights are summed over ``dp x cp``."""
        if self.layout.cp == 1:
            return self.group_of("dp")
        if self.layout.dp == 1:
            return self.group_of("cp")
        if self.dp_cp_group is None:
            raise LayoutError(f"module {self.name!r}: dp={self.layout.dp} x cp={self.layout.cp} needs its dp_cp "
                              "group; build meshes with harmonia.runtime.meshes.build_module_meshes")
        return self.dp_cp_group


def build_module_mesh(name: str, layout: Layout, device_type: str = "cpu") -> ModuleMesh:
    """A module's mesh. Collective: every rank of the default group calls it, in the same order.

    Raises:
        LayoutError: when this process is not one of the layout's ranks, or ``cp > 1`` (the
            single-module `harmonia.runtime.executor.PipelineExecutor` has no context parallelism).
    """
    rank = dist.get_rank()
    ranks = layout.rank_list()
    if layout.cp > 1:
        raise LayoutError(f"module {name!r}: cp={layout.cp}; the single-module pipeline executor runs cp=1. "
                          "Context parallelism runs in the MLLM executor (meshes from "
                          "harmonia.runtime.meshes.build_module_meshes)")
    grid = torch.tensor(ranks, dtype=torch.int).view(layout.pp, layout.dp, layout.cp, layout.tp)
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=AXES)
    group = dist.new_group(list(ranks))
    if rank not in ranks:
        raise LayoutError(f"rank {rank} is not in module {name!r}'s layout (ranks {ranks}); "
                          "build meshes only for the modules a rank runs")
    return ModuleMesh(name, layout, mesh, group, rank)


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


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, mixed_precision: bool = False) -> None:
    """FSDP2 per block, then the chunk; gradients are summed over ``dp`` (the loss is already global).
    ``mixed_precision``: bf16 parameters in forward and backward, fp32 gradient reduction."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()
    for block in getattr(module, "layers", {}).values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, mp_policy=policy)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):  # each fully_shard unit reduces its own gradients
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def apply_recompute(module: nn.Module) -> int:
    """Activation checkpointing on every transformer block of a stage module; returns how many."""
    from harmonia.model.layers import Block

    blocks = [m for m in module.modules() if isinstance(m, Block)]
    for block in blocks:
        block.recompute = True
    return len(blocks)


def parallelize_stage(module: nn.Module, mesh: ModuleMesh, recompute: bool = False,
                      mixed_precision: bool = False) -> nn.Module:
    """TP, activation checkpointing, then FSDP, as the plan says for the module. Returns the (same)
    module, changed in place.

    Args:
        recompute: recompute each block's activations in backward (the plan's ``recompute``).
        mixed_precision: with FSDP, gather parameters and compute in bf16, reduce gradients in
            fp32 (FSDP2's `MixedPrecisionPolicy`); without FSDP the executor's autocast does it.
    """
    layout = mesh.layout
    if layout.tp > 1:
        apply_tp(module, mesh.submesh("tp"))
    if recompute:
        apply_recompute(module)
    if layout.fsdp and layout.dp > 1:
        apply_fsdp(module, mesh.submesh("dp"), mixed_precision)  # TP DTensors on the root mesh become 2-D
    return module
