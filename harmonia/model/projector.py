"""Projector: an MLP from (merged) encoder tokens to the LLM width, InternVL / LLaVA style."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harmonia.model.layers import init_weights
from harmonia.model.spec import ProjectorSpec


class Projector(nn.Module):
    """``LayerNorm(in)`` (optional) then linears with GELU between: ``(N, P, in) -> (N, P, out)``."""

    def __init__(self, spec: ProjectorSpec) -> None:
        super().__init__()
        self.spec = spec
        self.norm = nn.LayerNorm(spec.in_dim) if spec.input_norm else None
        self.linears = nn.ModuleList(nn.Linear(i, o) for i, o in spec.dims())
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        for i, linear in enumerate(self.linears):
            x = linear(x)
            if i < len(self.linears) - 1:
                x = F.gelu(x)
        return x


def build_projector(spec: ProjectorSpec) -> Projector:
    """The projector of one encoder."""
    return Projector(spec)
