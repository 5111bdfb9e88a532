"""What people look at during and after training: progress bar, metrics, timelines, summary table.

Rank 0 shows a rich progress bar (step, loss, tokens/s, ETA) and writes every step's record to
``metrics.jsonl`` and TensorBoard (`harmonia.metrics.MetricsWriter`). One step's measured actions
(every rank's, gathered to rank 0) become a timeline drawn exactly like the simulator's, next to
the simulated timeline of the same step, so the two can be compared bar by bar.

None of it can stop training: a file that cannot be written warns (`best_effort`) and the run goes on.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from harmonia.config import Config
from harmonia.metrics import MetricsWriter
from harmonia.sim.engine import Task, Timeline
from harmonia.train.calibrate import MeasuredAction
from harmonia.train.step_figures import is_logged
from harmonia.train.trackers import open_trackers

console = Console(width=None if sys.stdout.isatty() else 140)
log = logging.getLogger(__name__)


def best_effort(what: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``; an OSError (full or unwritable disk) only warns that ``what`` was not written."""
    try:
        return fn(*args, **kwargs)
    except OSError as err:
        log.warning("could not write %s (%s); training goes on", what, err)
        return None


class ProgressReporter:
    """Rank 0's progress bar and metrics; a no-op elsewhere. Use as a context manager.

    Where stdout is not a terminal (nohup, Slurm, a pipe) a bar cannot redraw, so rank 0 prints one
    plain line every ``log.every`` steps instead (`progress_line`)."""

    def __init__(self, config: Config, start_step: int, enabled: bool) -> None:
        self.config, self.enabled = config, enabled
        self.lines = enabled and not console.is_terminal
        self.start_step, self.started = start_step, time.perf_counter()
        self.records: list[dict] = []
        self.evals: list[dict] = []  # `evaluation`'s records
        trackers = open_trackers(config, start_step) if enabled else []
        self.writer = MetricsWriter(config.log.dir, enabled=enabled, tensorboard=config.log.tensorboard,
                                    start_step=start_step, trackers=trackers)
        self.progress = Progress(TextColumn("[bold]train[/] step {task.completed}/{task.total}"), BarColumn(),
                                 TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=console, disable=not enabled or self.lines, transient=False)
        self.task = self.progress.add_task("train", total=config.train.steps, completed=start_step,
                                           loss=float("nan"), tps=0.0)

    def __enter__(self) -> ProgressReporter:
        self.progress.start()
        return self

    def __exit__(self, kind, *exc) -> None:
        self.progress.stop()
        self.writer.close(failed=kind is not None)

    def step(self, record: dict) -> None:
        self.records.append(record)
        logged = is_logged(self.config, record["step"])
        if logged:
            self.writer.log(record["step"], record)
        if logged and self.lines:
            done = record["step"] + 1
            console.print(progress_line(done, self.config.train.steps, record, time.perf_counter() - self.started,
                                        done - self.start_step), markup=False, highlight=False)
        if not self.progress.disable:  # (rank 0's bar on a terminal)
            self.progress.update(self.task, completed=record["step"] + 1, loss=record["loss"],
                                 tps=record["tokens_per_s"])

    def evaluation(self, record: dict) -> None:
        """One evaluation's record (`harmonia.train.eval_loss`): ``step`` (steps trained), ``loss``,
        ``batches``, ``samples``; printed, and logged as ``eval/loss`` at the last step trained."""
        if not self.enabled:
            return
        self.evals.append(record)
        self.writer.log(record["step"] - 1, {"eval": {k: v for k, v in record.items() if k != "step"}})
        console.print(eval_line(record), markup=False, highlight=False)


def eval_line(record: dict) -> str:
    """``eval after step 40: loss 2.1234 over 96 samples (3 batches)``, and the usable samples beyond
    whole batches the evaluation leaves out, where there are any (``; 5 left out beyond whole batches``)."""
    left = record.get("left_out", 0)
    return (f"eval after step {record['step']}: loss {record['loss']:.4f} over {record['samples']} samples "
            f"({record['batches']} batches)" + (f"; {left} left out beyond whole batches" if left else ""))


def phase_line(text: str) -> None:
    """One line for a phase before the first step or after the last (rank 0 or the launcher), with the
    time of day where stdout is not a terminal, so a log shows where the minutes went."""
    stamp = "" if console.is_terminal else time.strftime("%H:%M:%S ")
    console.print(stamp + text, markup=False, highlight=False)


def progress_line(done: int, total: int, record: dict, elapsed: float, ran: int) -> str:
    """``step 5/120  loss 4.1234  7,088 tok/s  elapsed 0:00:12  ETA 0:02:41``: ``done`` steps of
    ``total``, ``ran`` of them in ``elapsed`` seconds by this job (the ETA extrapolates them)."""
    eta = elapsed / max(ran, 1) * (total - done)
    return (f"step {done}/{total}  loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  "
            f"elapsed {_clock(elapsed)}  ETA {_clock(eta)}")


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def measured_timeline(actions: dict[int, list[MeasuredAction]]) -> Timeline:
    """A `Timeline` of every rank's measured compute actions."""
    tasks, start, end = [], [], []
    busy = {r: 0.0 for r in sorted(actions)}
    for r in sorted(actions):
        for name, module, kind, s, e, _ in actions[r]:
            tasks.append(Task(name, r, e - s, module=module, kind=kind))
            start.append(s)
            end.append(e)
            busy[r] += e - s
    iteration = max(end, default=0.0)
    return Timeline(tasks, np.asarray(start), np.asarray(end), sorted(actions), iteration, busy,
                    {r: 0.0 for r in busy})


