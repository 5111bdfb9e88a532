"""A job of one process runs in the command's own process: no rank process is started, and what a user
sees when it fails or is stopped is what the launcher says of a spawned rank (the exit code, the one
line, the checkpoint left behind)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from harmonia.config import load_config
from harmonia.train.job import prepare_data
from tests.e2e.test_faults import _args as faults_args
from tests.e2e.test_faults import _finish, _ranks_of, _start

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _args(tmp: Path, run: str, *extra: str) -> list[str]:
    return faults_args(tmp, run, "--parallel.world_size=1", "--parallel.cluster=cpu:1x1", "--train.steps=4", *extra)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("one")
    prepare_data(load_config(None, _args(tmp, "prep")))
    return tmp


def test_a_one_process_job_trains_in_the_commands_process(tmp) -> None:
    proc = _start(_args(tmp, "plain"))
    spawned = set()
    while proc.poll() is None:  # no spawned interpreter at any time
        spawned.update(_ranks_of(proc.pid))
        time.sleep(0.2)
    code, out = _finish(proc)
    assert code == 0, out[-3000:]
    assert not spawned, spawned
    assert "training in this process: one rank (gloo backend)" in out and "starting 1 processes" not in out
    summary = json.loads((tmp / "plain" / "summary.json").read_text())
    assert len(summary["losses"]) == 4 and summary["startup"]["process start"] < 0.5
    code, out = _finish(_start(_args(tmp, "plain", f"--checkpoint.dir={tmp / 'other-ck'}", "--train.steps=1")))
    assert code == 0, out[-3000:]  # a fresh run into the same log.dir says whose records it replaces
    assert "holds 4 records of steps 0-3 an earlier run wrote" in " ".join(out.split())


def test_a_failing_rank_is_named_and_its_last_checkpoint_stays(tmp) -> None:
    code, out = _finish(_start(_args(tmp, "raise", "--checkpoint.every=2"), fault="raise:0:3"))
    assert code == 1, out[-3000:]
    assert "error: rank 0 failed: RuntimeError: injected fault on rank 0 at step 3" in out
    assert sorted(p.name for p in (tmp / "raise" / "ck").glob("step-*")) == ["step-2"]


def test_a_stop_signal_stops_at_a_step_boundary_and_saves(tmp) -> None:
    code, out = _finish(_start(_args(tmp, "term"), fault="term:0:2"))
    assert code == 128 + signal.SIGTERM, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("error") or "stopped" in line]
    assert any("SIGTERM" in line for line in lines), out[-3000:]
    assert sorted(p.name for p in (tmp / "term" / "ck").glob("step-*")) == ["step-2"]
    code, out = _finish(_start(_args(tmp, "term", "--train.global_batch=4")))  # resumed with half the batch
    assert code == 0, out[-3000:]
    assert "the data continues at sample 16 of the stream, where step-2 stopped (global batch 4 now" in out
    assert json.loads((tmp / "term" / "ck" / "step-4" / "trainer.json").read_text())["data_position"] == 16 + 2 * 4


def test_the_time_limit_stops_the_job_with_its_own_exit_code(tmp) -> None:
    code, out = _finish(_start(_args(tmp, "late", "--train.steps=100000", "--parallel.timeout_s=20")))
    assert code == 124, out[-3000:]
    assert "the job ran past its time limit (parallel.timeout_s=20)" in out
