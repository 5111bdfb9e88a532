"""Steps rank 0 does not log (``log.every``) skip what only a logged record needs: the gather of every
rank's module times and memory, and rank 0's simulated step (kept where the cost model is fitted and
where the timeline is drawn); the summary is built from the steps that carry each figure."""

from __future__ import annotations

import io
import math

from rich.console import Console

from harmonia.config import load_config
from harmonia.data.synth import write_synthetic_dataset
from harmonia.train import run_training
from harmonia.train.report import summary_table
from harmonia.train.tiny_llava import write_tiny_llava


def test_only_logged_steps_gather_and_simulate(tmp_path) -> None:
    base = write_tiny_llava(tmp_path / "base")
    write_synthetic_dataset(tmp_path / "data", 24, seed=0, heldout=0, tile=32, fmt="llava")
    config = load_config(None, [
        f"--model.hf={base}", f"--data.path={tmp_path / 'data' / 'train' / 'llava.json'}", "--train.steps=9",
        "--train.global_batch=4", "--train.warmup=1", "--parallel.world_size=1", "--log.every=4",
        "--log.tensorboard=false", f"--log.dir={tmp_path / 'run'}", f"--checkpoint.dir={tmp_path / 'ck'}"])
    result = run_training(config, Console(file=io.StringIO(), width=200))
    records = {r["step"]: r for r in result.records}
    assert sorted(records) == list(range(9))
    logged = {0, 4, 8}  # every 4th and the last
    assert {s for s, r in records.items() if "time" in r and "bubble_frac" in r and "rss_bytes" in r} == logged
    simulated = {s for s, r in records.items() if math.isfinite(r["simulated_step_s"])}
    assert simulated == logged | {1}  # and the step the cost model is fitted on (the timeline's, 4, is logged)
    assert all(math.isfinite(r["loss"]) and r["tokens"] > 0 for r in records.values())
    text = io.StringIO()
    Console(file=text, width=200).print(summary_table(result.records))
    assert "bubble measured" in text.getvalue() and "nan" not in text.getvalue()


def test_the_eval_line_says_what_whole_batches_leave_out() -> None:
    from harmonia.train.report import eval_line

    record = {"step": 2, "loss": 5.233, "samples": 4, "batches": 1, "left_out": 0}
    assert eval_line(record) == "eval after step 2: loss 5.2330 over 4 samples (1 batches)"
    assert eval_line({**record, "left_out": 2}).endswith("(1 batches); 2 left out beyond whole batches")