def write_timelines(directory: Path, step: int, actions: dict, simulated: Timeline | None, step_s: float,
                    calibrated: bool = False) -> None:
    """``timeline-measured.png`` / ``.json``, ``timeline-simulated.*`` and both stacked in ``timeline.png``."""
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    from harmonia.sim.timeline import plot_timeline, to_chrome_trace

    directory.mkdir(parents=True, exist_ok=True)
    pictures = []
    for label, timeline in (("measured", measured_timeline(actions)), ("simulated", simulated)):
        if timeline is None:
            continue
        note = f" (wall {step_s * 1e3:.0f} ms)" if label == "measured" else \
            " (cost model fitted to a measured step)" if calibrated else " (nominal cost model)"
        title = f"step {step} {label}{note}"
        plot_timeline(timeline, directory / f"timeline-{label}.png", title=title)
        to_chrome_trace(timeline, directory / f"timeline-{label}.json", title=title)
        pictures.append(mpimg.imread(directory / f"timeline-{label}.png"))
    fig, axes = plt.subplots(len(pictures), 1, figsize=(14, 3.2 * len(pictures)), squeeze=False)
    for ax, pic in zip(axes[:, 0], pictures):
        ax.imshow(pic)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(directory / "timeline.png", dpi=100)
    plt.close(fig)


def sparkline(values: list[float], width: int = 40) -> str:
    """``values`` as a row of block characters (min = lowest block), averaged into ``width`` bins."""
    blocks = "▁▂▃▄▅▆▇█"
    finite = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    if not len(finite):
        return ""
    bins = [float(np.mean(chunk)) for chunk in np.array_split(finite, min(width, len(finite)))]
    lo, hi = min(bins), max(bins)
    return "".join(blocks[int((v - lo) / (hi - lo) * (len(blocks) - 1)) if hi > lo else 0] for v in bins)


def simulated_row(records: list[dict]) -> tuple[str, str]:
    """Mean simulated step time, over the steps simulated with the fitted cost model when there are any."""
    simulated = [r for r in records if np.isfinite(r.get("simulated_step_s", float("nan")))]  # rank 0 simulates
    fitted = [r for r in simulated if r.get("simulated_calibrated")]  # logged steps (and two more) only
    chosen = fitted or simulated or records
    value = f"{np.mean([r['simulated_step_s'] for r in chosen]) * 1e3:.1f} ms"
    return ("step time simulated (mean, " + ("fitted cost model)" if fitted else "nominal cost model)"), value)


def summary_table(records: list[dict], accuracy: dict | None = None, evals: list[dict] | None = None) -> Table:
    """The final table: loss first vs last (and the evaluation loss), throughput, measured vs simulated
    step time, balance, data."""
    table = Table(title="harmonia train: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if not records:
        return table
    steady = records[1:] or records  # the first step pays one-time set-up costs
    first, last = records[0], records[-1]

    def mean(key: str) -> float:  # over the steps that carry it (module times and bubble: the logged ones)
        return float(np.mean([r[key] for r in steady if key in r] or [float("nan")]))

    rows = [
        ("steps", f"{first['step']}..{last['step']}"),
        ("loss (first -> last)", f"{first['loss']:.4f} -> {last['loss']:.4f}"),
        ("loss curve", sparkline([r["loss"] for r in records])),
        *([(f"eval loss (after step {evals[0]['step']} -> {evals[-1]['step']}, {evals[-1]['samples']} samples)",
            f"{evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}")] if evals else []),
        ("tokens/s (wall clock, all steps)", f"{last['tokens_per_s']:,.0f}"),
        ("samples/s (wall clock, all steps)", f"{last['samples_per_s']:.2f}"),
        ("tokens/s in steps' compute (mean)", f"{mean('step_tokens_per_s'):,.0f}"),
        ("step time measured (mean)", f"{mean('step_s') * 1e3:.1f} ms"),
        simulated_row(steady),
        ("bubble measured (mean)", f"{mean('bubble_frac'):.1%}"),
        ("microbatch work max/mean (mean)", f"{np.mean([r['balance']['microbatch_imbalance'] for r in steady]):.3f}"),
        ("step preparation, mean (share hidden)",
         f"{mean('schedule_prepare_s') * 1e3:.1f} ms; {last['schedule_hidden_frac']:.0%}"),
        ("samples skipped (bad data)", f"{last.get('data/skipped', 0)}"),
        ("peak memory (rank 0)", f"{last['peak_memory_bytes'] / 2**20:,.0f} MiB"),
    ]
    for module, seconds in last["time"].items():
        rows.append((f"time in {module} (last step, slowest rank)", f"{seconds * 1e3:.1f} ms"))
    for task, (before, after, n, chance) in (accuracy or {}).items():
        rows.append((f"held-out accuracy {task} (n={n}, chance {chance:.0%})", f"{before:.0%} -> {after:.0%}"))
    for name, value in rows:
        table.add_row(name, value)
    return table
