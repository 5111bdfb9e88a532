"""The cost model's FLOP formulas against a direct count (torch.utils.flop_counter)."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from harmonia.model.presets import TINY_LLMS, encoder_preset, projector_for
from harmonia.model.spec import TransformerSpec
from harmonia.model.training_mode import Trainability
from harmonia.workload.layers import _dense, block_cost, encoder_layers, projector_layers
from harmonia.workload.profile import ProbeBlock

SPECS = [
    TransformerSpec(1, 64, 4, 256),
    TransformerSpec(1, 96, 6, 256, n_kv_heads=2, mlp="swiglu", norm="rmsnorm", qkv_bias=False),
    TINY_LLMS["tiny-llm"].body,
]


def explicit_attention(q, k, v, *args, **kwargs):
    """Attention as plain matmuls, which the flop counter sees on every backend."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, nh, T, T)
    return scores.softmax(dim=-1) @ v  # (B, nh, T, hd)


@pytest.fixture(autouse=True)
def _countable_attention(monkeypatch):
    monkeypatch.setattr(nn.functional, "scaled_dot_product_attention", explicit_attention)


def count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def within(analytic: float, counted: float, tol: float = 0.05) -> bool:
    return abs(analytic - counted) <= tol * counted


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"h{s.hidden}-{s.mlp}")
@pytest.mark.parametrize("tokens", [64, 200])
def test_block_forward_and_backward_flops(spec: TransformerSpec, tokens: int) -> None:
    block = ProbeBlock(spec)
    x = torch.randn(1, tokens, spec.hidden, requires_grad=True)
    layer = block_cost("b", spec, Trainability.FULL, 16, upstream_trains=True)
    pairs = tokens * tokens  # ProbeBlock attends bidirectionally over one sequence
    forward = count(lambda: block(x))
    y = block(x)
    backward = count(lambda: y.backward(torch.ones_like(y)))
    assert within(layer.f_tok * tokens + layer.f_pair * pairs, forward)
    assert within(layer.b_tok * tokens + layer.b_pair * pairs + layer.w_tok * tokens, backward)


def test_block_input_gradient_only_matches_b() -> None:
    spec = SPECS[0]
    block = ProbeBlock(spec).requires_grad_(False)  # frozen, but something upstream trains
    x = torch.randn(1, 128, spec.hidden, requires_grad=True)
    layer = block_cost("b", spec, Trainability.FROZEN, 16, upstream_trains=True)
    y = block(x)
    backward = count(lambda: torch.autograd.grad(y, [x], torch.ones_like(y)))
    assert layer.w_tok == 0
    assert within(layer.b_tok * 128 + layer.b_pair * 128 * 128, backward)


def test_patch_embedding_and_projector_flops() -> None:
    enc = encoder_preset("tiny-vit")
    conv = nn.Conv2d(3, enc.body.hidden, enc.patch_size, enc.patch_size)
    img = torch.randn(2, 3, enc.image_size, enc.image_size)
    front = encoder_layers("vision", enc, Trainability.FULL, 16)[0]
    tokens = 2 * enc.patches_per_tile()
    assert within(front.f_tok * tokens, count(lambda: conv(img)))

    proj_spec = projector_for("vision_proj", enc, TINY_LLMS["tiny-llm"])
    mlp = nn.Sequential(nn.Linear(proj_spec.in_dim, proj_spec.hidden), nn.GELU(),
                        nn.Linear(proj_spec.hidden, proj_spec.out_dim))
    z = torch.randn(50, proj_spec.in_dim, requires_grad=True)
    proj = projector_layers("vision_proj", proj_spec, Trainability.FULL, upstream_trains=True)[0]
    assert within(proj.f_tok * 50, count(lambda: mlp(z)))
    out = mlp(z)
    assert within((proj.b_tok + proj.w_tok) * 50, count(lambda: out.sum().backward()))


def test_lm_head_flops() -> None:
    head = nn.Linear(48, 256, bias=False)
    layer = _dense("llm.head", "head", 48 * 256, 48 * 256, True, True, 48, 512)
    x = torch.randn(77, 48)
    assert within(layer.f_tok * 77, count(lambda: head(x)))
