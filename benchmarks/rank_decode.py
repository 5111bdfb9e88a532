"""Per-rank decoding: what each rank decodes per step, and the shape pass with cached token counts.

A tiny LLaVA checkpoint (224-pixel images, its ChatML template) and a synthetic LLaVA dataset. For
two 8-rank plans it times, over a few steps, decoding the whole global batch (what every rank did
before) against decoding each rank's own samples (`harmonia.train.rank_data.rank_positions`), in
one process and in 2 worker processes; and the shape pass cold (every record rendered with the chat
template) against warm (token counts from the cache under the run directory).

    python benchmarks/rank_decode.py [--records 600] [--batch 64] [--steps 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harmonia.config import load_config
from harmonia.data.decode import SampleDecoder
from harmonia.data.synth import write_synthetic_dataset
from harmonia.schedule.graph import LLM
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.train.data import data_cache_dir, open_split
from harmonia.train.iteration import DataOrder, IterationBuilder
from harmonia.train.planning import model_spec
from harmonia.train.rank import schedule_graph
from harmonia.train.rank_data import rank_positions
from harmonia.train.tiny_llava import write_tiny_llava
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string

ROOT = Path(__file__).resolve().parents[1]


def plans(batch: int) -> dict[str, Plan]:
    return {
        "colocated llm dp4 pp2, vision dp8": Plan("llava", {LLM: Layout(dp=4, pp=2), "vision": Layout(dp=8)},
                                                  "colocated", "1f1b", n_microbatches=4, global_batch=batch),
        "disjoint vision dp4 | llm dp2 pp2": Plan("llava", {"vision": Layout(dp=4),
                                                            LLM: Layout(dp=2, pp=2, rank_offset=4)},
                                                  "disjoint", "1f1b", n_microbatches=4, global_batch=batch),
    }


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def shape_pass(config, spec) -> list[tuple[str, float, int]]:
    """(run, seconds, renders) of a cold and a warm shape pass."""
    rows = []
    for run in ("cold", "warm"):
        ds = open_split(config, "train", spec, cache_dir=data_cache_dir(config))
        render, calls = ds.tokenizer.encode_conversation, [0]
        ds.tokenizer.encode_conversation = lambda *a: calls.__setitem__(0, calls[0] + 1) or render(*a)
        _, seconds = _timed(ds.shapes)
        rows.append((run, seconds, calls[0]))
    return rows


def decode_steps(config, spec, plan: Plan, steps: int, workers: int) -> dict[str, float]:
    """Mean per step: whole-batch decode seconds, the slowest rank's own decode seconds, samples a rank
    decodes (mean and max)."""
    ds = open_split(config, "train", spec, cache_dir=data_cache_dir(config))
    shapes = {s.sample_id: s for s in ds.shapes()}
    cluster = cluster_from_string("cpu:1x8")
    builder = IterationBuilder(spec, plan, ds, DataOrder(list(shapes), plan.global_batch, 0),
                               CostModel(spec, cluster.device), cluster, schedule_graph(spec, plan), 0,
                               search_evaluations=0, shapes=shapes)
    whole = slowest = mean_n = max_n = 0.0
    with SampleDecoder(ds, workers) as decoder:
        for step in range(steps):
            it = builder.build(step)
            batch = [shapes[i] for i in it.sample_ids]
            _, t = _timed(decoder.decode, it.sample_ids)
            whole += t / steps
            per_rank = []
            for rank in range(plan.world_size):
                mine = [it.sample_ids[p] for p in rank_positions(plan.layouts, rank, it.assignment, batch, spec)]
                _, t = _timed(decoder.decode, mine)
                per_rank.append((t, len(mine)))
            slowest += max(t for t, _ in per_rank) / steps
            mean_n += sum(n for _, n in per_rank) / len(per_rank) / steps
            max_n += max(n for _, n in per_rank) / steps
    return {"whole": whole, "slowest": slowest, "mean_n": mean_n, "max_n": max_n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    console = Console(record=True, width=130)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = write_tiny_llava(tmp / "base", image_size=224, patch_size=32)
        write_synthetic_dataset(tmp / "data", a.records, seed=0, heldout=0.1, tile=224, fmt="llava")
        config = load_config(None, [f"--model.hf={base}", f"--data.path={tmp / 'data' / 'train' / 'llava.json'}",
                                    f"--checkpoint.dir={tmp / 'run' / 'ck'}"])
        spec = model_spec(config)
        load = os.getloadavg()[0]
        rows = shape_pass(config, spec)
        t = Table(title=f"shape pass of {a.records - a.records // 10} records with the chat template "
                        f"({os.cpu_count()} CPU cores, load average {load:.1f} at start)")
        for col in ("run", "seconds", "renders", "ms / record"):
            t.add_column(col)
        n = a.records - a.records // 10
        for run, seconds, renders in rows:
            t.add_row(run, f"{seconds:.2f}", str(renders), f"{1e3 * seconds / n:.2f}")
        console.print(t)
        t = Table(title=f"decode per step, global batch {a.batch}, mean of {a.steps} steps")
        for col in ("plan", "workers", "whole batch s", "slowest rank s", "speed-up", "samples / rank (mean, max)"):
            t.add_column(col)
        for name, plan in plans(a.batch).items():
            for workers in (0, 2):
                r = decode_steps(config, spec, plan, a.steps, workers)
                t.add_row(name, str(workers), f"{r['whole']:.3f}", f"{r['slowest']:.3f}",
                          f"{r['whole'] / r['slowest']:.1f}x", f"{r['mean_n']:.1f}, {r['max_n']:.0f} of {a.batch}")
        console.print(t)
    out = ROOT / "benchmarks" / "results" / f"rank-decode-{datetime.date.today()}.txt"
    out.write_text(console.export_text())
    print(f"saved {out.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
