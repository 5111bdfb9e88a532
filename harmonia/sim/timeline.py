"""Timelines people look at: a Chrome/Perfetto trace and a PNG Gantt chart of a replay.

Rows are ranks; each rank has its compute stream and, beneath it, a thin communication stream
(DP gradient reductions). Bars are coloured by module and shaded by kind: F in the module's
colour, B darker, W lighter and hatched, BW in between, collectives grey. Idle compute time shows
as the pale band behind the bars. The title carries the iteration time and bubble fraction.

The chart draws every bar of a kind in one ``PolyCollection`` built from numpy arrays, so a replay
of 10k tasks renders in a fraction of a second; microbatch labels appear only on bars wide and tall
enough to hold them, and not at all when there would be too many to read.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path as MplPath

from harmonia.sim.engine import Timeline

MODULE_COLOURS = {"llm": "#4C72B0", "vision": "#DD8452", "audio": "#55A868", "video": "#C44E52",
                  "vision_proj": "#CCB974", "audio_proj": "#64B5CD", "video_proj": "#DA8BC3"}
"""Fixed colour per known module name; other modules draw from ``EXTRA_COLOURS``."""
EXTRA_COLOURS = ("#8172B3", "#937860", "#2CA02C", "#17BECF", "#BCBD22", "#E377C2")
KIND_SHADE = {"F": 1.0, "B": 0.62, "W": 1.45, "BW": 0.8}
"""Brightness factor per compute kind: below 1 darkens, above 1 lightens towards white."""
KIND_HELP = {"F": "F forward", "B": "B input grad", "W": "W weight grad", "BW": "BW backward", "C": "C DP all-reduce"}
COMM_GREY = (0.5, 0.5, 0.5)

DPI = 100
ROW_IN = 0.32  # inches per rank row
TOP_IN, BOTTOM_IN, LEFT_IN, RIGHT_IN = 0.45, 0.6, 0.85, 1.55  # fixed margins (inches)
MIN_HEIGHT_IN, MAX_HEIGHT_IN = 2.4, 18.0
MAX_LABELS = 600  # more labels than this and none are drawn (too dense to read, and slow)
MIN_LABELLED = 0.25  # label only if this share of compute bars can hold a label (no stray labels)
LABEL_PT = 6.5
COMPUTE_Y = (-0.40, 0.24)  # bar extent around the row centre (axis inverted: rank 0 on top)
COMM_Y = (0.29, 0.43)

_NAME = re.compile(r"^(?P<module>[^.]+)\.r(?P<replica>\d+)\.s(?P<chunk>\d+)\.(?P<kind>[A-Z]+)"
                   r"(?P<microbatch>\d+)(?:\.(?P<sub>\d+))?$")


def module_colour(module: str) -> str:
    """The module's fixed colour (a stable pick from ``EXTRA_COLOURS`` for unknown names)."""
    if module in MODULE_COLOURS:
        return MODULE_COLOURS[module]
    return EXTRA_COLOURS[sum(map(ord, module)) % len(EXTRA_COLOURS)]


def kind_colour(module: str, kind: str) -> tuple[float, float, float]:
    """Bar colour of a task: the module's colour shaded by kind; collectives are grey."""
    if kind == "C":
        return COMM_GREY
    return _shade(module_colour(module), KIND_SHADE.get(kind, 1.0))


def _shade(colour: str, factor: float) -> tuple[float, float, float]:
    """Darken (``factor < 1``) or lighten towards white (``factor > 1``) a colour."""
    r, g, b = to_rgb(colour)
    if factor <= 1:
        return (r * factor, g * factor, b * factor)
    t = min(factor - 1, 1.0)
    return (r + (1 - r) * t, g + (1 - g) * t, b + (1 - b) * t)


def parse_task_name(name: str) -> dict[str, int | str | None]:
    """Fields of a compute task name ``module.rR.sC.KINDm`` or ``module.rR.sC.KINDm.sub`` (replica
    ``R``, chunk ``C``, global microbatch ``m``); empty for other names (messages, collectives).

    Returns:
        ``module``, ``replica``, ``chunk``, ``kind``, ``microbatch`` and ``sub`` (None when not split).
    """
    m = _NAME.match(name)
    if m is None:
        return {}
    return {k: (v if k in ("module", "kind") or v is None else int(v)) for k, v in m.groupdict().items()}


def _title(timeline: Timeline, title: str) -> str:
    return f"{title} — iteration {timeline.iteration_s * 1e3:.1f} ms, bubble {timeline.bubble_frac:.1%}"


