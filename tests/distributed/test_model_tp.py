"""The reference models' TP plans under `parallelize_module` (2 ranks, gloo, CPU) match one process."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor.parallel import loss_parallel

from harmonia.model.batch import ItemInputs, TokenizedSample, pack_samples
from harmonia.model.mllm import build_mllm_model
from harmonia.model.presets import mllm_preset
from harmonia.model.tp import plan_tp, tp_styles
from tests.distributed._spawn import preloaded_forkserver

pytestmark = pytest.mark.distributed
SPEC = mllm_preset("tiny-vlm")


def _batch():
    g = torch.Generator().manual_seed(0)
    segments = [("text", 3), ("item", 4), ("text", 9)]
    ids = torch.randint(4, 256, (16,), generator=g)
    labels = torch.roll(ids, -1)
    labels[-1] = -100
    items = [ItemInputs("vision", torch.randn(1, 3, 16, 16, generator=g))]
    return pack_samples([TokenizedSample(ids, labels, segments, items), TokenizedSample(ids[:5], labels[:5], [("text", 5)])])


def _worker(rank: int, world: int, port: int, lora: bool, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    spec = SPEC.with_training(llm="lora") if lora else SPEC
    model = build_mllm_model(spec)
    if lora:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_b" in n:
                    p.normal_(std=0.05)
    batch = _batch()
    ref_loss = model.loss(batch)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    mesh = init_device_mesh("cpu", (world,))
    for name in spec.module_names:
        parallelize_module(model.module(name), mesh, tp_styles(plan_tp(model.module(name))))
    from torch.distributed.tensor import DTensor

    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    with loss_parallel():  # the TP head's logits are split over the vocabulary
        loss = model.loss(batch)
        loss.backward()
    worst = 0.0
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, float((g - ref_grads[n]).abs().max()))
    if rank == 0:
        out["loss"] = (float(loss), float(ref_loss))
        out["grad"] = worst
        out["sharded"] = len(sharded)
    dist.barrier()  # no rank tears its group down while the other still talks to it
    dist.destroy_process_group()


@pytest.mark.parametrize("lora", [False, True])
def test_tp2_matches_single_process(lora):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(2, port, lora, out), nprocs=2, join=True,
                           start_method=preloaded_forkserver())
        loss, ref = out["loss"]
        assert loss == pytest.approx(ref, abs=1e-5)
        assert out["grad"] < 1e-5
        assert out["sharded"] > 10


def _qwen3_worker(rank: int, world: int, port: int, out: dict) -> None:
    """Qwen3 (per-head q/k norms, 4 query / 2 key-value heads) under tp=world vs the same model whole."""
    import transformers

    from harmonia.model.attention_mask import TokenLayout, multimodal_mask
    from harmonia.model.hf.llama_config import llm_spec_from_hf
    from harmonia.model.llm import build_llm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, head_dim=12)
    torch.manual_seed(0)
    model = build_llm(llm_spec_from_hf(config.to_dict()))
    with torch.no_grad():  # norms away from ones, so that an unsharded or unsummed norm shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(1))
    layout = TokenLayout.from_segments([[("text", 11)]])

    def loss() -> torch.Tensor:
        logits = model(ids, layout.position[None], multimodal_mask(layout))  # (1, 11, 96)
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])

    ref = loss()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plan = plan_tp(model)
    parallelize_module(model, init_device_mesh("cpu", (world,)), tp_styles(plan))
    with loss_parallel():
        got = loss()
        got.backward()
    worst = max(float(((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) - ref_grads[n])
                      .abs().max()) for n, p in model.named_parameters())
    norm_grads = [float(p.grad.full_tensor().abs().sum()) for n, p in model.named_parameters() if "q_norm" in n]
    if rank == 0:
        out.update(loss=(float(got), float(ref)), grad=worst, norm_styles=sorted(
            k for k, v in plan.items() if v == "head_norm"), norm_grads=norm_grads)
    dist.barrier()  # no rank tears its group down while the other still talks to it
    dist.destroy_process_group()


def test_qwen3_per_head_norms_under_tp2_match_single_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_qwen3_worker, args=(2, port, out), nprocs=2, join=True,
                           start_method=preloaded_forkserver())
        loss, ref = out["loss"]
        assert loss == pytest.approx(ref, abs=1e-5)
        assert out["grad"] < 1e-5
        assert out["norm_styles"] == ["layers.*.attn.k_norm", "layers.*.attn.q_norm"]
        assert min(out["norm_grads"]) > 0
