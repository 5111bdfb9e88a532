"""Executor benchmark: harmonia's executor against torch.distributed.pipelining, and balanced
against sequential microbatches on a real trace, measured side by side in one run.

Part 1 (identical static-shape work). A decoder LLM split into ``pp`` stages on ``pp`` CPU
processes (gloo), ``n`` microbatches of identical shape, 1F1B. The same stage modules run under
harmonia's `MLLMExecutor` (the one executor of every graph; here an LLM without encoders: forward
and backward of one iteration, the loss normaliser given) and under torch's `Schedule1F1B` with
`PipelineStage`s. Steps alternate between the two so drift of
the machine hits both alike; the table shows the median step time and the ratio (target <= 1.05).

Part 2 (variable-size microbatches from ai2d). Global batches of real sample lengths (the trace's
LLM tokens, scaled down for a CPU) as text sequences; harmonia's balanced assignment (DP replicas
then microbatches, by the cost model's per-sample work) against sequential fixed-size microbatches
(consecutive samples, equal counts), both under harmonia's `MLLMExecutor` and 1F1B, on two processes
(dp2 and pp2: one process per core of the benchmark machine, so a rank that finishes early
does not lend its core to a slower one). Beside the measured step-time ratio, the
simulator's prediction of both: each schedule replayed with per-stage, per-microbatch costs from
the cost model (scaled by one factor fitted to all measured steps, so the ratio is the model's).

Run: ``python benchmarks/executor.py [--quick]``; the table goes to stdout and to
``benchmarks/results/executor-<date>.txt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from harmonia.launch import launch
from harmonia.model.batch import PackedBatch, TokenizedSample, pack_samples
from harmonia.model.llm import build_llm, lm_loss
from harmonia.model.spec import LLMSpec, MLLMSpec, TransformerSpec
from harmonia.schedule.layout import Layout
from harmonia.runtime.mllm_inputs import RankBatch

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "ai2d.csv"
SPEC = LLMSpec("bench-llm", TransformerSpec(8, 256, 8, 768, n_kv_heads=4, mlp="swiglu", norm="rmsnorm",
                                            qkv_bias=False, out_bias=False, mlp_bias=False), vocab_size=1024)


def text_sample(n: int, rng: np.random.Generator, sample_id: int) -> TokenizedSample:
    ids = torch.from_numpy(rng.integers(4, SPEC.vocab_size, n)).long()
    labels = torch.roll(ids, -1)
    labels[-1] = -100
    return TokenizedSample(ids, labels, [("text", n)], sample_id=sample_id)


def build_chunk(pp: int, rank: int) -> torch.nn.Module:
    from harmonia.runtime.parallelize import stage_layers

    torch.manual_seed(0)
    a, b = stage_layers(Layout(pp=pp), SPEC.body.n_layers)[rank]
    return build_llm(SPEC, (a, b))


# -- part 1: harmonia vs torch.distributed.pipelining on static shapes -----------------------------
class FixedMask(torch.nn.Module):
    """A stage with the (shared) positions and mask of static-shape microbatches bound in."""

    def __init__(self, chunk: torch.nn.Module, positions: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.chunk, self.positions, self.mask = chunk, positions, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x, self.positions, self.mask)


def harmonia_executor(layout: Layout, stage: int, chunk: torch.nn.Module, n: int):
    """The executor of an LLM-only graph on this rank (holding ``chunk`` as stage ``stage``) and its
    1F1B schedule of ``n`` microbatches."""
    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.runtime.mllm_executor import MLLMExecutor
    from harmonia.schedule import StageGraph, build_schedule

    meshes = build_module_meshes({"llm": layout})
    executor = MLLMExecutor(meshes, {"llm": {stage: chunk}}, SPEC.body.hidden)
    graph = StageGraph.from_layouts({"llm": layout}, {"llm": True})
    return executor, build_schedule(graph, n, "1f1b")


def static_worker(pp: int, n: int, seq: int, steps: int, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rng = np.random.default_rng(0)
    mbs = [pack_samples([text_sample(seq, rng, m)]) for m in range(n)]
    normalizer = float(sum(mb.n_targets for mb in mbs))

    ours = build_chunk(pp, rank)
    executor, schedule = harmonia_executor(Layout(pp=pp), rank, ours, n)
    batch = RankBatch(llm=mbs, n_targets=normalizer)

    theirs_chunk = build_chunk(pp, rank)
    stage = PipelineStage(FixedMask(theirs_chunk, mbs[0].positions(), mbs[0].mask()), rank, pp,
                          torch.device("cpu"))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, labels, normalizer)

    torch_schedule = Schedule1F1B(stage, n, loss_fn=loss_fn, scale_grads=False)
    ids = torch.cat([mb.input_ids for mb in mbs])  # (n, T): torch splits dim 0 into microbatches
    labels = torch.cat([mb.labels for mb in mbs])

    def run_ours() -> None:
        executor.forward_backward(schedule, batch)
        for p in ours.parameters():
            p.grad = None

    def run_theirs() -> None:
        if rank == 0:
            torch_schedule.step(ids)
        elif rank == pp - 1:
            torch_schedule.step(target=labels)
        else:
            torch_schedule.step()
        for p in theirs_chunk.parameters():
            p.grad = None

    times: dict[str, list[float]] = {"harmonia": [], "torch": []}
    for step in range(steps + 2):
        for name, fn in (("harmonia", run_ours), ("torch", run_theirs))[:: 1 if step % 2 else -1]:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if step >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


# -- part 2: balanced vs sequential microbatches on ai2d lengths -----------------------------------
def ai2d_batches(n_batches: int, global_batch: int, scale: int) -> list[list[int]]:
    """Global batches of sample lengths (LLM tokens of ai2d samples, divided by ``scale``)."""
    from harmonia.workload.traces import read_trace
    from harmonia.workload.work import llm_tokens

    spec = bench_mllm()
    shapes = read_trace(TRACE)
    rng = np.random.default_rng(0)
    picks = rng.choice(len(shapes), size=(n_batches, global_batch), replace=False)
    return [[max(8, llm_tokens(shapes[i], spec) // scale) for i in row] for row in picks]


def bench_mllm() -> MLLMSpec:
    from harmonia.model.presets import encoder_preset, projector_for

    vision = encoder_preset("tiny-vit")  # unused: the benchmark's samples are text of real lengths
    return MLLMSpec("bench", {"vision": vision}, {"vision_proj": projector_for("vision_proj", vision, SPEC)}, SPEC, {})


def text_costs(lengths: list[int]) -> tuple[np.ndarray, "CostModel"]:  # noqa: F821
    """Per-sample LLM work (F+B+W seconds) under the cost model of the CPU device."""
    from harmonia.workload.cost import CostModel
    from harmonia.workload.devices import device_preset
    from harmonia.workload.work import ModuleLoad

    cost = CostModel(bench_mllm(), device_preset("cpu"))
    work = [cost.module_times("llm", ModuleLoad(n, n * (n + 1) // 2)).total for n in lengths]
    return np.asarray(work)[:, None], cost


def assignments(lengths: list[int], dp: int, n: int) -> dict[str, list[list[list[int]]]]:
    """Per DP replica, its microbatches (sample indices): harmonia's balance (DP replicas, then
    microbatches in pipeline order, on the cost model's work) and the sequential split (consecutive
    samples, equal counts per replica and per microbatch)."""
    from harmonia.schedule.dp_balance import balance_dp

    work, _ = text_costs(lengths)
    balanced = balance_dp(work, dp, tokens=np.asarray(lengths, dtype=float), n_microbatches=n).microbatches
    size = len(lengths) // (dp * n)
    sequential = [[list(range((r * n + k) * size, (r * n + k + 1) * size)) for k in range(n)] for r in range(dp)]
    return {"balanced": balanced, "sequential": sequential}


def predicted_s(lengths: list[int], replicas: list[list[list[int]]], pp: int) -> float:
    """The slowest replica's 1F1B makespan, per-stage and per-microbatch costs from the cost model."""
    from harmonia.runtime.parallelize import stage_layers
    from harmonia.schedule import CostTable, StageGraph, build_schedule
    from harmonia.schedule.replay import makespan
    from harmonia.workload.work import ModuleLoad

    _, cost = text_costs(lengths)
    layers = stage_layers(Layout(pp=pp), SPEC.body.n_layers)
    graph = StageGraph.from_layouts({"llm": Layout(pp=pp)}, {"llm": (True,) * pp}, replica=0)
    spans = []
    for microbatches in replicas:
        per_mb = []
        for mb in microbatches:
            load = ModuleLoad(sum(lengths[i] for i in mb), sum(lengths[i] * (lengths[i] + 1) // 2 for i in mb))
            times = [cost.stage_times("llm", load, a, b) for a, b in layers]
            per_mb.append({("llm", s): (t.F, t.B, t.W) for s, t in enumerate(times)})
        table = CostTable.from_microbatches(per_mb)
        spans.append(makespan(build_schedule(graph, len(microbatches), "1f1b", costs=table), table))
    return max(spans)


def variable_worker(dp: int, pp: int, n: int, batches: list[list[int]], out: str) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layout = Layout(pp=pp, dp=dp)
    stage, replica = layout.coords(rank)["pp"], layout.coords(rank)["dp"]
    chunk = build_chunk(pp, stage)
    executor, schedule = harmonia_executor(layout, stage, chunk, n)
    times: dict[str, list[float]] = {"balanced": [], "sequential": []}
    for b, lengths in enumerate([batches[0], *batches]):  # the first batch once more as warm-up
        rng = np.random.default_rng(b)
        samples = [text_sample(k, rng, i) for i, k in enumerate(lengths)]
        normalizer = float(sum(int((s.labels != -100).sum()) for s in samples))
        for name, replicas in sorted(assignments(lengths, dp, n).items(), reverse=b % 2 == 1):
            mbs: list[PackedBatch] = [pack_samples([samples[i] for i in g]) for g in replicas[replica]]
            dist.barrier()
            t0 = time.perf_counter()
            executor.forward_backward(schedule, RankBatch(llm=mbs, n_targets=normalizer))
            dist.barrier()
            for p in chunk.parameters():
                p.grad = None
            if b > 0:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


# -- the run -------------------------------------------------------------------------------------
def run(worker, world: int, *args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        launch(worker, world, (*args, out), timeout=900)
        return json.loads(Path(out).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and batches (a smoke run)")
    args = parser.parse_args()
    steps, n_batches = (4, 2) if args.quick else (20, 12)
    lines = [f"harmonia executor benchmark, {datetime.date.today()}, {os.cpu_count()} CPU cores, "
             f"torch {torch.__version__}, LLM {SPEC.body.n_layers} layers x {SPEC.body.hidden} wide, gloo"]
    lines += ["", "1. identical static-shape work, 1F1B, forward+backward of one iteration (median of "
              f"{steps} steps)", f"{'processes':>9} {'microbatches':>12} {'tokens/mb':>9} {'harmonia s':>10} "
              f"{'torch s':>8} {'ratio':>6}"]
    for pp, n, seq in ((2, 8, 256), (4, 8, 256)):
        t = run(static_worker, pp, pp, n, seq, steps)
        ours, theirs = statistics.median(t["harmonia"]), statistics.median(t["torch"])
        lines.append(f"{pp:>9} {n:>12} {seq:>9} {ours:>10.3f} {theirs:>8.3f} {ours / theirs:>6.3f}")
        print(lines[-1], flush=True)

    n, gb, scale = 4, 32, 4
    batches = ai2d_batches(n_batches, gb, scale)
    lines += ["", f"2. ai2d sample lengths (LLM tokens / {scale}), global batch {gb}, {n} microbatches per replica, "
              f"1F1B, mean of {n_batches} batches", f"{'layout':>11} {'assignment':>11} {'measured s':>10} "
              f"{'predicted s':>11} {'vs balanced (measured)':>22} {'(predicted)':>11}"]
    for dp, pp in ((2, 1), (1, 2)):  # one process per core: a finished rank frees no core for another
        t = run(variable_worker, dp * pp, dp, pp, n, batches)
        measured = {k: float(np.mean(v)) for k, v in t.items()}
        raw = {k: float(np.mean([predicted_s(b, assignments(b, dp, n)[k], pp) for b in batches])) for k in t}
        scale_fit = sum(measured.values()) / sum(raw.values())
        for k in ("balanced", "sequential"):
            lines.append(f"{f'dp{dp} pp{pp}':>11} {k:>11} {measured[k]:>10.3f} {raw[k] * scale_fit:>11.3f} "
                         f"{measured[k] / measured['balanced']:>22.3f} {raw[k] / raw['balanced']:>11.3f}")
            print(lines[-1], flush=True)
    lines += ["", "predicted: the simulator's replay of the same schedules with cost-model durations (the slowest "
              "replica's makespan), scaled by one factor per layout fitted to its measured steps"]
    text = "\n".join(lines)
    print(text)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        (results / f"executor-{datetime.date.today()}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