def to_chrome_trace(timeline: Timeline, path: str | Path, title: str = "harmonia") -> None:
    """Write a Chrome/Perfetto trace of the replay (open it in ui.perfetto.dev or chrome://tracing).

    One complete event (``ph: "X"``, ``ts``/``dur`` in microseconds) per task, named by the task;
    ``pid`` is the rank (named ``rank N``), ``tid`` 0 the compute stream and 1 the communication
    stream. ``args`` carry module, kind, microbatch (``null`` for collectives) and FLOPs.

    Args:
        timeline: a replay.
        path: the ``.json`` file to write.
        title: scenario or recipe name, stored with the iteration time under ``otherData``.
    """
    events: list[dict] = []
    for i, r in enumerate(timeline.ranks):
        events += [
            {"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}},
            {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": i}},
            {"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "communication"}},
        ]
    for task, start, end in zip(timeline.tasks, timeline.start.tolist(), timeline.end.tolist()):
        fields = parse_task_name(task.name)
        args = {"module": task.module, "kind": task.kind, "microbatch": fields.get("microbatch"),
                "flops": task.flops}
        if fields:
            args.update(replica=fields["replica"], chunk=fields["chunk"], sub=fields["sub"])
        events.append({"ph": "X", "name": task.name, "cat": f"{task.module},{task.kind}", "pid": task.rank,
                       "tid": 1 if task.kind == "C" else 0, "ts": start * 1e6, "dur": (end - start) * 1e6,
                       "args": args})
    meta = {"title": _title(timeline, title), "iteration_s": timeline.iteration_s,
            "bubble_frac": timeline.bubble_frac}
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}))


def figure_inches(n_ranks: int, width: float = 14.0) -> tuple[float, float]:
    """Figure size of a chart with ``n_ranks`` rows: ``ROW_IN`` per rank plus margins, height capped."""
    height = TOP_IN + BOTTOM_IN + ROW_IN * max(n_ranks, 1)
    return width, min(MAX_HEIGHT_IN, max(MIN_HEIGHT_IN, height))


def _boxes(x0: np.ndarray, x1: np.ndarray, y: np.ndarray, extent: tuple[float, float]) -> np.ndarray:
    """Rectangles as an ``(n, 4, 2)`` vertex array for ``PolyCollection``."""
    y0, y1 = y + extent[0], y + extent[1]
    return np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y1], 1), np.stack([x0, y1], 1)], 1)


def _text_colour(rgb: tuple[float, float, float]) -> str:
    return "white" if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 0.6 else "#222222"


def plot_timeline(timeline: Timeline, path: str | Path, title: str = "harmonia", width: float = 14.0) -> None:
    """Write a PNG Gantt chart of the replay: one row per rank, compute bar above a thin comm bar.

    The image is ``figure_inches(len(ranks), width) * 100`` pixels. Bars narrower than their label
    (or rows too thin for text) stay unlabelled; labels are left out altogether when fewer than
    ``MIN_LABELLED`` of the bars could carry one or more than ``MAX_LABELS`` would be drawn.

    Args:
        timeline: a replay.
        path: the ``.png`` file to write.
        title: scenario or recipe name; iteration time and bubble % are appended.
        width: figure width in inches.
    """
    n = len(timeline.ranks)
    fig_w, fig_h = figure_inches(n, width)
    fig = plt.figure(figsize=(fig_w, fig_h), dpi=DPI)
    plot_h = fig_h - TOP_IN - BOTTOM_IN
    ax = fig.add_axes((LEFT_IN / fig_w, BOTTOM_IN / fig_h, 1 - (LEFT_IN + RIGHT_IN) / fig_w, plot_h / fig_h))
    span_ms = max(timeline.iteration_s * 1e3, 1e-9)
    px_per_ms = (fig_w - LEFT_IN - RIGHT_IN) * DPI / span_ms
    row_px = plot_h * DPI / (n + 0.1)

    row_of = {r: i for i, r in enumerate(timeline.ranks)}
    tasks = timeline.tasks
    x0 = np.asarray(timeline.start, dtype=float) * 1e3
    x1 = np.asarray(timeline.end, dtype=float) * 1e3
    y = np.fromiter((row_of[t.rank] for t in tasks), float, len(tasks))
    kinds = np.array([t.kind for t in tasks], dtype=object)
    colour_of: dict[tuple[str, str], tuple[float, float, float]] = {}
    colours = [colour_of.setdefault((t.module, t.kind), kind_colour(t.module, t.kind)) for t in tasks]

    # pale band per rank: the compute stream's extent, so idle time reads as bubbles
    ax.add_collection(PolyCollection(_boxes(np.zeros(n), np.full(n, span_ms), np.arange(n, dtype=float),
                                            COMPUTE_Y), facecolors="#EEF0F3", edgecolors="none", zorder=0))
    compute = (x1 > x0) & (kinds != "C")
    _draw_bars(ax, x0, x1, y, kinds, colours, px_per_ms)
    if row_px * (COMPUTE_Y[1] - COMPUTE_Y[0]) >= LABEL_PT * DPI / 72 + 2:
        _draw_labels(ax, tasks, x0, x1, y, colours, np.flatnonzero(compute), px_per_ms)
    _decorate(ax, timeline, span_ms, row_px)
    fig.text(0.5, 1 - 0.22 / fig_h, _title(timeline, title), ha="center", va="center", fontsize=11)
    fig.savefig(path, dpi=DPI, pil_kwargs={"compress_level": 3})
    plt.close(fig)


