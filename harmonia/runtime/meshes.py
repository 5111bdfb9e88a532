"""Every module's rank set, device mesh and process groups, built from a plan and passed explicitly.

`build_module_meshes` creates, on every rank and in one deterministic order (modules sorted by
name, then one boundary group per encoder), each module's ``DeviceMesh`` with named axes
``(pp, dp, cp, tp)`` over its layout's ranks, the group of all its ranks, its ``dp x cp`` groups
(where both exceed 1: the gradients of context-parallel replicas are summed over both), and a
group per encoder -> LLM boundary over the union of both rank sets. Group creation is collective over the whole world,
so every rank builds every group, including those of modules it does not run; a rank then reads
only the groups of its own modules. Colocated modules list the same ranks, factorised their own way;
disjoint ones own separate ranks. Nothing is stored in module-level state.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from harmonia.errors import LayoutError
from harmonia.schedule.layout import AXES, Layout
from harmonia.schedule.plan import Plan


@dataclass
class ModuleMesh:
    """One module's device mesh on one rank, and the process group of all its ranks.

    Attributes:
        name: module name (``llm``, ``vision``, ...).
        layout: the module's layout.
        mesh: ``(pp, dp, cp, tp)`` mesh over the layout's ranks.
        group: every rank of the layout, a group of its own (never the default group, even where
            the layout spans the world) that carries the module's point-to-point traffic only (stage
            messages, the tied-embedding exchange): with NCCL's communicators created eagerly every
            operation on a group shares its one stream, so no collective may sit among the
            messages' order there (a mesh axis spanning the world is the default group, which
            carries collectives).
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



@dataclass
class ModuleMeshes:
    """One rank's view of all modules' meshes and groups.

    Attributes:
        rank: this process's global rank.
        layouts: module -> layout (``llm`` and every encoder).
        meshes: module -> ``(pp, dp, cp, tp)`` DeviceMesh (every module; ranks outside a module hold a
            mesh whose ``get_coordinate()`` is None).
        groups: module -> group of all its ranks, for the modules this rank runs.
        boundary_groups: encoder -> group over the encoder's and the LLM's ranks, for the encoders whose
            boundary this rank takes part in.
        dp_cp_groups: module -> this rank's ``dp x cp`` group, for its modules with ``dp, cp > 1``.
    """

    rank: int
    layouts: dict[str, Layout]
    meshes: dict[str, DeviceMesh]
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    boundary_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    dp_cp_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)

    def modules(self) -> list[str]:
        """Modules this rank runs, sorted by name."""
        return [m for m in sorted(self.layouts) if self.layouts[m].holds(self.rank)]

    def runs(self, module: str) -> bool:
        """Whether this rank holds part of ``module``."""
        return self._layout(module).holds(self.rank)

    def coords(self, module: str) -> dict[str, int]:
        """This rank's ``pp``, ``dp``, ``cp``, ``tp`` coordinates in ``module``'s layout."""
        return self._layout(module).coords(self.rank)

    def group_of(self, module: str, axis: str) -> dist.ProcessGroup:
        """The group along ``axis`` of ``module`` through this rank."""
        self._member(module)
        if axis not in AXES:
            raise LayoutError(f"unknown axis {axis!r}: expected one of {AXES}")
        return self.meshes[module].get_group(axis)

    def module_mesh(self, module: str) -> ModuleMesh:
        """The executor's `ModuleMesh` of a module this rank runs."""
        self._member(module)
        return ModuleMesh(module, self.layouts[module], self.meshes[module], self.groups[module], self.rank,
                          self.dp_cp_groups.get(module))

    def boundary_group(self, encoder: str) -> dist.ProcessGroup:
        """Group over ``encoder``'s and the LLM's ranks (the boundary transfers' group)."""
        self._layout(encoder)
        if encoder not in self.boundary_groups:
            raise LayoutError(f"rank {self.rank} runs neither {encoder!r} nor the llm; only ranks of a "
                              "boundary's two modules use its group")
        return self.boundary_groups[encoder]

    def _layout(self, module: str) -> Layout:
        if module not in self.layouts:
            raise LayoutError(f"module {module!r} is not in the plan (modules {sorted(self.layouts)})")
        return self.layouts[module]

    def _member(self, module: str) -> None:
        if not self.runs(module):
            raise LayoutError(f"rank {self.rank} does not run {module!r} (ranks "
                              f"{self.layouts[module].rank_list()}); ask only for groups of its own modules")


def build_module_meshes(plan: Plan | Mapping[str, Layout], device_type: str = "cpu") -> ModuleMeshes:
    """Build every module's mesh and groups. Collective: every rank of the world calls it.

    Args:
        plan: a plan, or module -> layout (must contain ``llm`` for boundary groups to be built).
        device_type: ``cpu`` (gloo) or ``cuda`` (NCCL).

    Raises:
        LayoutError: a layout uses ranks outside the world, or lists explicit ranks that decrease
            along a dp, cp or tp axis (process groups order their ranks increasingly).
    """
    layouts = dict(plan.layouts if isinstance(plan, Plan) else plan)
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, layout in layouts.items():
        if max(layout.rank_list()) >= world:
            raise LayoutError(f"module {name!r} uses ranks {layout.rank_list()} but the world has {world} "
                              "ranks; launch as many processes as the plan's world size")
        for axis in ("dp", "cp", "tp"):  # torch sorts a group's ranks; collectives follow that order
            bad = [g for g in layout.group_ranks(axis) if list(g) != sorted(g)]
            if bad:
                raise LayoutError(f"module {name!r}: its {axis} groups {bad} do not list ranks in increasing "
                                  f"order, so {axis} collectives would misorder shards; order the explicit "
                                  "ranks so that ranks grow along every dp, cp and tp axis")
    out = ModuleMeshes(rank, layouts, {})
    for name in sorted(layouts):
        layout = layouts[name]
        ranks = list(layout.rank_list())
        grid = torch.tensor(ranks, dtype=torch.int).view(layout.pp, layout.dp, layout.cp, layout.tp)
        out.meshes[name] = DeviceMesh(device_type, grid, mesh_dim_names=AXES)
        group = dist.new_group(ranks)
        if rank in ranks:
            out.groups[name] = group
        if layout.dp > 1 and layout.cp > 1:
            for pp, tp in itertools.product(range(layout.pp), range(layout.tp)):
                members = sorted(layout.rank_at(pp, d, c, tp) for d in range(layout.dp) for c in range(layout.cp))
                group = dist.new_group(members)
                if rank in members:
                    out.dp_cp_groups[name] = group
    if "llm" in layouts:
        llm_ranks = set(layouts["llm"].rank_list())
        for name in sorted(m for m in layouts if m != "llm"):
            ranks = sorted(llm_ranks | set(layouts[name].rank_list()))
            group = dist.new_group(ranks)
            if rank in ranks:
                out.boundary_groups[name] = group
    return out
