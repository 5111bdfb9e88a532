"""`make gpu-check`'s script in its CPU mode (``--tiny``), so it runs the day a GPU is lent: every
kernel that runs here matches the dense reference, the training-step table is printed, and a
`harmonia train` run goes through the whole runtime."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_on_cpu_in_its_tiny_mode() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    results = sorted((ROOT / "benchmarks" / "results").iterdir())
    run = subprocess.run([sys.executable, "gpu_check.py", "--tiny"], cwd=ROOT / "benchmarks", env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert out.count(" ok ") + out.count("│ ok") >= 3 and "FAIL" not in out  # segments, on every mask
    assert "not run: attention backend 'varlen' runs on CUDA only" in out
    for row in ("harmonia (packed, attention auto)", "transformers (padded, sdpa)", "cost model's prediction"):
        assert row in out
    run_row = next(line for line in out.splitlines() if "tiny-vlm (attention auto, compile auto)" in line)
    assert run_row.split("│")[2].strip() == "0" and run_row.split("│")[3].strip() == "6"  # exit 0, six steps
    assert sorted((ROOT / "benchmarks" / "results").iterdir()) == results  # a table is saved from a GPU run only


def test_the_gpu_runs_are_jobs_the_config_takes() -> None:
    """The runs part 3 starts on a GPU (not run here) parse as `harmonia train` reads them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import runtime_runs

    from harmonia.config import load_config

    runs = runtime_runs(False, "h200")
    assert [name.split(" ")[0] for name, _, _ in runs] == ["tiny-vlm", "tiny-vlm", "llava-siglip-8b,"]
    for _, flags, allowed in runs:
        config = load_config(None, [*flags, "--data.path=/nonexistent/data", "--log.dir=/nonexistent/log"])
        assert config.parallel.world_size == 1 and allowed >= 60
    assert load_config(None, runs[-1][1]).model.lora == ["llm"]
