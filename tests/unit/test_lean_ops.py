"""The block's elementwise steps keep what the cost model prices, and compute what the plain operators do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harmonia.model.attention import PackedAttention
from harmonia.model.batch import TokenLayout
from harmonia.model.layers import Block, rope_cos_sin
from harmonia.model.lean_ops import rms_norm, silu_mul
from harmonia.model.presets import mllm_preset
from harmonia.model.training_mode import Trainability
from harmonia.workload.layers import block_cost


def plain_rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_match_the_plain_operators(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 16, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(16, generator=g)).to(dtype).requires_grad_()
    up = torch.randn(2, 7, 16, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(2, 7, 16, generator=g).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for lean, plain, args in ((rms_norm, plain_rms_norm, (x, w, 1e-6)),
                              (silu_mul, lambda a, b: F.silu(a) * b, (x, up))):
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        y, y_ref = lean(*args), plain(*args)
        assert torch.equal(y, y_ref) and y.dtype == y_ref.dtype
        for a, b in zip(torch.autograd.grad(y, tensors, grad), torch.autograd.grad(y_ref, tensors, grad)):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
            if lean is silu_mul:  # autograd's own kernels: the plain operators' gradients, bit for bit
                assert torch.equal(a, b)


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.ones(8)
    y = rms_norm(x, w, 1e-6)
    (gx,) = torch.autograd.grad(y.square().sum(), (x,))
    (gx_ref,) = torch.autograd.grad(plain_rms_norm(x, w, 1e-6).square().sum(), (x,))
    torch.testing.assert_close(gx, gx_ref)


def saved_per_token(block: Block, spec, tokens: int, rope: bool) -> float:
    """Elements per token a block keeps for backward: every saved storage once, the block's input
    included, its weights and the rotary tables (shared by all layers) left out."""
    layout = TokenLayout.from_segments([[("text", tokens // 2)], [("text", tokens // 2)]])
    tables = rope_cos_sin(layout.position, spec.dim_head, 10000.0) if rope else None
    x = torch.randn(1, tokens, spec.hidden, requires_grad=True)
    shared = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *(tables or ())]}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, PackedAttention(layout).for_window(None), tables)
    return sum(saved.values()) / x.element_size() / tokens


@pytest.mark.parametrize("module", ["llm", "vision"])
@pytest.mark.parametrize("mode", [Trainability.FULL, Trainability.FROZEN])
def test_a_block_keeps_the_activations_the_cost_model_prices(module, mode):
    """The count of `block_cost` (Korthikanti et al.'s, less dropout) is what the runtime's block
    keeps, up to its per-row statistics: the priced softmax statistics are ``2 n_heads`` 2-byte
    elements (``n_heads`` fp32 values: half as many 4-byte elements), and the norms keep one (RMS)
    or two (LayerNorm) values per row each."""
    spec_all = mllm_preset("tiny-vlm")
    spec = spec_all.llm.body if module == "llm" else spec_all.encoders["vision"].body
    torch.manual_seed(0)
    block = Block(spec)
    block.requires_grad_(mode is Trainability.FULL)
    measured = saved_per_token(block, spec, 256, rope=module == "llm")
    priced = block_cost("b", spec, mode, 0, upstream_trains=True).act_elems_tok
    stats = 2 * (1 if spec.norm == "rmsnorm" else 2)
    assert measured == priced - spec.n_heads + stats
