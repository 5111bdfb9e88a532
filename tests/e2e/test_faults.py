"""What a user sees when things fail: the exit code, the one printed line, the files left behind.

Every case of the README's "When things fail" table, on the smallest model (tiny-vlm) and 2 CPU
processes. Jobs that must really run are spawned as `harmonia train` commands (so signals reach a
real launcher) and chained on one checkpoint directory, each run starting from what the last one
left; what preflight refuses runs in this process, because no rank ever starts.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harmonia.cli import main
from harmonia.config import load_config
from harmonia.metrics import read_metrics
from harmonia.runtime.dirlock import DirectoryLock
from harmonia.train.faults import FAULT_ENV
from harmonia.train.job import prepare_data

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def _args(tmp: Path, run: str, *extra: str) -> list[str]:
    return [f"--data.path={tmp / 'data'}", "--data.synthesize=32", "--data.heldout=8", "--model.preset=tiny-vlm",
            "--train.global_batch=8", "--train.warmup=1", "--parallel.world_size=2", "--parallel.cluster=cpu:1x2",
            "--parallel.schedule_search=0", "--log.tensorboard=false", f"--log.dir={tmp / run}",
            f"--checkpoint.dir={tmp / run / 'ck'}", *extra]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("faults")
    prepare_data(load_config(None, _args(tmp, "prep")))
    return tmp


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def _start(args: list[str], fault: str = "", launcher: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", FAULT_ENV: fault}
    return subprocess.Popen([sys.executable, *launcher, "-m", "harmonia", "train", *args], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out


def _train(args: list[str], fault: str = "") -> tuple[int, str]:
    return _finish(_start(args, fault))


def _in_process(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _ranks_of(pid: int) -> list[int]:
    """The launcher's rank processes: the children of its fork server (not multiprocessing's resource
    tracker, nor the fork server itself)."""
    children: dict[int, list[tuple[int, bytes]]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[-1].split()[1])
            command = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append((int(proc.name), command))
    servers = [child for child, command in children.get(pid, []) if b"forkserver" in command]
    return sorted(rank for server in servers for rank, _ in children.get(server, []))


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for_steps(metrics: Path, after: int, proc: subprocess.Popen, timeout: float = 180) -> int:
    """Wait until ``metrics`` has a step past ``after`` (the run trains); returns that step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            step = json.loads(metrics.read_text().splitlines()[-1])["step"]
        except (OSError, IndexError, ValueError):
            step = -1
        if step > after:
            return step
        time.sleep(0.2)
    raise AssertionError(f"no step past {after} in {metrics}: {_finish(proc, 5)[1][-2000:]}")


def _steps(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))


def _all_finite(checkpoint: Path) -> bool:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = checkpoint.parent.parent / f"{checkpoint.name}.flat.pt"
    dcp_to_torch_save(checkpoint, flat)
    state = torch.load(flat, weights_only=True)
    flat.unlink()

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)

    found = [t for t in tensors(state) if t.is_floating_point()]
    return bool(found) and all(bool(torch.isfinite(t).all()) for t in found)


