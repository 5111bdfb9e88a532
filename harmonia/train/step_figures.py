"""What a training step measures for its record: module times, memory and wall-clock rates.

Each rank turns its step's measured actions into one row of floats (`times_row`); rows of every
rank are gathered on logged steps only (`is_logged`), riding on the next step's agreement
(`harmonia.train.rank_data.agree_failures`), and rank 0 adds what they say to the step's record
(`with_gathered`). `TrainingWindow` gives the record's wall-clock rates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from harmonia.config import Config


def is_logged(config: Config, step: int) -> bool:
    """Whether ``step``'s record is logged (``log.every`` steps and the last): only those steps'
    records reach metrics.jsonl and the trackers, and gather every rank's figures."""
    return step % config.log.every == 0 or step == config.train.steps - 1


@dataclass
class StepTimes:
    """Measured action times of one step on this rank, by module, and the busy fraction."""

    step_s: float
    module_s: dict[str, float] = field(default_factory=dict)
    busy_s: float = 0.0


@dataclass
class TrainingWindow:
    """Work done over wall-clock time since the first step of this run began: its rates count
    everything between the steps (barriers, data waits, checkpoints, logging, timeline renders).

    Attributes:
        start: ``time.perf_counter()`` at the start of the run's first step.
        tokens, samples: LLM tokens (real tokens, as the samples hold them) and samples trained so far.
    """

    start: float
    tokens: int = 0
    samples: int = 0

    def add(self, tokens: int, samples: int, now: float) -> dict[str, float]:
        """Count a finished step; the record's wall-clock rates from the window's start to ``now``."""
        self.tokens += tokens
        self.samples += samples
        elapsed = max(now - self.start, 1e-9)
        return {"elapsed_s": elapsed, "tokens_per_s": self.tokens / elapsed, "samples_per_s": self.samples / elapsed}


@dataclass
class LoggedStep:
    """A finished step's record (rank 0's; None on the others) and this rank's figures of it
    (`times_row`; None where the step is not logged), until every rank's are gathered: by the next
    step's agreement, or before a checkpoint, an evaluation or the end."""

    step: int
    step_s: float
    record: dict | None
    row: torch.Tensor | None
    measured: dict


def step_times(action_times: list | None, step_s: float, modules: list[str]) -> StepTimes:
    """This rank's seconds in each module and busy seconds, from the executor's ``(action, start,
    end, cpu)`` measurements."""
    times = StepTimes(step_s, {m: 0.0 for m in modules})
    for a, start, end, _ in action_times or []:
        times.module_s[a.module] += end - start
        times.busy_s += end - start
    return times


def times_row(times: StepTimes, modules: list[str], peaks: tuple[float, ...] = (0.0,) * 4) -> torch.Tensor:
    """This rank's figures of a step for `with_gathered`: ``(modules + 2 + peaks,)`` float64 of its
    time in each module, its busy time, its resident memory now and ``peaks`` (bytes: its measured and
    predicted states at the step's start, measured and predicted step peak; exact in float64 below
    2**53)."""
    return torch.tensor([*(times.module_s[m] for m in modules), times.busy_s, current_rss_bytes(), *map(int, peaks)],
                        dtype=torch.float64)


def with_gathered(done: LoggedStep, rows: torch.Tensor, modules: list[str]) -> dict:
    """``done``'s record with what every rank's `times_row` (``(world, modules + 2 + peaks)``,
    gathered) says: per module the slowest rank's time, the bubble fraction over all ranks, every
    rank's resident memory, and where the step counted tensor bytes, its measured and predicted
    peaks and states."""
    world, n = rows.shape[0], len(modules)
    slowest = rows[:, :n].max(dim=0).values
    busy = float(rows[:, n].sum())
    bubble = max(0.0, 1.0 - busy / (world * done.step_s)) if done.step_s > 0 else 0.0
    memory = [[int(v) for v in r] for r in rows[:, n + 1:].tolist()]  # [rss now, *peaks] per rank
    counted = {} if not done.measured else {
        "memory_peak_bytes": [m[3] for m in memory], "memory_predicted_bytes": [m[4] for m in memory],
        **({"memory_held_bytes": [m[1] for m in memory],
            "memory_states_predicted_bytes": [m[2] for m in memory]} if "held" in done.measured else {})}
    return {**done.record, "time": {m: float(slowest[i]) for i, m in enumerate(modules)}, "bubble_frac": bubble,
            "rss_bytes": [m[0] for m in memory], **counted}


def current_rss_bytes() -> int:
    """Resident memory of this process now (``/proc/self/statm``; the peak where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (CPU runs)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
