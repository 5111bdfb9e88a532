"""Training modes of a module: full, frozen, or frozen with LoRA adapters.

LoRA (Hu et al. 2021) adds ``scale * B(A x)`` to a frozen linear ``W x``, with ``A: (r, in)``
Gaussian-initialised and ``B: (out, r)`` zero-initialised, so a fresh adapter changes nothing. The
input gradient still flows through ``W`` (the cost model's B), while weight gradients exist only for
``A`` and ``B`` (its W is adapter-only).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.training_mode import LORA_TARGETS, ModuleTraining, Trainability

DEFAULT_TARGETS = LORA_TARGETS


class LoRALinear(nn.Module):
    """A frozen ``base`` linear plus a trainable low-rank update.

    Args:
        base: the linear layer to adapt (its parameters are frozen).
        rank: adapter rank ``r``.
        alpha: scaling numerator; the update is multiplied by ``alpha / r``.
        dropout: dropout on the adapter's input (PEFT's ``lora_dropout``); the base sees ``x`` whole.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scale = (alpha if alpha is not None else rank) / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """``W + scale * B A``: the weight of an equivalent plain linear."""
        return self.base.weight + self.scale * self.lora_b.weight @ self.lora_a.weight


def apply_lora(module: nn.Module, rank: int, targets: tuple[str, ...] = DEFAULT_TARGETS,
               alpha: float | None = None, dropout: float = 0.0) -> list[str]:
    """Freeze ``module`` and wrap every linear whose name is in ``targets`` with a `LoRALinear`.

    Returns:
        the qualified names of the adapted linears.
    """
    module.requires_grad_(False)
    adapted = []
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in targets and type(child) is nn.Linear:
                setattr(parent, child_name, LoRALinear(child, rank, alpha, dropout))
                adapted.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return adapted


def check_lora_targets(module: nn.Module, training: ModuleTraining, name: str) -> None:
    """Raise `ConfigError` when a LoRA target named by the user names no linear of the whole ``module``
    (built on ``meta``), or when the default targets (every block linear) find none."""
    linears = {n.rpartition(".")[2] for n, m in module.named_modules() if type(m) is nn.Linear}
    unknown = [t for t in training.lora_targets if t not in linears]
    if unknown and (training.lora_targets != LORA_TARGETS or len(unknown) == len(LORA_TARGETS)):
        raise ConfigError(f"module {name!r}: LoRA targets {unknown} match no linear; its linears are "
                          f"{sorted(linears)}")


def merge_lora(module: nn.Module) -> None:
    """Fold every adapter into its base weight and replace the wrapper by the plain linear, in place."""
    for _, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                with torch.no_grad():
                    child.base.weight.copy_(child.merged_weight())
                setattr(parent, child_name, child.base)


def apply_training(module: nn.Module, training: ModuleTraining) -> None:
    """Set a module's parameters to its training mode, in place (full: unchanged)."""
    if training.mode is Trainability.FROZEN:
        module.requires_grad_(False)
    elif training.mode is Trainability.LORA:
        apply_lora(module, training.lora_rank, training.lora_targets, training.lora_alpha, training.lora_dropout)


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters that receive gradients, by name."""
    return {n: p for n, p in module.named_parameters() if p.requires_grad}

