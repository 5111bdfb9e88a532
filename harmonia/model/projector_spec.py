"""The projector's spec: the MLP (or Qwen-VL merger, with its DeepStack mergers) from an encoder's
output width to the LLM's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from harmonia.errors import ConfigError

PROJECTOR_ACTS: tuple[str, ...] = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu")


def check_positive(owner: str, **values: int | float | None) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{owner}: {name}={value} is invalid, expected a positive number")


@dataclass(frozen=True)
class ProjectorSpec:
    """An MLP from encoder width (times the token merge) to LLM width.

    InternVL style: LayerNorm(in) -> Linear(in, hidden) -> GELU -> Linear(hidden, out). LLaVA's
    ``multi_modal_projector`` is the same without the input norm (``linear_1 -> act -> linear_2``),
    its activation ``projector_hidden_act`` and its biases ``multimodal_projector_bias``.

    Attributes:
        act: activation between linears: ``gelu`` (exact), ``gelu_tanh``, ``quick_gelu``, ``silu``
            or ``relu``.
        bias: the linears have biases.
        newline: an ``image_newline`` vector of ``out_dim`` (LLaVA-NeXT) that ends every feature row
            of an anyres image (`harmonia.model.anyres`).
        norm: the input norm's kind, ``layernorm`` or ``rmsnorm``.
        norm_groups: the input norm normalises each of ``norm_groups`` equal slices of the input
            apart, with one shared weight (Qwen-VL's merger norms each of the ``m * m`` patches
            before they are concatenated into one token); 1 = the whole input.
        norm_eps: epsilon of the input norm.
        deepstack: Qwen3-VL's DeepStack mergers: the input is ``1 + deepstack`` equal slices, the
            first through this projector and each other through a merger of its own whose norm
            takes its whole slice (``norm_groups`` 1); the outputs are concatenated,
            ``(n, out_dim * (1 + deepstack))``, the LLM adding slice ``k`` after its block ``k - 1``.
    """

    name: str
    in_dim: int
    out_dim: int
    hidden: int
    n_layers: int = 2
    input_norm: bool = True
    act: Literal["gelu", "gelu_tanh", "quick_gelu", "silu", "relu"] = "gelu"
    bias: bool = True
    newline: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_groups: int = 1
    norm_eps: float = 1e-5
    deepstack: int = 0

    def __post_init__(self) -> None:
        check_positive(
            f"projector {self.name!r}", in_dim=self.in_dim, out_dim=self.out_dim, hidden=self.hidden,
            n_layers=self.n_layers, norm_groups=self.norm_groups, norm_eps=self.norm_eps,
        )
        if self.act not in PROJECTOR_ACTS:
            raise ConfigError(f"projector {self.name!r}: act={self.act!r} is not implemented; expected one of "
                              f"{PROJECTOR_ACTS}")
        if self.deepstack:
            if self.deepstack < 0 or self.in_dim % (1 + self.deepstack) or self.newline:
                raise ConfigError(f"projector {self.name!r}: deepstack={self.deepstack} needs in_dim={self.in_dim} "
                                  "in 1 + deepstack equal slices and no newline")
            return
        if self.norm not in ("layernorm", "rmsnorm") or self.in_dim % self.norm_groups:
            raise ConfigError(f"projector {self.name!r}: norm={self.norm!r} must be 'layernorm' or 'rmsnorm' and "
                              f"norm_groups={self.norm_groups} must divide in_dim={self.in_dim}")

    def branches(self) -> list[ProjectorSpec]:
        """The mergers of a DeepStack projector, main one first (``[self]`` without DeepStack)."""
        if not self.deepstack:
            return [self]
        width = self.in_dim // (1 + self.deepstack)
        main = replace(self, in_dim=width, deepstack=0)
        return [main, *(replace(main, name=f"{self.name}.deepstack{k}", norm_groups=1) for k in range(self.deepstack))]

    def dims(self) -> list[tuple[int, int]]:
        """(in, out) of each linear layer (of every merger, with DeepStack)."""
        if self.deepstack:
            return [d for b in self.branches() for d in b.dims()]
        widths = [self.in_dim] + [self.hidden] * (self.n_layers - 1) + [self.out_dim]
        return list(zip(widths[:-1], widths[1:]))

    def matmul_params(self) -> int:
        return sum(i * o for i, o in self.dims())

    def n_params(self) -> int:
        if self.deepstack:
            return sum(b.n_params() for b in self.branches())
        biases = sum(o for _, o in self.dims()) if self.bias else 0
        width = self.in_dim // self.norm_groups
        norm = (2 if self.norm == "layernorm" else 1) * width if self.input_norm else 0
        return self.matmul_params() + biases + norm + (self.out_dim if self.newline else 0)
