"""Run a command and measure its whole process tree: wall time, CPU seconds, proportional memory.

`watch` runs the command, samples its tree from ``/proc`` every `POLL_S` seconds (its summed
``Pss`` where asked, and its CPU seconds whenever a steps file grows), and counts its CPU with
``RUSAGE_CHILDREN``, orphans included (`_adopt_orphans`).

Reading ``Pss`` (``/proc/PID/smaps_rollup``) walks the process's page tables under its memory-map
lock, which the process's own allocations then wait for: sampled every 0.1 s beside a 2-process
training job on 2 cores, it cost that job 12-20% of its samples/s (measured alternating, the same
job with and without the sampling). A run whose speed is measured should not sample it
(``memory=False``); its memory is measured by another run.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.1


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(fields[1]), []).append(int(d))
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def tree_cpu_s(pids: list[int]) -> float:
    """User + system seconds of ``pids`` and of the children they have reaped."""
    ticks = 0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += sum(int(x) for x in f[11:15])  # utime stime cutime cstime (fields 14-17)
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_pss_bytes(pids: list[int]) -> int:
    """Summed proportional resident memory of ``pids``."""
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def _adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (Linux ``PR_SET_CHILD_SUBREAPER``): a
    process that outlives its parent by moments (a fork server, whose children are the ranks) is
    then reaped here, and its CPU time counts in ``RUSAGE_CHILDREN``."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _reap_orphans(grace_s: float = 30.0) -> None:
    """Wait (at most ``grace_s``) for the orphans adopted while a command ran."""
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


def watch(cmd: list[str], env: dict, log: Path, steps_file: Path, timeout: float = 900.0,
          memory: bool = True) -> dict:
    """Run ``cmd`` and sample its process tree until it exits.

    Returns:
        ``started`` (time.time()), ``wall_s``, ``cpu_command_s`` (RUSAGE_CHILDREN: the command and
        every process below it, orphans included, `_adopt_orphans`), ``peak_bytes`` (the largest
        summed ``Pss`` sampled; None without ``memory``) and ``marks``: lines of ``steps_file`` ->
        (time first seen, the tree's CPU seconds then).

    Raises:
        RuntimeError: the command failed or ran past ``timeout`` (its log's tail in the message).
    """
    _adopt_orphans()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    peak, marks, seen = 0, {}, 0
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            pids = process_tree(proc.pid)
            if memory:
                peak = max(peak, tree_pss_bytes(pids))
            n = _lines(steps_file)
            if n != seen:
                marks[n], seen = (time.time(), tree_cpu_s(pids)), n
            if time.time() - started > timeout:
                proc.kill()
                proc.wait()
                break
            time.sleep(POLL_S)
    wall = time.time() - started
    _reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{shlex.join(cmd)}: exit {proc.returncode} after {wall:.0f} s\n{tail}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"started": started, "wall_s": wall, "cpu_command_s": cpu, "peak_bytes": peak if memory else None,
            "marks": marks}


def window_cpu_per_step(marks: dict[int, tuple[float, float]]) -> float | None:
    """CPU seconds per step between the first and the last step record seen."""
    if len(marks) < 2:
        return None
    lo, hi = min(marks), max(marks)
    return (marks[hi][1] - marks[lo][1]) / (hi - lo)
