"""What a layer costs the host whatever its size: eager dispatch per layer and phase on this CPU.

A transformer block runs about twenty operators per phase; eager PyTorch spends Python, autograd
and dispatcher time on each, whatever the tensors' sizes. On a small model that time is most of a
microbatch, and it decides whether more microbatches (pipelining, zero-bubble splits) can pay. This
script times the tiny preset LLM's forward and backward per layer on one thread at growing token
counts beside the cost model's kernel seconds for the same load (its rooflines, without dispatch):
what the measurement holds beyond the kernels at the smallest loads is the dispatch the CPU device
prices (`harmonia.workload.devices.CPU_DISPATCH_S`, `DeviceSpec.dispatch_s`).

A second table times the backward of the LLM's last pipeline stage split into B and W as zero-bubble
runs it (torch.distributed.pipelining's ``stage_backward_input`` then ``stage_backward_weight``, as
`harmonia.runtime.mllm_executor` calls them) against the same stage's fused backward: what B and W
take beyond half the fused backward each is what the CPU device prices a split backward
(`harmonia.workload.devices.CPU_SPLIT_BACKWARD_S`, `DeviceSpec.split_backward_s`).

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
from harmonia.workload.devices import CPU_DISPATCH_S, CPU_SPLIT_BACKWARD_S, device_preset
from harmonia.workload.work import ModuleLoad

TOKENS = (4, 16, 64, 256)
REPEATS = 30


def text_inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``(1, T)`` and the dense mask of one text sample of ``tokens`` tokens."""
    layout = TokenLayout.from_segments([[("text", tokens)]])
    return layout.position[None], multimodal_mask(layout)


def measure(model: torch.nn.Module, tokens: int) -> tuple[float, float]:
    """Median seconds of one forward and one backward of ``tokens`` text tokens."""
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    position, mask = text_inputs(tokens)
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


def measure_split(stage: torch.nn.Module, hidden: int, tokens: int) -> tuple[float, float, float]:
    """Median seconds of the stage's fused backward, and of its B and W split, from one input."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    position, mask = text_inputs(tokens)
    x0 = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(0))
    weights = list(stage.parameters())
    fused, b, w = [], [], []
    for i in range(REPEATS + 5):
        x = x0.clone().requires_grad_()
        y = stage(x, position, mask).sum()
        t0 = time.perf_counter()
        torch.autograd.backward(y, inputs=[x, *weights])
        t1 = time.perf_counter()
        x = x0.clone().requires_grad_()
        y = stage(x, position, mask).sum()
        t2 = time.perf_counter()
        _, groups = stage_backward_input([y], None, [x], weights)
        t3 = time.perf_counter()
        stage_backward_weight(weights, groups)
        t4 = time.perf_counter()
        if i >= 5:  # warm-up
            fused.append(t1 - t0)
            b.append(t3 - t2)
            w.append(t4 - t3)
    return statistics.median(fused), statistics.median(b), statistics.median(w)


def split_table(console: Console, spec) -> None:
    """The last stage's backward (blocks 1.. and the head) fused and split, ms per layer."""
    n_blocks = spec.llm.body.n_layers
    stage = build_llm(spec.llm, layers=(1, n_blocks))
    layers = n_blocks  # blocks 1 .. n-1 and the head
    table = Table(title=f"the last stage of tiny-llm ({layers} layers: {n_blocks - 1} blocks, norm + head), its "
                        f"backward fused and split into B and W, one thread, fp32, ms per layer (median of {REPEATS})")
    for col in ("tokens", "fused B+W", "split B", "split W", "B beyond half the fused", "W beyond half the fused"):
        table.add_column(col, justify="right")
    extras = []
    for tokens in TOKENS[:3]:
        fused, b, w = (t / layers for t in measure_split(stage, spec.llm.body.hidden, tokens))
        extras.append((b - fused / 2, w - fused / 2))
        table.add_row(str(tokens), f"{1e3 * fused:.3f}", f"{1e3 * b:.3f}", f"{1e3 * w:.3f}",
                      f"{1e3 * extras[-1][0]:.3f}", f"{1e3 * extras[-1][1]:.3f}")
    console.print(table)
    mean = [statistics.mean(e[i] for e in extras) for i in (0, 1)]
    console.print(f"a split backward adds per layer, mean over {TOKENS[0]}-{TOKENS[2]} tokens: "
                  f"B {1e3 * mean[0]:.3f} ms, W {1e3 * mean[1]:.3f} ms; the CPU device prices B {1e3 * CPU_SPLIT_BACKWARD_S[0]:.3f} ms, "
                  f"W {1e3 * CPU_SPLIT_BACKWARD_S[1]:.3f} ms", highlight=False)


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
    split_table(console, spec)
    save_table(console, "dispatch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
