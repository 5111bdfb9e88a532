"""Elementwise steps of a block that keep, for backward, only what the cost model prices.

Composed from plain operators, autograd keeps every intermediate an operator needs: an RMSNorm keeps
its normalised input beside its input (for the weight's gradient), SwiGLU keeps ``silu(gate)``
beside ``gate`` and ``up``. These functions compute the same values with the same operators, in the
same order and dtypes (transformers' ``LlamaRMSNorm`` and ``LlamaMLP``), and keep only their
inputs (and the norm's per-token ``1 / rms``): what they dropped, backward computes again from them.
`harmonia.workload.layers.block_cost` counts exactly that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harmonia.model.dtensors import is_dtensor


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd  # (..., h) fp32
        grad_w = None
        if ctx.needs_input_grad[1]:
            prod = grad * xhat.to(x.dtype)
            grad_w = prod.reshape(-1, prod.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype).float()  # the gradient reaching the fp32 normalised input
            grad_x = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dimension, computed in float32 and cast back to
    ``x``'s dtype before the weight (``LlamaRMSNorm``). Keeps ``x`` and ``1 / rms`` (one element per
    row) for backward. DTensor inputs (a per-head norm under tensor parallelism) take the plain
    operators."""
    if is_dtensor(x) or is_dtensor(weight):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return _RMSNorm.apply(x, weight, eps)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # autograd's own kernels for silu(gate) * up: the same gradients, bit for bit, in 4 operators
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``, keeping only ``gate`` and ``up`` for backward."""
    return _SiluMul.apply(gate, up)
