"""`harmonia train` end to end on local CPU processes: a reduced demo, faults, resume.

One small synthesized dataset serves every run. The runs are chained so that each spawn checks
several things: an uninterrupted run is the reference; a run whose rank 1 raises at step 3 must
end every rank with that rank's message and leave the step-2 checkpoint; resuming from it must
reproduce the reference's losses exactly; resuming the same checkpoint under another layout (2
processes instead of 4) must reproduce them up to rounding; a killed rank must end the job too.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from harmonia.cli import DEMO_OVERRIDES, main
from harmonia.config import load_config
from harmonia.launch import LaunchError
from harmonia.train import run_training
from harmonia.train.job import prepare_data
from harmonia.train.loop import FAULT_ENV
from tests.e2e._replay import nccl_replayed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _config(tmp, name: str, *extra: str):
    return load_config(None, [
        f"--data.path={tmp / 'data'}", "--data.synthesize=96", "--data.heldout=16",
        "--train.steps=4", "--train.global_batch=16", "--train.warmup=1", "--checkpoint.every=2",
        "--parallel.llm_pp=2", "--parallel.timeout_s=240", "--log.tensorboard=false",
        f"--log.dir={tmp / name}", f"--checkpoint.dir={tmp / name / 'ck'}", *extra])


def _run(config):
    out = io.StringIO()
    result = run_training(config, Console(file=out, width=200))
    return result, out.getvalue()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    prepare_data(_config(tmp, "prep"))
    return tmp


def test_reduced_demo_faults_and_resume(tmp, monkeypatch) -> None:
    # reference: 4 steps uninterrupted, the demo's 4-process layout search
    with nccl_replayed(tmp / "ref-comms") as replays:  # its messages as NCCL would run them
        ref, printed = _run(_config(tmp, "ref"))
    assert replays[0].p2p_ops > 0
    assert [r["step"] for r in ref.records] == [0, 1, 2, 3] and ref.start_step == 0
    assert ref.losses[-1] < ref.losses[0]
    llm = ref.plan.layouts["llm"]
    assert llm.pp == 2 and any(ref.plan.layouts[e] != llm for e in ref.plan.encoders), "layouts must differ"
    assert "plan:" in printed and "searched" in printed
    for name in ("metrics.jsonl", "summary.json", "plan.json", "calibration.json", "timeline.png", "timeline-measured.json",
                 "timeline-simulated.json"):
        assert (tmp / "ref" / name).is_file(), name
    record = ref.records[-1]
    assert 0.0 <= record["bubble_frac"] < 1.0 and record["tokens_per_s"] > 0
    assert set(record["time"]) == {"llm", *ref.plan.encoders} and record["simulated_step_s"] > 0
    summary = json.loads((tmp / "ref" / "summary.json").read_text())
    assert summary["losses"] == ref.losses and summary["accuracy"]
    # throughput is real work over wall-clock time from the first step's start, steps and all between
    records = ref.records
    assert all(b["elapsed_s"] > a["elapsed_s"] for a, b in zip(records, records[1:]))
    assert records[-1]["elapsed_s"] >= sum(r["step_s"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    assert records[-1]["tokens_per_s"] == pytest.approx(tokens / records[-1]["elapsed_s"])
    assert summary["throughput"]["tokens"] == tokens and summary["throughput"]["steps"] == len(records)
    assert summary["throughput"]["in_steps_s"] == pytest.approx(sum(r["step_s"] for r in records))
    startup = summary["startup"]  # command to first step, phase by phase
    assert list(startup) == ["checks", "preflight", "data", "shape pass and plan", "process start", "process group",
                             "model build and resume", "to the first step"]
    assert all(v >= 0 for v in startup.values()) and startup["process start"] > 0

    # a rank that raises at step 3: every rank ends, the message names it, step 2's checkpoint stays
    monkeypatch.setenv(FAULT_ENV, "raise:1:3")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed: RuntimeError: injected fault on rank 1 at step 3"):
        _run(_config(tmp, "resume"))
    assert time.monotonic() - t0 < 120
    monkeypatch.delenv(FAULT_ENV)
    assert (tmp / "resume" / "ck" / "step-2").is_dir() and not (tmp / "resume" / "ck" / "step-4").exists()
    shutil.copytree(tmp / "resume" / "ck", tmp / "other" / "ck")

    # resuming gives exactly the uninterrupted run's losses
    resumed, _ = _run(_config(tmp, "resume"))
    assert resumed.start_step == 2 and [r["step"] for r in resumed.records] == [2, 3]
    assert resumed.losses == ref.losses

    # resuming the same checkpoint under another layout (2 processes) agrees up to rounding
    other, _ = _run(_config(tmp, "other", "--parallel.world_size=2", "--parallel.cluster=cpu:1x2"))
    assert other.plan.world_size == 2 and other.start_step == 2
    assert other.losses[:2] == ref.losses[:2]
    assert other.losses[2:] == pytest.approx(ref.losses[2:], rel=1e-5)

    # ... and under a plan file with tensor parallelism (LLM tp2 x pp2, audio tp2 x dp2)
    plan = json.loads((tmp / "ref" / "plan.json").read_text())
    plan["layouts"]["llm"].update(tp=2, dp=1, fsdp=False, ranks=None, rank_offset=0)  # all 4 ranks in grid order
    plan["layouts"]["audio"].update(tp=2, dp=2, pp=1, ranks=None, rank_offset=0)
    plan["placement"] = "colocated"
    (tmp / "tp-plan.json").write_text(json.dumps(plan))
    shutil.copytree(tmp / "other" / "ck" / "step-2", tmp / "tp" / "ck" / "step-2")
    tp, _ = _run(_config(tmp, "tp", f"--parallel.plan={tmp / 'tp-plan.json'}"))
    assert tp.plan.layouts["llm"].tp == 2 and tp.start_step == 2
    assert tp.losses[2:] == pytest.approx(ref.losses[2:], rel=1e-5)

    # ... and under a plan file with context parallelism (LLM cp2 x pp2: balanced CP token shards)
    plan["layouts"]["llm"].update(tp=1, cp=2, dp=1, fsdp=False, ranks=None, rank_offset=0)
    (tmp / "cp-plan.json").write_text(json.dumps(plan))
    shutil.copytree(tmp / "other" / "ck" / "step-2", tmp / "cp" / "ck" / "step-2")
    cp, _ = _run(_config(tmp, "cp", f"--parallel.plan={tmp / 'cp-plan.json'}"))
    assert cp.plan.layouts["llm"].cp == 2 and cp.start_step == 2
    assert cp.losses[2:] == pytest.approx(ref.losses[2:], rel=1e-5)

    # a rank killed mid-training ends the job with its signal, no hang
    monkeypatch.setenv(FAULT_ENV, "kill:2:1")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 2 was killed by SIGKILL"):
        _run(_config(tmp, "killed"))
    assert time.monotonic() - t0 < 120


def test_demo_config_file_is_the_embedded_default() -> None:
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
    assert load_config(demo) == load_config(None, DEMO_OVERRIDES)


@pytest.mark.parametrize("argv, field", [
    (["--train.steps=0"], "train.steps"),
    (["--parallel.world_size=3", "--parallel.cluster=cpu:1x4"], "parallel.world_size"),
    (["--model.frozen=eyes"], "model.frozen"),
    (["--train.nonsense=1"], "train.nonsense"),
    (["--parallel.schedule=fast"], "parallel.schedule"),
])
def test_bad_config_fails_before_any_process_starts(argv, field, capsys, monkeypatch) -> None:
    monkeypatch.setattr("harmonia.launch.launch", lambda *a, **k: pytest.fail("spawned despite a bad config"))
    assert main(["train", *argv]) != 0
    captured = capsys.readouterr()
    assert field in captured.out + captured.err


def test_nan_loss_and_torchrun_restart(tmp, monkeypatch) -> None:
    """A NaN loss stops the job naming step and batch; under torchrun with restarts, a failed
    attempt is followed by one that resumes from the last checkpoint and finishes."""
    monkeypatch.setenv(FAULT_ENV, "nan:0:1")
    with pytest.raises(LaunchError, match=r"TrainingError: step 1: loss is nan .*batch samples \[\d+"):
        _run(_config(tmp, "nan"))
    monkeypatch.delenv(FAULT_ENV)

    run_dir = tmp / "torchrun"
    args = [f"--{a}" for a in ("data.path=" + str(tmp / "data"), "data.synthesize=96", "data.heldout=16",
                                "train.steps=4", "train.global_batch=16", "train.warmup=1", "checkpoint.every=2",
                                "parallel.llm_pp=2", "parallel.world_size=2", "parallel.cluster=cpu:1x2",
                                "log.tensorboard=false", f"log.dir={run_dir}", f"checkpoint.dir={run_dir / 'ck'}")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "harmonia", "train", *args]
    proc = subprocess.run(cmd, env={**os.environ, FAULT_ENV: "raise:1:3"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "injected fault on rank 1 at step 3" in proc.stdout + proc.stderr  # the first attempt failed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start_step"] == 2 and len(summary["losses"]) == 4  # the restart resumed at step 2
    assert all(math.isfinite(x) for x in summary["losses"])
    assert (run_dir / "ck" / "step-4").is_dir()

