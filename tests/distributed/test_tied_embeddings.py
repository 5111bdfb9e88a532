"""Tied embeddings stay tied under pipeline parallelism: the same gradients as one process.

The tiny LLM with ``tie_embeddings`` is split over two pipeline stages: the first holds the input
embedding, the last a copy of it as the head. After each backward the executor sums the two copies'
gradients (Megatron-LM's embedding group), and the gradient norm counts the weight once. Checked on 2
gloo ranks: the first iteration's gradients, then losses, norms and parameters over 3 steps of SGD
with momentum and a clip that binds, against one process (relative difference <= 1e-5). Layouts:
pp=2 with 1F1B and with zero-bubble split backward, and two chunks on each rank (both copies on one
rank, dp=2), and tensor parallelism (the head a vocab-sharded matmul with the embedding).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from harmonia.model.batch import TokenizedSample, pack_samples
from harmonia.model.llm import build_llm, lm_loss
from harmonia.model.presets import mllm_preset
from harmonia.schedule.layout import Layout
from tests.distributed._spawn import LAYOUT_TIMEOUT_S, check_timeout, run_workers

pytestmark = pytest.mark.distributed

_BASE = mllm_preset("tiny-vlm")
SPEC = dataclasses.replace(_BASE, llm=dataclasses.replace(_BASE.llm, tie_embeddings=True))
STEPS = 3
MAX_NORM = 0.5
RTOL = 1e-5
N_MICRO = 2
CASES = {"pp2-1f1b": ({"pp": 2}, "1f1b"), "pp2-zb": ({"pp": 2}, "zb"),
         "dp2-two-chunks-per-rank": ({"dp": 2, "virtual_stages": 2}, "zb"), "tp2": ({"tp": 2}, "1f1b")}


def samples(step: int) -> list[TokenizedSample]:
    rng = random.Random(100 + step)
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(8):
        n = rng.randint(3, 16)
        ids = torch.randint(4, SPEC.llm.vocab_size, (n,), generator=g)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        out.append(TokenizedSample(ids, labels, [("text", n)], sample_id=i))
    return out


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build_llm(SPEC.llm).state_dict()


def optimizer(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def reference() -> dict:
    model = build_llm(SPEC.llm)
    model.load_state_dict(initial_state())
    assert model.head is None, "one process: the head is the embedding itself"
    params = list(model.parameters())
    opt = optimizer(params)
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        batch = pack_samples(samples(step))
        opt.zero_grad()
        loss = lm_loss(model(batch.input_ids, batch.positions(), batch.mask()), batch.labels, batch.n_targets)
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
        out["losses"].append(float(loss.detach()))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def run_case(layout_kw: dict, family: str, rank: int) -> dict:
    from harmonia.runtime.grads import clip_grad_norm
    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.runtime.mllm_executor import MLLMExecutor
    from harmonia.runtime.mllm_inputs import build_rank_batch
    from harmonia.runtime.parallelize import build_stage_modules, parallelize_stage
    from harmonia.schedule import StageGraph, build_schedule

    layout = Layout(**layout_kw)
    meshes = build_module_meshes({"llm": layout})
    chunks = build_stage_modules(SPEC, "llm", layout, rank, initial_state())
    for module in chunks.values():
        parallelize_stage(module, meshes.module_mesh("llm"))
    executor = MLLMExecutor(meshes, {"llm": chunks}, SPEC.llm.hidden, optimizer=optimizer, max_norm=MAX_NORM)
    graph = StageGraph.from_layouts({"llm": layout}, {"llm": (True,) * layout.n_stages})
    out: dict = {"losses": [], "norms": []}
    for step in range(STEPS):
        batch_samples = samples(step)
        cuts = [0, 3, 8] if layout.dp == 1 else [0, 2, 4, 6, 8]  # replica d's m-th part: (m, d)
        parts = [batch_samples[a:b] for a, b in itertools.pairwise(cuts)]
        micro = [[s for d in range(layout.dp) for s in parts[m * layout.dp + d]] for m in range(N_MICRO)]
        sizes = [[len(parts[m * layout.dp + d]) for d in range(layout.dp)] for m in range(N_MICRO)]
        split = [[list(range(sum(s[:d]), sum(s[:d + 1]))) for d in range(layout.dp)] for s in sizes]
        batch = build_rank_batch({"llm": layout}, rank, micro, split, {})
        schedule = build_schedule(graph, N_MICRO, family)
        loss = executor.forward_backward(schedule, batch)
        if step == 0:
            out["grads"] = {n: _full(p.grad) for m in chunks.values() for n, p in m.named_parameters()}
        out["norms"].append(clip_grad_norm(executor.norm_share(), executor.trainable, MAX_NORM, None))
        executor.optimizer_step()
        out["losses"].append(loss)
    out["params"] = {f"{c}.{n}": _full(p.detach()) for c, m in chunks.items() for n, p in m.named_parameters()}
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def worker(rank: int, world: int) -> dict:
    out = {}
    for name, (layout_kw, family) in CASES.items():
        with check_timeout(LAYOUT_TIMEOUT_S, f"layout {name}"):
            out[name] = run_case(layout_kw, family, rank)
    return out


@pytest.fixture(scope="module")
def results() -> tuple[list[dict], dict]:
    return run_workers(worker, 2, timeout=180), reference()


@pytest.mark.parametrize("case", sorted(CASES))
def test_tied_embedding_matches_one_process(results, case: str) -> None:
    ranks, ref = results
    got = [r[case] for r in ranks]
    assert ref["norms"][0] > MAX_NORM, "clipping must bind for the check to cover the global norm"
    for r, g in enumerate(got):
        assert g["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {r} losses"
        assert g["norms"] == pytest.approx(ref["norms"], rel=RTOL), f"rank {r} gradient norms"
        for name, grad in g["grads"].items():  # the first iteration: the copies carry the whole gradient
            # elementwise: an absolute floor of 1e-7 for near-zero entries (a few ulps of a 0.06-scale tensor)
            torch.testing.assert_close(grad, ref["grads"][name], rtol=RTOL, atol=1e-7, msg=f"rank {r} {name}")
    copies = [t for g in got for key, t in g["params"].items() if key.endswith(".embed.weight")]
    assert len(copies) == {"dp2-two-chunks-per-rank": 4, "tp2": 2}.get(case, 2)
    for t in copies:  # every copy, first stage's and last stage's, equals the one-process embedding
        torch.testing.assert_close(t, ref["params"]["embed.weight"], rtol=RTOL, atol=1e-7)
    for g in got:
        for key, t in g["params"].items():
            torch.testing.assert_close(t, ref["params"][key.split(".", 1)[1]], rtol=RTOL, atol=1e-7)
