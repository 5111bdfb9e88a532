"""Two torchrun agents on one machine (`--nnodes=2 --nproc-per-node=2`, c10d rendezvous): what a
user sees when a worker or a whole agent is killed mid-run.

Every run trains the demo job (configs/demo.toml: tiny-omni, 4 ranks) for a few steps with a
checkpoint after each, on a plan whose LLM pipeline spans the two agents (`SPANNING_PLAN`: its stage 0
on rank 1 of the first agent, its stage 1 on rank 2 of the second), as a pipeline over two nodes
runs. An uninterrupted run is the reference; its communication is recorded and replayed under
NCCL's rules (`tests.e2e._replay`), and its ranks say what they wait for while rank 0 prepares:

- a worker killed by SIGKILL: both agents restart the worker group (`--max-restarts=1`), the new
  attempt resumes from the last finished checkpoint (its rank 0 takes over the dead one's
  checkpoint lock), and the job ends with exit code 0 and the reference's per-step losses, bit for
  bit, also when only one agent counts the restart;
- an agent killed by SIGKILL: its workers stop at a step boundary, rank 0 prints one line saying
  so, the other agent ends (at once when the dead one hosted the rendezvous, else within the
  rendezvous timeout), nothing is left running, and the same command run again finishes the job
  with the reference's losses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harmonia.config import load_config
from harmonia.metrics import read_metrics
from harmonia.train.job import prepare_data
from tests.e2e._replay import nccl_replayed

pytestmark = [pytest.mark.distributed]
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"
STEPS = 4
JOIN_TIMEOUT_S = 15
"""How long an agent waits for the other at a rendezvous, where a test waits for it to give up."""
RESTART_JOIN_TIMEOUT_S = 60
"""Where both agents must meet again: longer than torchrun's 30 s between SIGTERM and SIGKILL of a
worker stuck in a collective, which one agent may spend stopping its workers while the other waits."""


SPANNING_PLAN = {"model": "tiny-omni", "placement": "disjoint", "schedule": "1f1b", "n_microbatches": 2,
                 "global_batch": 8, "training": {"vision": "frozen"},
                 "layouts": {"vision": {"ranks": [0]}, "llm": {"pp": 2, "ranks": [1, 2]}, "audio": {"ranks": [3]}}}
"""The first agent runs ranks 0 and 1, the second 2 and 3: the LLM's stage 0 (rank 1) sends its
activations to stage 1 (rank 2) across the agents, and the audio encoder (rank 3) to stage 0 back."""


def _args(tmp: Path, run: str) -> list[str]:
    """The demo's config on `SPANNING_PLAN`, a few steps on a small synthesized set, a checkpoint after
    every step."""
    return [f"--data.path={tmp / 'data'}", "--data.synthesize=32", "--data.heldout=8", f"--train.steps={STEPS}",
            "--train.global_batch=8", "--train.warmup=1", "--checkpoint.every=1", "--log.tensorboard=false",
            f"--parallel.plan={tmp / 'plan.json'}", f"--log.dir={tmp / run}", f"--checkpoint.dir={tmp / run / 'ck'}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoAgents:
    """Two torchrun agents of one job on this machine; each agent's output goes to its own file."""

    def __init__(self, tmp: Path, run: str, join_timeout: float = JOIN_TIMEOUT_S) -> None:
        self.tmp, self.run, self.join_timeout = tmp, run, join_timeout
        self.run_id = f"{run}-{os.getpid()}-{time.monotonic_ns()}"
        self.port = _free_port()
        self.agents: list[subprocess.Popen] = []

    def start_agent(self) -> subprocess.Popen:
        n = len(self.agents)
        torchrun = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run_id}", "--max-restarts=1",
                    f"--rdzv-conf=join_timeout={self.join_timeout:g},is_host={int(n == 0)}"]
        out = open(self.tmp / f"{self.run}.agent{n}.log", "w")
        proc = subprocess.Popen([sys.executable, *torchrun, "-m", "harmonia", "train", "--config", str(DEMO),
                                 *_args(self.tmp, self.run)],
                                cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.agents.append(proc)
        return proc

    def start(self) -> TwoAgents:
        self.start_agent()
        time.sleep(1.0)  # the first agent hosts the rendezvous and takes group rank 0
        self.start_agent()
        return self

    def output(self, n: int) -> str:
        return (self.tmp / f"{self.run}.agent{n}.log").read_text(errors="replace")

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for proc in self.agents:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [proc.returncode for proc in self.agents]

    def workers(self) -> dict[int, int]:
        """Live worker processes of this job: {pid: global rank}."""
        found = {}
        for proc in Path("/proc").iterdir():
            try:
                env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
                state = (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except (OSError, ValueError):
                continue
            if env.get(b"TORCHELASTIC_RUN_ID") == self.run_id.encode() and state != "Z":
                found[int(proc.name)] = int(env[b"RANK"])
        return found

    def workers_after(self, timeout: float) -> dict[int, int]:
        """The workers still running ``timeout`` seconds from now, or as soon as none is."""
        deadline = time.monotonic() + timeout
        while (found := self.workers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return found

    def kill_all(self) -> None:
        """End whatever of this job still runs (a failed test must not leave it behind)."""
        for pid in self.workers():
            _kill(pid)
        for proc in self.agents:
            if proc.poll() is None:
                _kill(proc.pid)
                proc.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])


def _wait_for_step(job: TwoAgents, step: int, timeout: float = 240) -> None:
    """Wait until rank 0 logged ``step`` (the job trains)."""
    metrics = job.tmp / job.run / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(metrics.read_text().splitlines()[-1])["step"] >= step:
                return
        except (OSError, IndexError, ValueError, KeyError):
            pass
        if any(p.poll() is not None for p in job.agents):
            break
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged:\n{job.output(0)[-3000:]}\n{job.output(1)[-3000:]}")


def _losses(tmp: Path, run: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(tmp / run)]


def _checkpoints(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step-") or p.name.endswith(".lock"))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("torchrun")
    (tmp / "plan.json").write_text(json.dumps(SPANNING_PLAN))
    prepare_data(load_config(DEMO, _args(tmp, "prep")))
    return tmp


@pytest.fixture(scope="module")
def reference(tmp) -> list[tuple[int, float]]:
    """The uninterrupted run's per-step losses; its messages replayed as NCCL would run them."""
    with nccl_replayed(tmp / "reference-comms") as replays:  # the agents' workers inherit HARMONIA_COMM_RECORD
        job = TwoAgents(tmp, "reference").start()
        try:
            assert job.wait(timeout=240) == [0, 0], job.output(0)[-3000:] + job.output(1)[-3000:]
        finally:
            job.kill_all()
    assert replays[0].ranks == 4 and replays[0].p2p_ops > 0
    assert json.loads((tmp / "reference" / "plan.json").read_text())["layouts"]["llm"]["ranks"] == [1, 2]
    assert ("rank 0 prepares the data and the plan; the other 3 ranks wait for it (up to 1800 s: "
            "parallel.prepare_timeout_s)") in job.output(0)
    assert ("rank 2 waits for rank 0 to prepare the data and the plan (up to 1800 s: parallel.prepare_timeout_s); "
            f"so does the other rank on host {socket.gethostname()}") in job.output(1)
    losses = _losses(tmp, "reference")
    assert [s for s, _ in losses] == list(range(STEPS))
    return losses


def _wait_for_text(job: TwoAgents, n: int, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in job.output(n):
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never printed by agent {n}:\n{job.output(n)[-3000:]}")
        time.sleep(0.05)


def _signal(pids, signum: int) -> None:
    for pid in pids:
        os.kill(pid, signum)


def _resumed_like_the_reference(tmp: Path, run: str, reference) -> None:
    summary = json.loads((tmp / run / "summary.json").read_text())
    assert 1 <= summary["start_step"] < STEPS  # resumed from a checkpoint the killed attempt finished
    assert _losses(tmp, run) == reference  # one record per step, every loss bit for bit
    ck = tmp / run / "ck"
    assert _checkpoints(ck) == [f"step-{s}" for s in range(STEPS - 2, STEPS + 1)]  # checkpoint.keep=3, no .tmp


@pytest.mark.timeout(480)  # generous: a busy machine slows every worker
def test_a_killed_worker_restarts_both_agents_and_the_job_resumes(tmp, reference) -> None:
    job = TwoAgents(tmp, "worker", RESTART_JOIN_TIMEOUT_S).start()
    try:
        _wait_for_step(job, 1)
        os.kill(next(pid for pid, rank in job.workers().items() if rank == 3), signal.SIGKILL)
        codes = job.wait(timeout=240)
        leftovers = job.workers()
    finally:
        job.kill_all()
    out = job.output(0) + job.output(1)
    assert codes == [0, 0], out[-6000:]
    assert "Traceback" not in out, out[-6000:]  # the peers of the dead rank say so in one line each
    _resumed_like_the_reference(tmp, "worker", reference)
    assert not leftovers


@pytest.mark.timeout(480)  # generous: a busy machine slows every worker
def test_agents_that_count_restarts_differently_agree_on_the_attempt(tmp, reference) -> None:
    """The first agent's workers are killed (rank 0, the checkpoint lock's holder, among them) while
    the second agent's have not noticed (frozen, as peers on another machine may be): the first
    agent counts a restart, the second restarts its workers for the membership change and does not,
    so their ``TORCHELASTIC_RESTART_COUNT`` differ; the new attempt's ranks still meet."""
    job = TwoAgents(tmp, "membership", RESTART_JOIN_TIMEOUT_S).start()
    try:
        _wait_for_step(job, 1)
        workers = job.workers()
        frozen = [pid for pid, rank in workers.items() if rank >= 2]
        _signal(frozen, signal.SIGSTOP)
        killed = {rank: pid for pid, rank in workers.items() if rank < 2}
        _signal(killed.values(), signal.SIGKILL)
        _wait_for_text(job, 1, "closing signal SIGTERM")  # the second agent restarts its (healthy) workers
        _signal(frozen, signal.SIGCONT)
        codes = job.wait(timeout=240)
        leftovers = job.workers()
    finally:
        job.kill_all()
    out, second = job.output(0), job.output(1)
    assert codes == [0, 0], out[-3000:] + second[-3000:]
    assert f"took over the lock of pid {killed[0]}" in out  # the new rank 0 took over the dead one's lock
    assert "failed (exitcode" not in second  # the second agent saw no failure: no restart counted
    assert "lost its connection to another rank" in second and "Traceback" not in out + second, second[-3000:]
    _resumed_like_the_reference(tmp, "membership", reference)
    assert not leftovers


@pytest.mark.timeout(480)  # generous: a busy machine slows every worker
@pytest.mark.parametrize("killed", [1, 0], ids=["second-agent", "rendezvous-host"])
def test_a_killed_agent_stops_every_worker_and_the_other_agent_ends(tmp, reference, killed) -> None:
    """The second agent killed: the first (which hosts the rendezvous) restarts and waits for it
    until the join timeout. The first killed: the second loses the rendezvous and ends at once."""
    run = f"agent-{killed}"
    job = TwoAgents(tmp, run).start()
    try:
        _wait_for_step(job, 1)
        workers = job.workers()
        doomed = _parent(next(pid for pid, rank in workers.items() if rank == 2 * killed))
        assert doomed == job.agents[killed].pid  # the first agent runs ranks 0 and 1, the second 2 and 3
        t0 = time.monotonic()
        os.kill(doomed, signal.SIGKILL)
        codes = job.wait(timeout=JOIN_TIMEOUT_S + 40)
        ended_s = time.monotonic() - t0
        leftovers = job.workers_after(20)  # the dead agent's workers finish their stop on their own
    finally:
        job.kill_all()
    rank0 = job.output(0)  # rank 0's output goes to the first agent's terminal, even once it is dead
    survivor = 1 - killed
    assert codes[killed] == -signal.SIGKILL and codes[survivor] != 0, rank0[-3000:]
    assert ended_s < (JOIN_TIMEOUT_S + 30 if killed else 20), f"the other agent took {ended_s:.0f} s to end"
    assert not leftovers, f"left running: {leftovers}"
    stopped = [line for line in rank0.splitlines() if "SIGTERM" in line and " at step " in line]
    assert len(stopped) == 1, rank0[-3000:]  # one line, by rank 0
    if killed:
        assert stopped[0].startswith("rank 2 received SIGTERM"), stopped
    step = int(stopped[0].split(" at step ")[1].split("/")[0])
    assert 1 <= step < STEPS
    ck = tmp / run / "ck"
    assert _checkpoints(ck)[-1] == f"step-{step}" and not (ck / "harmonia.lock").exists()

    again = TwoAgents(tmp, run).start()  # the same command again finishes the job
    try:
        assert again.wait(timeout=240) == [0, 0], again.output(0)[-3000:]
    finally:
        again.kill_all()
    assert json.loads((tmp / run / "summary.json").read_text())["start_step"] == step
    assert _losses(tmp, run) == reference
