"""One module's stage chunks on one rank and their gradient reduction."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from harmonia.runtime.grads import DPGradSync, finish_fsdp_backward, plan_tied_sync, wait_fsdp_gathers
from harmonia.runtime.meshes import ModuleMesh
from harmonia.schedule.graph import LLM


@dataclass
class ModuleRunner:
    """One module's stage chunks on this rank, with their gradient reduction (its stage messages go
    through the iteration's `harmonia.runtime.messenger.Messenger`, on ``mesh.group``, which carries
    nothing else).

    Attributes:
        mesh: the module's mesh on this rank.
        chunks: chunk index -> stage module.
        projector: the encoder's projector (on the rank holding the encoder's last chunk), else None.
    """

    mesh: ModuleMesh
    chunks: dict[int, nn.Module]
    projector: nn.Module | None

    def __post_init__(self) -> None:
        layout = self.mesh.layout
        self.name = self.mesh.name
        self.n_stages = layout.n_stages
        self.params = {c: [p for p in self.weights(c)] for c in self.chunks}
        self.fsdp = layout.sharded
        self.reshard = layout.resharded  # gradients reduce-scattered by every backward already
        # Gradients all-reduced over dp x cp (every rank holding the same weights): every one, or
        # with FSDP (which reduce-scatters the chunks' own over dp) the projector's, a whole replica
        # on every dp rank; FSDP shards are then all-reduced over cp (`cp_sync`).
        self.all_reduced = {c: self.projector_weights(c) if self.fsdp else self.params[c]
                            for c in self.chunks}
        needs_sync = layout.dp * layout.cp > 1 and any(self.all_reduced.values())
        self.dp_sync = DPGradSync(self.mesh.grad_group()) if needs_sync else None
        self.cp_sync = DPGradSync(self.mesh.group_of("cp")) if self.fsdp and layout.cp > 1 else None
        self.replication = layout.dp * layout.cp * layout.tp
        self.tied = plan_tied_sync(self.chunks, layout, self.mesh.rank, self.mesh.group) if self.name == LLM else None
        self.gathers: dict[int, list] = {}  # chunk -> its FSDP gathers in flight (`start_fsdp_backward`)
        self.reduced: set[int] = set()  # chunks whose last backward reduce-scattered their gradients

    def weights(self, c: int) -> Iterator[nn.Parameter]:
        """Trainable parameters of chunk ``c`` as registered now (its projector on the last chunk)."""
        yield from (p for p in self.chunks[c].parameters() if p.requires_grad)
        yield from self.projector_weights(c)

    def projector_weights(self, c: int) -> list[nn.Parameter]:
        """Trainable parameters of the projector, on the last chunk (else none)."""
        if c != self.n_stages - 1 or self.projector is None:
            return []
        return [p for p in self.projector.parameters() if p.requires_grad]

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for ps in self.params.values() for p in ps]

    def param_groups(self) -> list[dict]:
        """The trainable parameters as optimizer param groups, one per module that has any: the chunks'
        (``"module": name``), then the projector's (``"module": "<name>_proj"``), in `trainable`'s order."""
        projector = {id(p) for c in self.chunks for p in self.projector_weights(c)}
        groups = [{"params": [p for p in self.trainable if id(p) not in projector], "module": self.name},
                  {"params": [p for p in self.trainable if id(p) in projector], "module": f"{self.name}_proj"}]
        return [g for g in groups if g["params"]]

    @property
    def norm_params(self) -> list[nn.Parameter]:
        """Trainable parameters counted in the gradient norm (a tied head's copy counts as the embedding)."""
        skip = {id(p) for p in self.tied.uncounted} if self.tied is not None else set()
        return [p for p in self.trainable if id(p) not in skip]

    def backward_done(self, c: int) -> None:
        """Start chunk ``c``'s gradient reduction over ``dp x cp`` (after its last backward)."""
        if self.fsdp:
            wait_fsdp_gathers(self.gathers.pop(c, []))
            if not self.reshard and c not in self.reduced:
                finish_fsdp_backward(self.chunks[c])
            if self.cp_sync is not None:
                self.cp_sync.start([p for p in self.chunks[c].parameters() if p.requires_grad])
        if self.dp_sync is not None and self.all_reduced[c]:
            self.dp_sync.start(self.all_reduced[c])

    def finish_reduction(self) -> None:
        """Wait for every gradient reduction started by `backward_done`."""
        for sync in (self.dp_sync, self.cp_sync):
            if sync is not None:
                sync.finish()
