"""Packed attention on CPU: the per-segment kernel against the dense mask, time and memory side by side.

Each row is one packed microbatch of ``T`` tokens holding ``docs`` samples (text, a bidirectional
image item, text), attention forward and backward of one layer (4 query heads, 2 key/value heads,
head dim 16, fp32), each kernel in a fresh process: wall seconds (best of 3) and peak memory over
the process's baseline (a fixed mmap threshold, so peak RSS is what was live at once). Pairs: those
the mask keeps (what the cost model counts) and those the per-segment kernel computes. The dense
kernel (SDPA with the ``(T, T)`` mask, the reference of the tests) runs where its mask and scores
fit this machine (T <= 8192). The last table fits the per-segment time to the computed pairs
(non-negative least squares: one rate per pair and one overhead per kernel call) and shows how far
each row is from the fit.

    python benchmarks/attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from saved import save_table

ROOT = Path(__file__).resolve().parents[1]
DENSE_MAX = 8192

WORKER = """
import json, resource, sys, time, torch
import torch.nn.functional as F
from harmonia.model.attention import PackedAttention
from harmonia.model.attention_mask import TokenLayout, count_pairs, multimodal_mask
T, docs, kernel = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
per = [T // docs + (i < T % docs) for i in range(docs)]
layout = TokenLayout.from_segments([[("text", n // 2), ("item", n // 4), ("text", n - n // 2 - n // 4)] for n in per])
torch.manual_seed(0)
q = torch.randn(1, 4, T, 16, requires_grad=True)
k, v = (torch.randn(1, 2, T, 16, requires_grad=True) for _ in range(2))
packed = PackedAttention(layout)
packed.blocks()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
best = float("inf")
for _ in range(3):
    t = time.perf_counter()
    if kernel == "segments":
        y = packed.attend(q, k, v)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=multimodal_mask(layout)[None, None], enable_gqa=True)
    y.sum().backward()
    best = min(best, time.perf_counter() - t)
    q.grad = k.grad = v.grad = None
peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps({"s": best, "mib": peak, "kept": count_pairs(layout), "computed": packed.computed_pairs(),
                  "calls": len(packed.blocks())}))
"""


def measure(T: int, docs: int, kernel: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", WORKER, str(T), str(docs), kernel], env=env, capture_output=True,
                         text=True, check=True, timeout=1200)
    return json.loads(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2k-8k tokens only (CI's smoke run)")
    args = parser.parse_args()
    console = Console(record=True, width=150)
    sizes = (2048, 4096, 8192) if args.quick else (2048, 4096, 8192, 16384, 32768)
    rows = []
    table = Table(title="one attention layer, forward + backward, CPU fp32 (4 q heads, 2 kv heads, head dim 16)")
    for col in ("tokens", "docs", "kept pairs", "computed pairs", "calls", "segments s", "segments MiB",
                "dense s", "dense MiB", "dense / segments"):
        table.add_column(col, justify="right")
    for T in sizes:
        for docs in (1, 4, 16, 64):
            seg = measure(T, docs, "segments")
            dense = measure(T, docs, "dense") if T <= DENSE_MAX else None
            rows.append((T, docs, seg))
            table.add_row(f"{T:,}", str(docs), f"{seg['kept']:,}", f"{seg['computed']:,}", str(seg["calls"]),
                          f"{seg['s']:.3f}", f"{seg['mib']:.0f}",
                          f"{dense['s']:.3f}" if dense else "-", f"{dense['mib']:.0f}" if dense else
                          f"(mask alone {T * T / 2**20:.0f})", f"{dense['s'] / seg['s']:.1f}x" if dense else "-")
            console.print(f"T={T} docs={docs}: segments {seg['s']:.3f} s", style="dim")
    console.print(table)
    pairs = np.array([r[2]["computed"] for r in rows], dtype=float)
    calls = np.array([r[2]["calls"] for r in rows], dtype=float)
    secs = np.array([r[2]["s"] for r in rows])
    from scipy.optimize import nnls

    (rate, per_call), _ = nnls(np.stack([pairs, calls], 1), secs)  # neither term negative
    fit = Table(title=f"segments time = computed pairs x {rate * 1e9:.3f} ns + calls x {per_call * 1e6:.0f} us")
    for col in ("tokens", "docs", "measured s", "fitted s", "error"):
        fit.add_column(col, justify="right")
    for (T, docs, seg), p, c in zip(rows, pairs, calls):
        fitted = p * rate + c * per_call
        fit.add_row(f"{T:,}", str(docs), f"{seg['s']:.3f}", f"{fitted:.3f}", f"{(fitted - seg['s']) / seg['s']:+.0%}")
    console.print(fit)
    if not args.quick:
        save_table(console, "attention")
    return 0


if __name__ == "__main__":
    sys.exit(main())
