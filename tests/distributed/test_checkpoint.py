"""Checkpoints: FSDP-sharded on 2 ranks, loaded unsharded on 1 (another layout), optimizer included."""

import pytest
import torch
from torch import nn

from harmonia.runtime.checkpoint import latest_step, load_checkpoint, save_checkpoint
from tests.distributed._spawn import run_workers


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def train_one_step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    loss = m(torch.randn(6, 8)).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _save_sharded(rank: int, world: int, directory: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = model()
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    train_one_step(m, opt)
    save_checkpoint(directory, 1, {"llm": m}, {"llm": opt}, {"data_position": 37})
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    return {k: v.clone() for k, v in full.items()}


def _load_single(rank: int, world: int, directory: str) -> tuple[dict, dict, dict]:
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    train_one_step(m, opt)  # creates optimizer state to be overwritten
    state = load_checkpoint(directory, {"llm": m}, {"llm": opt})
    exp_avg = {i: s["exp_avg"].clone() for i, s in enumerate(opt.state.values())}
    return state, {k: v.clone() for k, v in m.state_dict().items()}, exp_avg


@pytest.mark.distributed
def test_resume_under_a_different_layout(tmp_path) -> None:
    saved = run_workers(_save_sharded, 2, (str(tmp_path),), timeout=600)[0]
    assert latest_step(tmp_path) == 1
    state, loaded, exp_avg = run_workers(_load_single, 1, (str(tmp_path),), timeout=600)[0]
    assert state == {"step": 1, "data_position": 37}
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    assert all(v.abs().sum() > 0 for v in exp_avg.values())
