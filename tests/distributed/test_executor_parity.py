"""The executor trains the tiny LLM alone (a graph without encoders) exactly as one process does.

Every layout runs 3 optimizer steps (SGD with momentum, global-norm clipping that binds) on
variable-size microbatches: each step's samples differ in length and each microbatch in sample
count. Loss, gradient norm and final parameters must match a one-process run on the same samples
(relative difference <= 1e-5). All layouts of one world size share one spawned process group.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field

import pytest
import torch

from harmonia.model.batch import TokenizedSample, pack_samples
from harmonia.model.llm import build_llm, lm_loss
from harmonia.model.presets import mllm_preset
from harmonia.schedule.layout import Layout
from tests.distributed._spawn import LAYOUT_TIMEOUT_S, check_timeout, run_workers

pytestmark = pytest.mark.distributed

SPEC = mllm_preset("tiny-vlm")
STEPS = 3
MAX_NORM = 0.5
RTOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One layout to check: LLM layout, schedule family, microbatches per replica, frozen chunks."""

    name: str
    layout: dict
    family: str = "1f1b"
    n_microbatches: int = 4
    frozen_chunks: tuple[int, ...] = field(default=())


CASES: dict[int, list[Case]] = {
    2: [
        Case("pp2-1f1b", {"pp": 2}),
        Case("pp2-gpipe", {"pp": 2}, "gpipe"),
        Case("pp2-zb", {"pp": 2}, "zb"),
        Case("pp2-interleaved-v2", {"pp": 2, "virtual_stages": 2}, "interleaved"),
        Case("pp2-frozen-first", {"pp": 2}, "1f1b", frozen_chunks=(0,)),
        Case("pp2-zb-frozen-last", {"pp": 2}, "zb", frozen_chunks=(1,)),
        Case("dp2", {"dp": 2}, n_microbatches=2),
        Case("dp2-fsdp", {"dp": 2, "fsdp": True}, n_microbatches=2),
        Case("tp2", {"tp": 2}, n_microbatches=3),
        Case("dp2-two-chunks-per-rank", {"dp": 2, "virtual_stages": 2}, "zb", n_microbatches=3),
    ],
    4: [
        Case("pp2-dp2-1f1b", {"pp": 2, "dp": 2}),
        Case("pp2-dp2-fsdp-zb", {"pp": 2, "dp": 2, "fsdp": True}, "zb"),
        Case("pp2-tp2-1f1b", {"pp": 2, "tp": 2}),
        Case("pp2-tp2-zb", {"pp": 2, "tp": 2}, "zb"),
        Case("pp4-1f1b", {"pp": 4}, n_microbatches=5),
        Case("pp4-gpipe", {"pp": 4}, "gpipe", n_microbatches=3),
        Case("pp2-dp2-interleaved-v2", {"pp": 2, "dp": 2, "virtual_stages": 2}, "interleaved"),
        Case("dp2-tp2-fsdp", {"dp": 2, "tp": 2, "fsdp": True}, n_microbatches=2),
    ],
}