def test_signals_to_the_launcher(tmp) -> None:
    """SIGTERM, Ctrl-C and SIGKILL to `harmonia train`: every rank stops at a step boundary with a
    checkpoint, nothing is left running, and each next run resumes where the last one stopped."""
    run, ck = tmp / "signals", tmp / "signals" / "ck"
    args = _args(tmp, "signals", "--train.steps=40")

    proc = _start(args)
    _wait_for_steps(run / "metrics.jsonl", 1, proc)
    ranks = _ranks_of(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 128 + signal.SIGTERM, out[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM"))
    first = int(line.split(" at step ")[1].split("/")[0])
    assert f"saved checkpoint step-{first} in {ck}; run the same command to resume" in line
    assert len(ranks) == 2 and not any(_alive(p) for p in ranks)
    assert _steps(ck) == [f"step-{first}"] and not (ck / "harmonia.lock").exists()

    # Ctrl-C in a terminal: SIGINT to the launcher and its ranks at once; no traceback
    proc = _start(args)
    _wait_for_steps(run / "metrics.jsonl", first + 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = _finish(proc)
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    second = int(next(x for x in out.splitlines() if x.startswith("stopped by SIGINT")).split(" at step ")[1]
                 .split("/")[0])
    assert second > first and _steps(ck) == sorted([f"step-{first}", f"step-{second}"])
    assert [r["step"] for r in read_metrics(run)] == list(range(second))  # resumed: no step twice

    # SIGKILL: the launcher cannot forward anything, yet its ranks stop (and save) and exit
    proc = _start(args)
    _wait_for_steps(run / "metrics.jsonl", second + 1, proc)
    ranks = _ranks_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    _finish(proc)
    deadline = time.monotonic() + 90
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ranks) == 2 and not any(_alive(p) for p in ranks), "ranks outlived their launcher"
    third = max(int(s.removeprefix("step-")) for s in _steps(ck))
    assert third > second and (ck / "harmonia.lock").exists()  # the dead launcher's lock

    # the stale lock is taken over; a job already at train.steps starts nothing and saves nothing
    before = (ck / f"step-{third}" / "trainer.json").stat().st_mtime_ns
    code, out = _train(_args(tmp, "signals", f"--train.steps={third}"))
    assert code == 0, out[-3000:]
    assert "took over the lock of pid" in out and "nothing to train" in out and "starting" not in out
    assert (ck / f"step-{third}" / "trainer.json").stat().st_mtime_ns == before


def test_faults_inside_a_job_and_what_a_restart_finds(tmp, capsys) -> None:
    """A rank stopped from outside, a crash inside a save, a full log disk, a finished job run
    again, and resumes that must be refused (another model, a planted pickle, resume=false)."""
    run, ck = tmp / "chain", tmp / "chain" / "ck"
    args = _args(tmp, "chain", "--train.steps=4")

    code, out = _train(args, fault="term:1:2")
    assert code == 128 + signal.SIGTERM, out[-3000:]
    assert (f"rank 1 received SIGTERM: every rank stopped at step 2/4; saved checkpoint step-2 in {ck}"
            in out.splitlines()[-1])

    code, out = _train(args, fault="save:0:4")
    assert code == 1, out[-3000:]
    assert "error: rank 0 was killed by SIGKILL" in out
    assert _steps(ck) == ["step-2", "step-4.tmp"] and (ck / "step-2" / "trainer.json").is_file()

    for name in ("timeline.png", "calibration.json"):  # a full log disk
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to("/dev/full")
    code, out = _train(args)
    assert code == 0, out[-3000:]
    assert "removed step-4.tmp left by an interrupted save" in out
    assert f"resumed from step-2 in {ck} (train.steps=4;" in out
    assert re.search(r"^step 3/4  loss \d+\.\d{4}  [\d,]+ tok/s  elapsed \d:\d\d:\d\d  ETA \d:\d\d:\d\d$", out, re.M)
    assert re.search(r"^step 4/4  .*  ETA 0:00:00$", out, re.M)  # stdout is a pipe: one line per step
    for phase in (r"starting \d processes", r"\d processes up [\d.]+ s after the launch", r"model built in [\d.]+ s; "
                  r"training from step 2", r"trained to step 4; checkpoint step-4 in", "held-out evaluation"):
        assert re.search(rf"^\d\d:\d\d:\d\d {phase}", out, re.M), phase  # the phases around the steps, timed
    assert "could not write the timelines" in out and "could not write calibration.json" in out
    assert _steps(ck) == ["step-2", "step-4"] and _all_finite(ck / "step-4")
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["start_step"] == 2

    saved = (ck / "step-4" / "trainer.json").stat().st_mtime_ns
    code, out = _in_process(["train", *args], capsys)
    assert code == 0 and "nothing to train: the checkpoint in" in out
    assert (ck / "step-4" / "trainer.json").stat().st_mtime_ns == saved

    code, out = _in_process(["train", *args, "--model.preset=tiny-omni"], capsys)
    assert code == 2 and "cannot be resumed: model: 'tiny-vlm' in the checkpoint, 'tiny-omni' now" in out

    code, out = _in_process(["train", *args, "--checkpoint.resume=false"], capsys)
    assert code == 2 and "already holds checkpoints [2, 4]" in out

    sentinel = tmp / "pwned"

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {sentinel}",)

    (ck / "step-4" / "rng-1.pt").write_bytes(pickle.dumps(Planted(), protocol=2))
    code, out = _in_process(["train", *args, "--train.steps=6"], capsys)
    assert code == 2 and "rng-1.pt is not an RNG state harmonia wrote (it holds more than tensors" in out
    assert not sentinel.exists()


def test_a_stopped_rank_is_named_within_the_hang_timeout(tmp) -> None:
    proc = _start(_args(tmp, "hang", "--train.steps=6", "--parallel.hang_timeout_s=5"), fault="stop:1:1")
    deadline = time.monotonic() + 120
    ranks: list[int] = []
    while len(ranks) < 2 and time.monotonic() < deadline:
        ranks = _ranks_of(proc.pid)
        time.sleep(0.2)
    code, out = _finish(proc, timeout=180)
    assert code == 1, out[-3000:]
    assert "error: rank 1 stopped responding: no heartbeat for" in out and "(its process is stopped (SIGSTOP?)" in out
    assert not any(_alive(p) for p in ranks)


def test_under_torchrun_each_agent_does_the_same(tmp) -> None:
    """SIGTERM to the torchrun agent stops its ranks at a step boundary with a checkpoint; a stopped
    rank is named by its peers, which end it, so the agent ends the job."""
    run, ck = tmp / "torchrun", tmp / "torchrun" / "ck"
    args = _args(tmp, "torchrun", "--train.steps=40")
    proc = _start(args, launcher=tuple(TORCHRUN))
    _wait_for_steps(run / "metrics.jsonl", 1, proc)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = _finish(proc)
    assert code != 0
    stopped = [x for x in out.splitlines() if x.startswith("stopped by SIGTERM")]
    assert len(stopped) == 1, out  # said once, by rank 0
    step = int(stopped[0].split(" at step ")[1].split("/")[0])
    assert _steps(ck) == [f"step-{step}"]

    t0 = time.monotonic()
    code, out = _finish(_start([*args, "--parallel.hang_timeout_s=5"], fault=f"stop:1:{step + 1}",
                               launcher=tuple(TORCHRUN)))
    assert code != 0 and time.monotonic() - t0 < 120, out[-3000:]
    assert ("error: rank 1 stopped responding: no heartbeat for" in out and
            "(its process is stopped (SIGSTOP?)" in out and "(seen by rank 0)" in out), out[-3000:]


def test_nonfinite_steps_never_reach_the_weights(tmp) -> None:
    """With on_nonfinite=skip a non-finite step is skipped; three in a row stop the job; every
    checkpoint holds finite weights."""
    run, ck = tmp / "nan", tmp / "nan" / "ck"
    args = _args(tmp, "nan", "--train.steps=6", "--checkpoint.every=1", "--train.on_nonfinite=skip")
    code, out = _train(args, fault="nangrad:1:1,nangrad:1:3,nangrad:1:4,nangrad:1:5")
    assert code == 1, out[-3000:]
    assert "step 1: gradient norm is nan" in out and "its update was skipped" in out
    assert ("TrainingError: step 5: gradient norm is nan" in out and "(3 steps in a row); the weights were not "
            "updated, so the newest checkpoint (step-5) holds finite weights" in out)
    skipped = {r["step"]: r["update_skipped"] for r in read_metrics(run)}
    assert skipped == {0: False, 1: True, 2: False, 3: True, 4: True}
    assert _steps(ck) == ["step-3", "step-4", "step-5"] and all(_all_finite(ck / s) for s in _steps(ck))


def test_steps_not_logged_agree_in_their_loss_collective_alike(tmp) -> None:
    """A step that is not logged agrees on the next one in its own loss and norm collective
    (`harmonia.train.next_step`): the same losses, the same skipped non-finite step, as a job that
    logs (and so agrees at) every step; a stop signal is heard at the next agreement."""
    runs = {}
    for every in (1, 3):
        run = f"every-{every}"
        code, out = _train(_args(tmp, run, "--train.steps=6", f"--log.every={every}", "--checkpoint.every=0",
                                 "--train.on_nonfinite=skip"), fault="nangrad:1:1")
        assert code == 0, out[-3000:]
        assert "step 1: gradient norm is nan" in out and "its update was skipped" in out
        runs[every] = json.loads((tmp / run / "summary.json").read_text())["losses"]
    assert len(runs[1]) == 6 and runs[3] == runs[1]

    ck = tmp / "every-term" / "ck"
    code, out = _train(_args(tmp, "every-term", "--train.steps=6", "--log.every=3"), fault="term:1:2")
    assert code == 128 + signal.SIGTERM, out[-3000:]
    # step 2 was agreed on in step 1's collective; the signal sent at step 2's start is heard in step 2's
    assert (f"rank 1 received SIGTERM: every rank stopped at step 3/6; saved checkpoint step-3 in {ck}"
            in out.splitlines()[-1])
    assert _steps(ck) == ["step-3"] and _all_finite(ck / "step-3")


def _plan(tmp: Path, **llm) -> str:
    layout = {"tp": 1, "cp": 1, "dp": 2, "pp": 1, "fsdp": False}
    plan = {"model": "tiny-vlm", "layouts": {"vision": dict(layout), "llm": {**layout, **llm}},
            "placement": "colocated", "schedule": "1f1b", "n_microbatches": 2, "global_batch": 8}
    path = tmp / f"plan-{len(list(tmp.glob('plan-*.json')))}.json"
    path.write_text(json.dumps(plan))
    return str(path)


def test_bad_input_is_refused_before_any_process_starts(tmp, capsys, monkeypatch) -> None:
    monkeypatch.setattr("harmonia.launch.launch", lambda *a, **k: pytest.fail("spawned despite bad input"))
    garbage = tmp / "garbage.json"
    garbage.write_text("{not json")
    afile = tmp / "a-file"
    afile.write_text("")
    cases = [
        ([f"--parallel.plan={garbage}"], f"plan file {garbage} is not JSON (Expecting property name"),
        ([f"--parallel.plan={_plan(tmp, fsdp='no')}"], 'plan.layouts.llm.fsdp = "no" is invalid: expected true or '
                                                       "false"),
        ([f"--parallel.plan={_plan(tmp)}", "--model.preset=tiny-omni"], "was made for model 'tiny-vlm' but this job "
                                                                        "trains 'tiny-omni'"),
        ([f"--parallel.plan={_plan(tmp)}", "--parallel.llm_pp=2"], "pipelines the LLM over pp=1 stages but "
                                                                   "parallel.llm_pp=2"),
        (["--train.lr=inf"], "config train.lr=inf is invalid: expected a finite positive number"),
        (["--trian.steps=3"], "unknown config section [trian]"),
        ([f"--checkpoint.dir={afile / 'ck'}"], f"checkpoint.dir {afile / 'ck'} is not writable (Not a directory)"),
    ]
    for extra, expected in cases:
        code, out = _in_process(["train", *_args(tmp, "bad"), *extra], capsys)
        assert code == 2 and expected in out and "Traceback" not in out, (extra, out)

    with DirectoryLock(tmp / "locked" / "ck"):
        code, out = _in_process(["train", *_args(tmp, "locked")], capsys)
    assert code == 2 and f"is in use by another harmonia job (pid {os.getpid()} on host" in out

    # `harmonia demo` deletes nothing in a directory it did not create, and nothing before checking
    mine = tmp / "mine"
    (mine / "step-3").mkdir(parents=True)
    (mine / "step-3" / "trainer.json").write_text('{"step": 3}')
    (mine / "notes.txt").write_text("keep me")
    for extra in (["--train.steps=0"], []):
        code, out = _in_process(["demo", *_args(tmp, "demo"), f"--checkpoint.dir={mine}", *extra], capsys)
        assert code == 2 and "Traceback" not in out, out
        assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "step-3"], out
    assert "harmonia did not create it, so it deletes nothing there" in out
