"""How per-batch module-cost ratios concentrate as the global batch grows (batch-level profiling).

For each trace and global batch size, draw 64 global batches and report, per module, the
coefficient of variation (CV) across batches of the module's share of the batch's work. The CV of
single samples (batch 1) shows why per-sample profiling misleads; the CV at realistic batch sizes
shows why one static layout suffices. Model: InternViT-300M + Whisper-large-v3 encoder +
Llama-3-8B (omni-8b), encoders frozen, on H100.

    python benchmarks/profile_cv.py
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from harmonia.model.presets import mllm_preset
from harmonia.plan.profiling import profile_batches
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset
from harmonia.workload.traces import read_trace, synthesize_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
BATCHES = (1, 16, 64, 256, 1024, 4096)


def main() -> int:
    console = Console(record=True, width=140)
    cost = CostModel(mllm_preset("omni-8b", training={"vision": "frozen", "audio": "frozen"}),
                     device_preset("h100"))
    traces = {
        "ai2d": read_trace(TRACES / "ai2d.csv"),
        "chartqa": read_trace(TRACES / "chartqa.csv"),
        "mixed (synthetic)": synthesize_trace(16384, seed=0),
    }
    table = Table(title="CV across 64 global batches of each module's share of the batch's work")
    table.add_column("trace")
    table.add_column("global batch", justify="right")
    shown = ["vision", "audio", "llm"]
    for module in shown:
        table.add_column(f"CV {module}", justify="right")
    for name, samples in traces.items():
        for b in BATCHES:
            prof = profile_batches(samples, cost, b, n_batches=64, seed=0)
            cv = dict(zip(prof.modules, prof.ratio_cv()))
            table.add_row(name, str(b), *(f"{cv[m]:.4f}" for m in shown))
        table.add_section()
    console.print(table)
    out = ROOT / "benchmarks" / "results" / f"profile_cv-{datetime.date.today()}.txt"
    out.write_text(console.export_text())
    console.print(f"saved {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
