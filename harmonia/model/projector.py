"""Projector: an MLP from (merged) encoder tokens to the LLM width, InternVL / LLaVA style."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harmonia.model.layers import init_weights
from harmonia.model.spec import ProjectorSpec


def activation(kind: str, x: torch.Tensor) -> torch.Tensor:
    """A `ProjectorSpec.act` activation, as transformers' ``ACT2FN`` computes it."""
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if kind == "silu":
        return F.silu(x)
    return F.relu(x)


class Projector(nn.Module):
    """``LayerNorm(in)`` (optional) then linears with the activation between: ``(N, P, in) -> (N, P, out)``."""

    def __init__(self, spec: ProjectorSpec) -> None:
        super().__init__()
        self.spec = spec
        self.norm = nn.LayerNorm(spec.in_dim) if spec.input_norm else None
        self.linears = nn.ModuleList(nn.Linear(i, o, bias=spec.bias) for i, o in spec.dims())
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        for i, linear in enumerate(self.linears):
            x = linear(x)
            if i < len(self.linears) - 1:
                x = activation(self.spec.act, x)
        return x


def build_projector(spec: ProjectorSpec) -> Projector:
    """The projector of one encoder."""
    return Projector(spec)
