"""How each module of an MLLM trains: fully, frozen, or as LoRA adapters over a frozen base.

`ModuleTraining` is plain data the spec (`harmonia.model.spec.MLLMSpec.training`), the config, the
cost model and the runtime share; `harmonia.model.lora` builds the adapters it describes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from harmonia.errors import ConfigError


LORA_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc1", "fc2",
)
"""The linears of harmonia's blocks (attention and MLP) that get LoRA adapters unless told otherwise."""


class Trainability(str, Enum):
    """How a module's parameters train."""

    FULL = "full"
    FROZEN = "frozen"
    LORA = "lora"  # frozen base weights with trainable low-rank adapters


@dataclass(frozen=True)
class ModuleTraining:
    """Training mode of one module and, under LORA, its adapters.

    Attributes:
        mode: full, frozen or LoRA.
        lora_rank: adapter rank ``r``.
        lora_alpha: the update is scaled by ``lora_alpha / r``; None = ``r`` (scale 1).
        lora_dropout: dropout on an adapter's input (training only), as PEFT's ``lora_dropout``.
        lora_targets: names of the linears that get adapters (the last part of a module path, as
            PEFT's ``target_modules``); every one must name some linear of the module.
    """

    mode: Trainability = Trainability.FULL
    lora_rank: int = 16
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Trainability(self.mode))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        for name, value in (("lora_rank", self.lora_rank), ("lora_alpha", self.lora_alpha)):
            if value is not None and value <= 0:
                raise ConfigError(f"ModuleTraining: {name}={value} is invalid, expected a positive number")
        if not 0.0 <= self.lora_dropout < 1.0 or not self.lora_targets:
            raise ConfigError(f"ModuleTraining: lora_dropout={self.lora_dropout} must be in [0, 1) and lora_targets "
                              f"non-empty (got {list(self.lora_targets)})")

    @property
    def lora_scale(self) -> float:
        """``alpha / r``: what an adapter's update is multiplied by."""
        return (self.lora_rank if self.lora_alpha is None else self.lora_alpha) / self.lora_rank

    def lora_options(self) -> dict | None:
        """The adapters' settings as plain data (a checkpoint records them); None when not LORA."""
        if self.mode is not Trainability.LORA:
            return None
        return {"rank": self.lora_rank, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                "targets": list(self.lora_targets)}

    @property
    def trains(self) -> bool:
        return self.mode is not Trainability.FROZEN
