"""A training step's peak memory per rank, measured beside what the planner predicts, for each layout kind.

Each row trains the tiny vision-language preset (``tiny-vlm``: a ViT, a projector and a Llama-style
LLM) for 3 steps under one given plan on 2 or 4 gloo CPU processes with ``log.memory`` on: every
rank counts its tensor bytes through the step (`harmonia.runtime.memory_count.TensorBytes`: what
it holds between steps plus what operators create, less what is freed) and the planner's prediction
for the same rank and batch (`harmonia.train.iteration.PreparedIteration.predicted_peak`: states
plus the activations its action list holds at once). Shown per layout: the last step's largest
measured and predicted rank, their ratio, and the states part of the prediction.

    python benchmarks/step_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from saved import save_table

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # name -> (world, layouts text)
    "dp2": (2, "vision dp2; llm dp2"),
    "fsdp2": (2, "vision dp2 fsdp; llm dp2 fsdp"),
    "fsdp2 reshard": (2, "vision dp2 fsdp; llm dp2 fsdp reshard"),
    "tp2": (2, "vision tp2; llm tp2"),
    "pp2": (2, "vision dp2; llm pp2"),
    "cp2": (2, "vision dp2; llm cp2"),
    "disjoint encoder": (2, "vision dp1; llm dp1"),
    "tp2 fsdp2 (4 ranks)": (4, "vision dp4; llm tp2 dp2 fsdp"),
}


def plan_file(directory: Path, world: int, text: str) -> Path:
    from harmonia.model.presets import mllm_preset
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts

    plan = plan_from_layouts(mllm_preset("tiny-vlm"), "tiny-vlm", parse_layouts(text), world, 16, microbatch_size=2)
    path = directory / "plan.json"
    plan.save(path)
    return path


def run(directory: Path, world: int, text: str) -> dict:
    plan = plan_file(directory, world, text)
    cmd = [sys.executable, "-m", "harmonia", "train", "--model.preset=tiny-vlm", f"--parallel.world_size={world}",
           f"--parallel.plan={plan}", f"--data.path={directory / 'data'}", "--data.synthesize=64", "--data.heldout=0",
           "--train.steps=3", "--train.global_batch=16", "--log.memory=true", "--log.tensorboard=false",
           f"--log.dir={directory / 'run'}", f"--checkpoint.dir={directory / 'ck'}", "--checkpoint.every=0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{text}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (directory / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "memory_peak_bytes" in r][-1]


def main() -> int:
    console = Console(record=True, width=150)
    table = Table(title="one training step's peak tensor memory per rank (tiny-vlm, CPU, fp32, global batch 16, "
                        "2 samples per microbatch): measured vs the planner's prediction, KiB")
    for col in ("layout", "world", "measured (largest rank)", "predicted (that rank)", "measured / predicted",
                "range over ranks"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for name, (world, text) in LAYOUTS.items():
        with tempfile.TemporaryDirectory(prefix="harmonia-step-memory-") as tmp:
            row = run(Path(tmp), world, text)
        measured, predicted = row["memory_peak_bytes"], row["memory_predicted_bytes"]
        ratios = [m / p for m, p in zip(measured, predicted)]
        top = max(range(world), key=lambda r: measured[r])
        table.add_row(f"{name}: {text}", str(world), f"{measured[top] / 1024:.0f}", f"{predicted[top] / 1024:.0f}",
                      f"{ratios[top]:.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}")
        console.print(f"{name}: measured {[m // 1024 for m in measured]} KiB, predicted "
                      f"{[int(p) // 1024 for p in predicted]} KiB", highlight=False)
    console.print(table)
    save_table(console, "step-memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
