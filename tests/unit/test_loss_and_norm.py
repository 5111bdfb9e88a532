"""The step's loss and gradient norm reduced in one collective give the floats, and the clipped
gradients, of reducing each alone (`clip_grad_norm` beside an all-reduce of the loss)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harmonia.runtime.grads import clip_grad_norm, reduce_loss_and_clip, squared_norm_share


def _params(seed: int, scale: float) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (5,), (3, 3, 2)]]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0])
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_one_collective_gives_the_two_reductions_floats(one_process_group, scale, max_norm) -> None:
    alone, fused = _params(0, scale), _params(0, scale)
    share = torch.tensor(2.718281828459045, dtype=torch.float64)
    loss_alone = share.clone()
    dist.all_reduce(loss_alone)
    norm_alone = clip_grad_norm(squared_norm_share(alone, 1), alone, max_norm, None)
    loss, norm = reduce_loss_and_clip(share, squared_norm_share(fused, 1), fused, max_norm, None)
    assert (loss, norm) == (float(loss_alone), norm_alone)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(alone, fused))
    if max_norm is not None and norm > max_norm:  # clipped: the new norm is max_norm
        assert float(torch.cat([p.grad.flatten() for p in fused]).norm()) == pytest.approx(max_norm, rel=1e-5)