def _draw_bars(ax: plt.Axes, x0: np.ndarray, x1: np.ndarray, y: np.ndarray, kinds: np.ndarray,
               colours: list, px_per_ms: float) -> None:
    """One ``PolyCollection`` per kind; W bars get one hatched path over all of them."""
    keep = x1 > x0
    compute = keep & (kinds != "C")
    # thin white separators between bars, unless bars are so thin the separators would hide them
    edge = 0.4 if compute.any() and np.median((x1 - x0)[compute]) * px_per_ms >= 4 else 0.0
    groups = {k: keep & (kinds == k) for k in ("B", "BW", "W", "C")}
    groups["F"] = keep & ~np.isin(kinds, ["B", "BW", "W", "C"])  # unknown kinds draw like F
    for kind, mask in groups.items():
        sel = np.flatnonzero(mask)
        if not len(sel):
            continue
        boxes = _boxes(x0[sel], x1[sel], y[sel], COMM_Y if kind == "C" else COMPUTE_Y)
        ax.add_collection(PolyCollection(boxes, facecolors=[colours[i] for i in sel], edgecolors="white",
                                         linewidths=0.0 if kind == "C" else edge, zorder=2))
        if kind == "W":  # hatching bars one by one costs ~1 ms each; one compound path costs one
            ax.add_artist(PathPatch(MplPath.make_compound_path_from_polys(boxes), facecolor="none",
                                    edgecolor="white", linewidth=0.0, hatch="//", zorder=2))


def _draw_labels(ax: plt.Axes, tasks: list, x0: np.ndarray, x1: np.ndarray, y: np.ndarray, colours: list,
                 compute: np.ndarray, px_per_ms: float) -> None:
    """Kind and microbatch (``F3``, ``BW0``) centred in each bar wide enough to hold it."""
    char_px = 0.62 * LABEL_PT * DPI / 72
    labels, named = [], 0
    for i in compute:
        fields = parse_task_name(tasks[i].name)
        if not fields:
            continue
        named += 1
        text = f"{tasks[i].kind}{fields['microbatch']}"
        if (x1[i] - x0[i]) * px_per_ms >= len(text) * char_px + 4:
            labels.append((i, text))
    if len(labels) > MAX_LABELS or len(labels) < MIN_LABELLED * named:
        return
    yc = sum(COMPUTE_Y) / 2
    for i, text in labels:
        ax.text((x0[i] + x1[i]) / 2, y[i] + yc, text, ha="center", va="center", fontsize=LABEL_PT,
                color=_text_colour(colours[i]), clip_on=True, parse_math=False, zorder=3)


def _decorate(ax: plt.Axes, timeline: Timeline, span_ms: float, row_px: float) -> None:
    """Axes limits, rank ticks (at most 64 labels), grid and the module/kind legend."""
    n = len(timeline.ranks)
    ax.set_xlim(0, span_ms)
    ax.set_ylim(n - 0.5, -0.5)
    step = max(1, math.ceil(n / 64))
    ticks = list(range(0, n, step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"rank {timeline.ranks[i]}" if n <= 16 else str(timeline.ranks[i]) for i in ticks],
                       fontsize=9 if n <= 16 else max(5.5, min(8.0, row_px * step * 0.55 * 72 / DPI)))
    ax.tick_params(axis="y", length=0)
    if n > 16:
        ax.set_ylabel("rank")
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", alpha=0.35, zorder=1)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    modules = sorted({t.module for t in timeline.tasks if t.kind != "C"}, key=lambda m: (m == "llm", m))
    present = {t.kind for t in timeline.tasks}
    handles = [Patch(facecolor=module_colour(m), label=m) for m in modules]
    for kind in ("F", "B", "W", "BW"):  # kinds as shades of a neutral grey
        if kind in present:
            handles.append(Patch(facecolor=_shade("#7F7F7F", KIND_SHADE[kind]), edgecolor="white",
                                 hatch="//" if kind == "W" else None, label=KIND_HELP[kind]))
    if "C" in present:
        handles.append(Line2D([], [], color=COMM_GREY, linewidth=3, label=KIND_HELP["C"]))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
              handlelength=1.6, borderaxespad=0.2)


def summary_rows(timeline: Timeline) -> list[dict[str, float | int]]:
    """Per-rank rows for a table: utilisation, busy seconds, communication seconds, peak memory (GiB).

    Returns:
        One dict per rank in ``timeline.ranks`` order with keys ``rank``, ``utilisation`` (compute
        busy share of the iteration), ``busy_s``, ``comm_s`` (communication-stream seconds) and
        ``peak_mem_gib`` (peak activation memory).
    """
    util = timeline.utilisation()
    comm = {r: 0.0 for r in timeline.ranks}
    for t in timeline.tasks:
        if t.kind == "C":
            comm[t.rank] += t.duration
    return [{"rank": r, "utilisation": util.get(r, 0.0), "busy_s": timeline.busy_s.get(r, 0.0),
             "comm_s": comm[r], "peak_mem_gib": timeline.peak_mem.get(r, 0.0) / 2**30} for r in timeline.ranks]
