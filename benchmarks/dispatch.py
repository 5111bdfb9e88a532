"""What a layer costs the host whatever its size: eager dispatch per layer and phase on this CPU.

A transformer block runs about twenty operators per phase; eager PyTorch spends Python, autograd
and dispatcher time on each, whatever the tensors' sizes. On a small model that time is most of a
microbatch, and it decides whether more microbatches (pipelining, zero-bubble splits) can pay. This
script times the tiny preset LLM's forward and backward per layer on one thread at growing token
counts beside the cost model's kernel seconds for the same load (its rooflines, without dispatch):
what the measurement holds beyond the kernels at the smallest loads is the dispatch the CPU device
prices (`harmonia.workload.devices.CPU_DISPATCH_S`, `DeviceSpec.dispatch_s`).

    python benchmarks/dispatch.py
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table
from saved import save_table

from harmonia.model.attention_mask import multimodal_mask
from harmonia.model.batch import TokenLayout
from harmonia.model.llm import build_llm
from harmonia.model.presets import mllm_preset
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import CPU_DISPATCH_S, device_preset
from harmonia.workload.work import ModuleLoad

TOKENS = (4, 16, 64, 256)
REPEATS = 30


def measure(model: torch.nn.Module, tokens: int) -> tuple[float, float]:
    """Median seconds of one forward and one backward of ``tokens`` text tokens."""
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    layout = TokenLayout.from_segments([[("text", tokens)]])
    position, mask = layout.position[None], multimodal_mask(layout)
    forward, backward = [], []
    for i in range(REPEATS + 5):
        t0 = time.perf_counter()
        y = model(ids, position, mask).sum()
        t1 = time.perf_counter()
        y.backward()
        t2 = time.perf_counter()
        if i >= 5:  # warm-up
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    return statistics.median(forward), statistics.median(backward)


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = mllm_preset("tiny-vlm")
    model = build_llm(spec.llm)
    cost = CostModel(spec, dataclasses.replace(device_preset("cpu"), dispatch_s=0.0))
    layers = len(cost.layers["llm"])
    console = Console(record=True, width=140)
    table = Table(title=f"tiny-llm ({layers} layers: embedding, {spec.llm.body.n_layers} blocks, norm + head), "
                        "one thread, fp32, ms per layer (median of {REPEATS})".replace("{REPEATS}", str(REPEATS)))
    for col in ("tokens", "F measured", "F kernels priced", "B+W measured", "B+W kernels priced",
                "beyond kernels (F, B+W)"):
        table.add_column(col, justify="right")
    beyond = []
    for tokens in TOKENS:
        f, b = measure(model, tokens)
        priced = cost.stage_times("llm", ModuleLoad(tokens, tokens * (tokens + 1) // 2, 1))
        extra = ((f - priced.F) / layers, (b - priced.B - priced.W) / layers)
        beyond.append(extra)
        table.add_row(str(tokens), f"{1e3 * f / layers:.3f}", f"{1e3 * priced.F / layers:.4f}",
                      f"{1e3 * b / layers:.3f}", f"{1e3 * (priced.B + priced.W) / layers:.4f}",
                      f"{1e3 * extra[0]:.3f}, {1e3 * extra[1]:.3f}")
    console.print(table)
    smallest = beyond[0]
    console.print(f"dispatch per layer and phase at {TOKENS[0]} tokens: F {1e3 * smallest[0]:.3f} ms, "
                  f"B+W {1e3 * smallest[1]:.3f} ms (the backward runs B and W of each layer: two phases); "
                  f"the CPU device prices {1e3 * CPU_DISPATCH_S:.3f} ms per layer and phase", highlight=False)
    save_table(console, "dispatch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
