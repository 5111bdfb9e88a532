"""Per-iteration data balancing: harmonia against the usual ways to split a global batch.

For each trace (ai2d, chartqa: real InternVL-style tiling; mixed: synthesized image + video +
audio + text), global batch, DP degree and microbatches per replica, one global batch is drawn
and split into ``dp * n_microbatches`` microbatches by

- ``sequential``: dataset order, equal contiguous DP shards and microbatches (Megatron-LM);
- ``random``: a random permutation cut into equal parts;
- ``lpt-tok``: LPT greedy on each sample's LLM tokens;
- ``kk-work``: Karmarkar-Karp (largest differencing) on each sample's total work (verl);
- ``harmonia``: `harmonia.schedule.balance_dp` with ``n_microbatches`` (every module balanced).

The baselines partition into all ``dp * n_microbatches`` microbatches jointly (their best case).
Work per sample and module: `CostModel.sample_costs` (F+B+W seconds) of omni-8b (InternViT-300M
+ Whisper-large-v3 encoder + Llama-3-8B) on H100. Columns:

- ``ratio``: worst over modules of (largest microbatch work / max(total / n, largest sample));
  1.0 is the bound. ``floor`` is the best any split can reach: the same ratio for a tighter lower
  bound (work quantised in whole tiles / audio windows: ``ceil``; the pigeonhole bound).
- ``CV``: the largest over modules of the coefficient of variation of per-microbatch work;
  ``CV gain`` the smallest over modules of (sequential CV / harmonia CV).
- ``ms``: the method's runtime.

Then the runtime targets (one core) and CP token shards (max/mean rank cost) on 8k-token packed
sequences for uniform, zigzag and harmonia splits.

    python benchmarks/balance.py
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # one core, as the targets say

import datetime
import heapq
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from harmonia.model.presets import mllm_preset
from harmonia.schedule import (
    assign_microbatches,
    attention_unit_costs,
    balance_dp,
    plan_cp_shards,
    uniform_shards,
    zigzag_shards,
)
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset
from harmonia.workload.traces import read_trace, synthesize_trace
from harmonia.workload.work import llm_segments, llm_tokens

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
BATCHES, DPS, N_MBS = (256, 1024, 4096), (1, 4, 16), (8, 32)
METHODS = ("sequential", "random", "lpt-tok", "kk-work", "harmonia")


# ---- baselines -------------------------------------------------------------------------------
def lpt(weights: np.ndarray, n: int) -> list[list[int]]:
    """Largest first onto the lightest part (heap)."""
    heap = [(0.0, b) for b in range(n)]
    parts: list[list[int]] = [[] for _ in range(n)]
    for i in np.argsort(-weights, kind="stable"):
        load, b = heapq.heappop(heap)
        parts[b].append(int(i))
        heapq.heappush(heap, (load + float(weights[i]), b))
    return parts


def karmarkar_karp(weights: np.ndarray, n: int) -> list[list[int]]:
    """k-way largest differencing: merge the two partitions of largest spread, pairing the
    heaviest part of one with the lightest of the other, until one partition is left."""
    heap = []
    for i, w in enumerate(weights):
        sums = np.zeros(n)
        sums[-1] = w
        sets = [[] for _ in range(n - 1)] + [[i]]
        heapq.heappush(heap, (-float(w), i, sums, sets))
    tick = len(weights)
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        sums = s1 + s2[::-1]  # both ascending: heaviest of one with lightest of the other
        sets = [a + b for a, b in zip(p1, p2[::-1])]
        order = np.argsort(sums, kind="stable")
        sums, sets = sums[order], [sets[k] for k in order]
        tick += 1
        heapq.heappush(heap, (-(sums[-1] - sums[0]), tick, sums, sets))
    return heap[0][3]


def split(method: str, costs: np.ndarray, tokens: np.ndarray, dp: int, n_mb: int,
          seed: int) -> list[list[int]]:
    n = dp * n_mb
    if method == "sequential":
        return [list(map(int, p)) for shard in np.array_split(np.arange(len(costs)), dp)
                for p in np.array_split(shard, n_mb)]
    if method == "random":
        perm = np.random.default_rng(seed).permutation(len(costs))
        return [list(map(int, p)) for p in np.array_split(perm, n)]
    if method == "lpt-tok":
        return lpt(tokens.astype(float), n)
    if method == "kk-work":
        return karmarkar_karp(costs.sum(axis=1), n)
    assignment = balance_dp(costs, dp, n_microbatches=n_mb, tokens=tokens, seed=seed)
    return [mb for mbs in assignment.microbatches for mb in mbs]


# ---- metrics ---------------------------------------------------------------------------------
def floor_bound(col: np.ndarray, n: int) -> float:
    """A tight lower bound on the largest of ``n`` parts of one module's work."""
    s = np.sort(col)[::-1]
    bound = max(s.sum() / n, s[0])
    # pigeonhole: of the k*n+1 largest samples, some part holds k+1, at least the k+1 smallest of them
    csum = np.concatenate([[0.0], np.cumsum(s)])
    for k in range(1, (len(s) - 1) // n + 1):
        bound = max(bound, csum[k * n + 1] - csum[k * n - k])
    unit = quantum(s)
    if unit is not None:  # work comes in whole units
        bound = max(bound, np.ceil(s.sum() / unit / n - 1e-9) * unit)
    return float(bound)


def quantum(col: np.ndarray) -> float | None:
    """The unit every positive entry is a whole multiple of (tiles, audio windows), if any."""
    positive = col[col > 0]
    if positive.size == 0:
        return None
    q = positive / positive.min()
    return float(positive.min()) if np.allclose(q, np.round(q), rtol=0, atol=1e-6) else None


def cv_floor(col: np.ndarray, n: int) -> float:
    """The smallest CV of ``n`` parts' sums when work comes in whole units: counts differing by one."""
    unit = quantum(col)
    if unit is None:
        return 0.0
    mean = col.sum() / unit / n
    f = mean - np.floor(mean)
    return float(np.sqrt(f * (1 - f)) / mean)


def evaluate(costs: np.ndarray, parts: list[list[int]]) -> tuple[float, np.ndarray, float]:
    """``(worst-module ratio, per-module CV, floor ratio)`` over modules that have work."""
    n = len(parts)
    keep = costs.sum(axis=0) > 0
    c = costs[:, keep]
    loads = np.stack([c[p].sum(axis=0) for p in parts])
    bound = np.maximum(c.sum(axis=0) / n, c.max(axis=0))
    floor = max(floor_bound(c[:, j], n) / bound[j] for j in range(c.shape[1]))
    return float((loads.max(axis=0) / bound).max()), loads.std(axis=0) / loads.mean(axis=0), floor


# ---- sections --------------------------------------------------------------------------------
def balance_table(name: str, costs_all: np.ndarray, tokens_all: np.ndarray, module_names: list[str],
                  console: Console, verdicts: list[str]) -> None:
    table = Table(title=f"{name}: worst-module ratio (1.0 = lower bound), largest per-module CV, runtime")
    for col in ("batch", "dp", "mb", "smp/mb", "floor"):
        table.add_column(col, justify="right")
    for m in METHODS:
        table.add_column(f"{m}\nratio", justify="right")
    table.add_column("seq CV", justify="right")
    table.add_column("harm. CV", justify="right")
    table.add_column("CV gain", justify="right")
    for m in METHODS:
        table.add_column(f"{m}\nms", justify="right")
    for batch in BATCHES:
        idx = np.random.default_rng(batch).choice(len(costs_all), batch, replace=False)
        costs, tokens = costs_all[idx], tokens_all[idx]
        for dp in DPS:
            for n_mb in N_MBS:
                if batch < dp * n_mb:
                    continue
                res = {}
                for m in METHODS:
                    t0 = time.perf_counter()
                    parts = split(m, costs, tokens, dp, n_mb, seed=0)
                    ms = (time.perf_counter() - t0) * 1e3
                    assert sorted(i for p in parts for i in p) == list(range(batch)), m
                    res[m] = (*evaluate(costs, parts), ms)
                ratio = {m: r[0] for m, r in res.items()}
                cv_seq, cv_h = res["sequential"][1], res["harmonia"][1]
                gain = float(np.min(cv_seq / np.maximum(cv_h, 1e-12)))
                spm = batch / (dp * n_mb)
                table.add_row(str(batch), str(dp), str(n_mb), f"{spm:g}", f"{res['harmonia'][2]:.4f}",
                              *[f"{ratio[m]:.4f}" for m in METHODS], f"{cv_seq.max():.4f}",
                              f"{cv_h.max():.4f}", f"{gain:.1f}x", *[f"{res[m][3]:.1f}" for m in METHODS])
                best_base = min(ratio["lpt-tok"], ratio["kk-work"])
                if name == "mixed" and not ratio["harmonia"] < best_base:
                    verdicts.append(f"MISS {name} b={batch} dp={dp} mb={n_mb}: harmonia {ratio['harmonia']:.4f} not "
                                    f"strictly below the best baseline {best_base:.4f}")
                if ratio["harmonia"] > 1.005 * best_base:
                    verdicts.append(f"MISS {name} b={batch} dp={dp} mb={n_mb}: harmonia {ratio['harmonia']:.4f} "
                                    f"> 1.005 x best baseline {best_base:.4f}")
                if name != "chartqa" and spm in (8, 32):
                    target = 1.03 if spm == 8 else 1.01
                    floor = res["harmonia"][2]
                    if ratio["harmonia"] > target:
                        at_floor = ratio["harmonia"] <= floor * 1.001
                        verdicts.append(
                            f"{'FLOOR' if at_floor else 'MISS'} {name} b={batch} dp={dp} mb={n_mb}: ratio "
                            f"{ratio['harmonia']:.4f} > {target} (floor {floor:.4f}"
                            f"{', no split can do better' if at_floor else ''})")
                    keep = costs.sum(axis=0) > 0
                    modules = [m for m, k in zip(module_names, keep) if k]
                    floors = [cv_floor(col, dp * n_mb) for col in costs[:, keep].T]
                    for j, module in enumerate(modules):
                        if cv_seq[j] / max(cv_h[j], 1e-12) >= 10:
                            continue
                        at_floor = cv_h[j] <= 1.05 * floors[j]
                        verdicts.append(
                            f"{'CV-FLOOR' if at_floor else 'CV-MISS'} {name} b={batch} dp={dp} mb={n_mb} {module}: "
                            f"gain {cv_seq[j] / cv_h[j]:.1f}x < 10x; harmonia CV {cv_h[j]:.4f}, sequential "
                            f"{cv_seq[j]:.4f}, whole-unit floor {floors[j]:.4f}"
                            f"{' (no split can do better)' if at_floor else ''}")
    console.print(table)


def timing_table(costs_by_trace: dict[str, np.ndarray], console: Console, verdicts: list[str]) -> None:
    table = Table(title="assign_microbatches runtime on one core (7 runs)")
    for col in ("trace", "samples", "microbatches", "min ms", "median ms", "target ms"):
        table.add_column(col, justify="right")
    for name, costs_all in costs_by_trace.items():
        for n, k, target in ((1024, 32, 20.0), (8192, 256, 300.0)):
            costs = costs_all[np.random.default_rng(n).choice(len(costs_all), n, replace=False)]
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                assign_microbatches(costs, k)
                times.append((time.perf_counter() - t0) * 1e3)
            ms = float(np.median(times))
            table.add_row(name, str(n), str(k), f"{min(times):.1f}", f"{ms:.1f}", f"{target:g}")
            if ms > target:
                verdicts.append(f"MISS time {name} {n}->{k}: {ms:.1f} ms > {target:g} ms")
    console.print(table)


def packs_of(segments: list[list[tuple[str, int]]], length: int = 8192, min_fill: int = 8000) -> list:
    """First-fit-decreasing packing into ``length``-token sequences; keeps the full ones."""
    sizes = np.array([sum(n for _, n in s) for s in segments])
    packs: list[list[int]] = []
    fill: list[int] = []
    for i in np.argsort(-sizes, kind="stable"):
        if sizes[i] > length:
            continue
        for b, f in enumerate(fill):
            if f + sizes[i] <= length:
                packs[b].append(int(i))
                fill[b] += int(sizes[i])
                break
        else:
            packs.append([int(i)])
            fill.append(int(sizes[i]))
    rng = np.random.default_rng(0)
    return [[segments[i] for i in rng.permutation(p)] for p, f in zip(packs, fill) if f >= min_fill]


def cp_table(samples_by_trace: dict, mllm, console: Console, verdicts: list[str]) -> None:
    token_cost, tile_cost = attention_unit_costs(mllm.llm.body, 128)
    table = Table(title="CP shards of 8k-token packed sequences: max/mean rank cost (mean and worst over packs)")
    for col in ("trace", "packs", "cp", "uniform", "zigzag", "harmonia", "harmonia worst", "zigzag worst"):
        table.add_column(col, justify="right")
    for name, samples in samples_by_trace.items():
        packs = packs_of([llm_segments(s, mllm) for s in samples])[:64]
        for cp in (2, 4, 8):
            r = np.array([[f(p, cp, block=128, token_cost=token_cost, tile_cost=tile_cost).imbalance
                           for f in (uniform_shards, zigzag_shards, plan_cp_shards)] for p in packs])
            table.add_row(name, str(len(packs)), str(cp), *[f"{x:.4f}" for x in r.mean(axis=0)],
                          f"{r[:, 2].max():.4f}", f"{r[:, 1].max():.4f}")
            if cp == 4 and r[:, 2].max() > 1.05:
                verdicts.append(f"MISS CP {name} cp=4: worst max/mean {r[:, 2].max():.4f} > 1.05")
    console.print(table)


def main() -> int:
    console = Console(record=True, width=230)
    mllm = mllm_preset("omni-8b")
    cost = CostModel(mllm, device_preset("h100"))
    traces = {
        "ai2d": read_trace(TRACES / "ai2d.csv"),
        "chartqa": read_trace(TRACES / "chartqa.csv"),
        "mixed": synthesize_trace(8192, seed=0),
    }
    costs = {name: cost.sample_costs(s) for name, s in traces.items()}
    tokens = {name: np.array([llm_tokens(x, mllm) for x in s]) for name, s in traces.items()}
    console.print(f"omni-8b on H100, modules {cost.modules}; work = F+B+W seconds from CostModel.sample_costs")
    verdicts: list[str] = []
    for name in traces:
        balance_table(name, costs[name], tokens[name], cost.modules, console, verdicts)
    timing_table(costs, console, verdicts)
    cp_table({"ai2d": traces["ai2d"][:2000], "mixed": traces["mixed"][:3000]}, mllm, console, verdicts)
    misses = [v for v in verdicts if "MISS" in v]
    console.print("\n".join(verdicts))
    console.print(f"{len(misses)} targets missed; {len(verdicts) - len(misses)} below target only where the "
                  "whole-unit floor (tiles, audio windows) makes it impossible for any split")
    out = ROOT / "benchmarks" / "results" / f"balance-{datetime.date.today().isoformat()}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(console.export_text())
    console.print(f"saved {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