# -- data and the one-process reference ----------------------------------------------------------
def samples(step: int) -> list[TokenizedSample]:
    """The step's global batch: 16 text samples of 3..24 tokens, a random prompt without loss."""
    rng = random.Random(1000 + step)
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(16):
        n = rng.randint(3, 24)
        ids = torch.randint(4, SPEC.llm.vocab_size, (n,), generator=g)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        labels[: rng.randint(0, n // 2)] = -100
        out.append(TokenizedSample(ids, labels, [("text", n)], sample_id=i))
    return out


def split(batch: list, parts: int, seed: int) -> list[list]:
    """Split into ``parts`` contiguous groups of different sizes (at least one sample each)."""
    cuts = sorted(random.Random(seed).sample(range(1, len(batch)), parts - 1))
    bounds = [0, *cuts, len(batch)]
    return [batch[a:b] for a, b in itertools.pairwise(bounds)]


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return build_llm(SPEC.llm).state_dict()


def frozen_names(case: Case) -> set[str]:
    from harmonia.runtime.parallelize import build_stage_modules

    layout = Layout(**case.layout)
    names: set[str] = set()
    for rank in layout.rank_list():
        chunks = build_stage_modules(SPEC, "llm", layout, rank)
        for c in case.frozen_chunks:
            if c in chunks:
                names |= {n for n, _ in chunks[c].named_parameters()}
    return names


def optimizer(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def reference(frozen: frozenset[str]) -> dict:
    """Losses, gradient norms and final parameters of one process on whole batches."""
    model = build_llm(SPEC.llm)
    model.load_state_dict(initial_state())
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    losses, norms = [], []
    for step in range(STEPS):
        batch = pack_samples(samples(step))
        opt.zero_grad()
        loss = lm_loss(model(batch.input_ids, batch.positions(), batch.mask()), batch.labels, batch.n_targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# -- the distributed side ------------------------------------------------------------------------
def run_case(case: Case, rank: int) -> dict:
    from torch.distributed.tensor import DTensor

    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.runtime.mllm_executor import MLLMExecutor
    from harmonia.runtime.mllm_inputs import build_rank_batch
    from harmonia.runtime.parallelize import build_stage_modules, parallelize_stage
    from harmonia.schedule import StageGraph, build_schedule
    from harmonia.schedule.rank_actions import plan_rank_actions

    layout = Layout(**case.layout)
    meshes = build_module_meshes({"llm": layout})
    me = meshes.coords("llm")
    chunks = build_stage_modules(SPEC, "llm", layout, rank, initial_state())
    for c, module in chunks.items():
        module.requires_grad_(c not in case.frozen_chunks)
        parallelize_stage(module, meshes.module_mesh("llm"))
    executor = MLLMExecutor(meshes, {"llm": chunks}, SPEC.llm.hidden, optimizer=optimizer, max_norm=MAX_NORM)
    flags = tuple(c not in case.frozen_chunks for c in range(layout.n_stages))
    graph = StageGraph.from_layouts({"llm": layout}, {"llm": flags})
    n = case.n_microbatches
    losses, norms = [], []
    for step in range(STEPS):
        parts = split(samples(step), layout.dp * n, seed=step)
        # global microbatch m: every replica's m-th part, replica d's at positions llm_split[m][d]
        micro = [[s for d in range(layout.dp) for s in parts[d * n + m]] for m in range(n)]
        bounds = [list(itertools.accumulate((len(parts[d * n + m]) for d in range(layout.dp)), initial=0))
                  for m in range(n)]
        llm_split = [[list(range(b[d], b[d + 1])) for d in range(layout.dp)] for b in bounds]
        batch = build_rank_batch({"llm": layout}, rank, micro, llm_split, {})
        schedule = build_schedule(graph, n, case.family)
        result = executor.step(schedule, batch)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        assert executor.executed == plan_rank_actions({"llm": layout}, schedule, [rank])[rank], f"rank {rank} order"
    params = {}
    for module in chunks.values():
        for name, p in module.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            params[name] = full.detach().clone()
    keep = me["dp"] == 0 and me["tp"] == 0
    return {"losses": losses, "norms": norms, "params": params if keep else {}}


def worker(rank: int, world: int, cases: list[Case]) -> dict:
    out = {}
    for case in cases:
        start = time.perf_counter()
        with check_timeout(LAYOUT_TIMEOUT_S, f"layout {case.name}"):
            out[case.name] = run_case(case, rank)
        out[case.name]["seconds"] = time.perf_counter() - start
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    """World size -> rank values of `worker` (the spawn runs once per world size, lazily)."""
    cache: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in cache:
            try:
                cache[world] = run_workers(worker, world, (CASES[world],), timeout=900)
            except AssertionError as e:
                cache[world] = e
        if isinstance(cache[world], AssertionError):
            raise cache[world]
        return cache[world]

    return get


_REFERENCES: dict[frozenset, dict] = {}


def _reference(case: Case) -> dict:
    key = frozenset(frozen_names(case))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(key)
    return _REFERENCES[key]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("world, case", [(w, c) for w, cs in CASES.items() for c in cs], ids=lambda v: getattr(v, "name", str(v)))
def test_layout_matches_one_process(results, world: int, case: Case) -> None:
    ranks = results(world)
    got = [r[case.name] for r in ranks]
    ref = _reference(case)
    assert ref["norms"][0] > MAX_NORM, "clipping must bind for the check to cover the global norm"
    for r, g in enumerate(got):
        assert g["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {r} losses"
        assert g["norms"] == pytest.approx(ref["norms"], rel=RTOL), f"rank {r} gradient norms"
    params = {n: t for g in got for n, t in g["params"].items()}
    assert set(params) == set(ref["params"]), "every parameter is held by some rank"
    worst = max((_rel(params[n], ref["params"][n]), n) for n in params)
    assert worst[0] <= RTOL, f"parameter {worst[1]} differs by {worst[0]:.2e} after {STEPS} steps"
    moved = max(_rel(ref["params"][n], initial_state()[n]) for n in params)
    assert moved > 1e-3, "training must change the parameters"


def _planted_failure(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("planted failure on rank 1")
    with check_timeout(30, "barrier"):
        dist.barrier()


def test_failing_rank_reports_its_traceback() -> None:
    start = time.perf_counter()
    with pytest.raises(AssertionError, match="planted failure on rank 1"):
        run_workers(_planted_failure, 2, timeout=60)
    assert time.perf_counter() - start < 30, "the other rank must be stopped, not waited for"
