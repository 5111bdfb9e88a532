"""Timelines people look at: a Chrome/Perfetto trace and a PNG Gantt chart of a replay.

Rows are ranks; each rank has its compute stream and, beneath it, a thin communication stream
(DP gradient reductions). Bars are coloured by module and shaded by kind (F full colour, B darker,
W lighter, BW mid, collectives grey). The title carries the iteration time and bubble fraction.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from harmonia.sim.engine import Timeline  # noqa: E402

MODULE_COLOURS = {"llm": "#4C72B0", "vision": "#DD8452", "audio": "#55A868", "video": "#C44E52"}
EXTRA_COLOURS = ["#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD"]
KIND_SHADE = {"F": 1.0, "B": 0.65, "W": 1.35, "BW": 0.8}


def module_colour(module: str) -> str:
    if module in MODULE_COLOURS:
        return MODULE_COLOURS[module]
    return EXTRA_COLOURS[sum(map(ord, module)) % len(EXTRA_COLOURS)]


def _shade(colour: str, factor: float) -> tuple[float, float, float]:
    r, g, b = to_rgb(colour)
    if factor <= 1:
        return (r * factor, g * factor, b * factor)
    t = factor - 1  # lighten towards white
    return (r + (1 - r) * t, g + (1 - g) * t, b + (1 - b) * t)


def _title(timeline: Timeline, title: str) -> str:
    return f"{title} — iteration {timeline.iteration_s * 1e3:.1f} ms, bubble {timeline.bubble_frac:.1%}"


def to_chrome_trace(timeline: Timeline, path: str | Path, title: str = "harmonia") -> None:
    """Write a Chrome/Perfetto trace (``ph: X`` events, microseconds; pid = rank, tid 0 compute,
    tid 1 communication)."""
    events = [{"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}} for r in timeline.ranks]
    for r in timeline.ranks:
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "communication"}})
    for task, start, end in zip(timeline.tasks, timeline.start, timeline.end):
        events.append({
            "ph": "X", "name": task.name, "cat": f"{task.module}.{task.kind}", "pid": task.rank,
            "tid": 1 if task.kind == "C" else 0, "ts": float(start) * 1e6, "dur": float(end - start) * 1e6,
            "args": {"module": task.module, "kind": task.kind, "flops": task.flops},
        })
    meta = {"title": _title(timeline, title), "iteration_s": timeline.iteration_s, "bubble_frac": timeline.bubble_frac}
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}))


def plot_timeline(timeline: Timeline, path: str | Path, title: str = "harmonia", width: float = 14.0) -> None:
    """Write a PNG Gantt chart of the replay (one PolyCollection for all bars, so it stays fast)."""
    n = len(timeline.ranks)
    row = {r: i for i, r in enumerate(timeline.ranks)}
    height = min(18.0, 1.2 + 0.32 * n)
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    polys, colours = [], []
    scale = 1e3  # milliseconds
    labels = []
    min_label = timeline.iteration_s * scale / 60
    for task, start, end in zip(timeline.tasks, timeline.start, timeline.end):
        if end <= start:
            continue
        y = row[task.rank]
        x0, x1 = start * scale, end * scale
        if task.kind == "C":
            y0, y1 = y + 0.30, y + 0.42
            colour = (0.55, 0.55, 0.55)
        else:
            y0, y1 = y - 0.38, y + 0.26
            colour = _shade(module_colour(task.module), KIND_SHADE.get(task.kind, 1.0))
            if x1 - x0 > min_label and n <= 32:
                labels.append(((x0 + x1) / 2, (y0 + y1) / 2, task.kind + task.name.split(".")[-1]))
        polys.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
        colours.append(colour)
    ax.add_collection(PolyCollection(polys, facecolors=colours, edgecolors="white", linewidths=0.3))
    for x, y, text in labels:
        ax.text(x, y, text, ha="center", va="center", fontsize=6, color="white")
    ax.set_xlim(0, max(timeline.iteration_s * scale, 1e-9))
    ax.set_ylim(n - 0.5, -0.6)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in timeline.ranks], fontsize=7 if n > 16 else 9)
    if n > 40:
        for label in ax.get_yticklabels()[1::2]:
            label.set_visible(False)
    ax.set_xlabel("time (ms)")
    ax.set_title(_title(timeline, title), fontsize=10)
    modules = sorted({t.module for t in timeline.tasks if t.kind != "C"})
    handles = [Patch(color=module_colour(m), label=m) for m in modules]
    handles += [Patch(color=_shade("#777777", KIND_SHADE[k]), label=k) for k in ("F", "B", "W", "BW")]
    handles.append(Patch(color=(0.55, 0.55, 0.55), label="DP reduce"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary_rows(timeline: Timeline) -> list[dict]:
    """Per-rank utilisation, busy seconds and peak activation memory (GiB)."""
    util = timeline.utilisation()
    return [{"rank": r, "utilisation": util[r], "busy_s": timeline.busy_s[r],
             "peak_mem_gib": timeline.peak_mem.get(r, 0.0) / 2**30} for r in timeline.ranks]
