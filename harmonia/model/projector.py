"""Projector: an MLP from (merged) encoder tokens to the LLM width, InternVL / LLaVA style."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harmonia.errors import SampleError
from harmonia.model.layers import build_norm, init_weights
from harmonia.model.projector_spec import ProjectorSpec


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
    """An input norm (optional; per slice with ``norm_groups``) then linears with the activation between: ``(N, P, in) -> (N, P, out)``.

    With ``spec.newline`` it holds LLaVA-NeXT's ``image_newline`` (``(out,)``, initialised as
    transformers does: normal with std ``out ** -0.5``) and, given an ``order``
    (`harmonia.model.batch.MediaInputs.order`), returns the items' LLM tokens in that order instead.
    """

    param_init = {"image_newline": ("normal", lambda shape: shape[-1] ** -0.5)}  # `harmonia.model.init`

    def __init__(self, spec: ProjectorSpec) -> None:
        super().__init__()
        self.spec = spec
        self.norm = build_norm(spec.norm, spec.in_dim // spec.norm_groups, spec.norm_eps) if spec.input_norm else None
        self.linears = nn.ModuleList(nn.Linear(i, o, bias=spec.bias) for i, o in spec.dims())
        self.image_newline = nn.Parameter(torch.randn(spec.out_dim) * spec.out_dim**-0.5) if spec.newline else None
        init_weights(self)

    def forward(self, x: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """``(N, P, in) -> (N, P, out)``; with ``order`` (``(n, 2)`` sequence, feature) ``-> (n, out)``."""
        if self.norm is not None:
            g = self.spec.norm_groups
            x = self.norm(x) if g == 1 else self.norm(x.unflatten(-1, (g, -1))).flatten(-2)  # each slice apart
        for i, linear in enumerate(self.linears):
            x = linear(x)
            if i < len(self.linears) - 1:
                x = activation(self.spec.act, x)
        return x if order is None else self.arrange(x, order)

    def arrange(self, y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Projected features ``(N, P, out)`` -> ``(n, out)`` LLM tokens: ``y[seq, feature]``, or the
        newline where ``seq < 0``."""
        if self.image_newline is None:
            raise SampleError(f"projector {self.spec.name!r} has no image_newline; anyres token orders are for a "
                              "LLaVA-NeXT projector (ProjectorSpec.newline)")
        seq, feature = order.unbind(1)
        n_seq, per_seq = y.shape[:2]
        if order.numel() and (int(seq.max()) >= n_seq or int(feature.max()) >= per_seq):
            raise SampleError(f"an anyres token order reaches sequence {int(seq.max())}, feature {int(feature.max())} "
                              f"of {n_seq} sequences of {per_seq} features; build it for the items' sizes")
        rows = y.flatten(0, 1)[seq.clamp(min=0) * per_seq + feature]  # (n, out)
        return torch.where((seq < 0)[:, None], self.image_newline.to(rows.dtype), rows)


class DeepStackProjector(nn.Module):
    """Qwen3-VL's merger and DeepStack mergers, each over its own slice of the input:
    ``(n, in) -> (n, out * (1 + deepstack))``, the main merger's tokens first (`ProjectorSpec.deepstack`)."""

    def __init__(self, spec: ProjectorSpec) -> None:
        super().__init__()
        main, *stack = spec.branches()
        self.spec = spec
        self.merger = Projector(main)
        self.deepstack = nn.ModuleList(Projector(b) for b in stack)

    def forward(self, x: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """``(n, in)`` rows, the main slice then one per DeepStack merger -> ``(n, out (1 + k))``."""
        parts = x.chunk(1 + len(self.deepstack), dim=-1)
        return torch.cat([self.merger(parts[0]), *(m(p) for m, p in zip(self.deepstack, parts[1:]))], dim=-1)


def build_projector(spec: ProjectorSpec) -> nn.Module:
    """The projector of one encoder."""
    return DeepStackProjector(spec) if spec.deepstack else Projector(spec)
