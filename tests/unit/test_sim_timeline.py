"""Timelines: Chrome trace schema, PNG size and content, per-rank rows, speed on large replays."""

import json
import time
from collections import Counter

import numpy as np
import pytest
from matplotlib.image import imread

from harmonia.sim.engine import Task, Timeline, replay
from harmonia.sim.timeline import (
    DPI,
    MAX_HEIGHT_IN,
    figure_inches,
    kind_colour,
    module_colour,
    parse_task_name,
    plot_timeline,
    summary_rows,
    to_chrome_trace,
)


def two_stage_timeline() -> Timeline:
    """Vision encoder on rank 0 feeding a two-stage LLM (ranks 0, 1), two microbatches, DP reduces.

    Rank 0: vision F0 F1, llm s0 F0 F1, ..., llm s0 B/W, vision W; rank 1: llm s1 F then BW.
    """
    tasks = [
        Task("vision.r0.s0.F0", 0, 0.2, module="vision", mem_delta=2**30),
        Task("vision.r0.s0.F1", 0, 0.2, module="vision", mem_delta=2**30),
        Task("llm.r0.s0.F0", 0, 1.0, [(0, 0.0)], "llm", mem_delta=2**31),
        Task("llm.r0.s0.F1", 0, 1.0, [(1, 0.0)], "llm", mem_delta=2**31),
        Task("llm.r0.s1.F0", 1, 1.0, [(2, 0.1)], "llm"),
        Task("llm.r0.s1.F1", 1, 1.0, [(3, 0.1)], "llm"),
        Task("llm.r0.s1.BW0", 1, 2.0, [(4, 0.0)], "llm", "BW"),
        Task("llm.r0.s1.BW1", 1, 2.0, [(5, 0.0)], "llm", "BW"),
        Task("llm.r0.s0.B0", 0, 1.0, [(6, 0.1)], "llm", "B", mem_delta=-(2**31)),
        Task("llm.r0.s0.B1", 0, 1.0, [(7, 0.1)], "llm", "B", mem_delta=-(2**31)),
        Task("llm.r0.s0.W0", 0, 0.5, [(8, 0.0)], "llm", "W"),
        Task("llm.r0.s0.W1", 0, 0.5, [(9, 0.0)], "llm", "W"),
        Task("vision.r0.s0.W0", 0, 0.3, [(8, 0.0)], "vision", "W", mem_delta=-(2**30)),
        Task("vision.r0.s0.W1", 0, 0.3, [(9, 0.0)], "vision", "W", mem_delta=-(2**30)),
        Task("llm.r0.s1.allreduce", 1, 0.4, [(7, 0.0)], "llm", "C"),
        Task("llm.r0.s0.allreduce", 0, 0.4, [(11, 0.0)], "llm", "C"),
    ]
    return replay(tasks, {0: [0, 1, 2, 3, 8, 12, 9, 13, 10, 11], 1: [4, 5, 6, 7]}, {0: [15], 1: [14]})


def test_task_names_parse_into_fields() -> None:
    assert parse_task_name("llm.r2.s1.BW17") == {"module": "llm", "replica": 2, "chunk": 1, "kind": "BW",
                                                 "microbatch": 17, "sub": None}
    assert parse_task_name("vision.r0.s1.F3.1")["sub"] == 1
    assert parse_task_name("llm.r0.s0.allreduce") == {}


def test_chrome_trace_schema(tmp_path) -> None:
    tl = two_stage_timeline()
    path = tmp_path / "t.json"
    to_chrome_trace(tl, path, title="two stages")
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_name = {t.name: (i, t) for i, t in enumerate(tl.tasks)}
    assert Counter(e["name"] for e in spans) == Counter(t.name for t in tl.tasks)  # every task once
    for e in spans:
        i, task = by_name[e["name"]]
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"}
        assert e["dur"] == pytest.approx(task.duration * 1e6)
        assert e["ts"] == pytest.approx(tl.start[i] * 1e6)
        assert e["pid"] == task.rank and e["tid"] == (1 if task.kind == "C" else 0)
        assert e["args"]["module"] == task.module and e["args"]["kind"] == task.kind
        expected_mb = None if task.kind == "C" else int(task.name.rsplit(".", 1)[1].lstrip("FBW"))
        assert e["args"]["microbatch"] == expected_mb
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {(r, s) for r in (0, 1) for s in (0, 1)}
    assert {e["pid"] for e in spans} == set(tl.ranks)
    assert trace["otherData"]["iteration_s"] == tl.iteration_s
    assert "two stages" in trace["otherData"]["title"] and "bubble" in trace["otherData"]["title"]


def test_png_has_the_figure_size_and_draws_the_module_colours(tmp_path) -> None:
    tl = two_stage_timeline()
    path = tmp_path / "t.png"
    plot_timeline(tl, path, title="two stages", width=10)
    image = imread(path)
    w, h = figure_inches(2, 10)
    assert image.shape[:2] == (round(h * DPI), round(w * DPI)) == (240, 1000)
    pixels = {tuple(p) for p in (image[..., :3] * 255).round().astype(int).reshape(-1, 3)}
    for module, kind in (("llm", "F"), ("vision", "F"), ("llm", "BW"), ("llm", "C")):
        rgb = tuple(round(c * 255) for c in kind_colour(module, kind))
        assert rgb in pixels, (module, kind)


def test_figure_height_is_capped_for_many_ranks() -> None:
    assert figure_inches(64)[1] == MAX_HEIGHT_IN and figure_inches(1)[1] >= 2
    assert figure_inches(8)[1] < figure_inches(16)[1]


def test_colours_are_fixed_per_module_and_shaded_by_kind() -> None:
    assert module_colour("llm") != module_colour("vision") != module_colour("audio")
    assert module_colour("my_encoder") == module_colour("my_encoder")  # stable across runs
    f, b, w = (sum(kind_colour("llm", k)) for k in ("F", "B", "W"))
    assert b < f < w
    assert len(set(kind_colour("llm", "C"))) == 1  # collectives are grey


def test_summary_rows(tmp_path) -> None:
    tl = two_stage_timeline()
    rows = summary_rows(tl)
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[1]["busy_s"] == pytest.approx(6.0) and rows[1]["comm_s"] == pytest.approx(0.4)
    assert rows[1]["utilisation"] == pytest.approx(6.0 / tl.iteration_s)
    assert rows[0]["peak_mem_gib"] == pytest.approx(6.0) and rows[1]["peak_mem_gib"] == 0.0


def big_timeline(n_ranks: int = 64, per_rank: int = 156) -> Timeline:
    """About 10k tasks: vision + llm compute of all kinds, varied widths, one reduce per rank."""
    rng = np.random.default_rng(0)
    tasks, order, comm = [], {r: [] for r in range(n_ranks)}, {}
    kinds = ["F", "B", "W", "BW"]
    for r in range(n_ranks):
        for k in range(per_rank):
            module = "vision" if k % 5 == 0 else "llm"
            order[r].append(len(tasks))
            tasks.append(Task(f"{module}.r0.s{r}.{kinds[k % 4]}0.{k}", r, float(rng.uniform(1e-4, 3e-3)), [],
                              module, kinds[k % 4]))
        comm[r] = [len(tasks)]
        tasks.append(Task(f"llm.r0.s{r}.allreduce", r, 0.01, [(len(tasks) - 1, 0.0)], "llm", "C"))
    return replay(tasks, order, comm)


def test_ten_thousand_tasks_render_fast(tmp_path) -> None:
    plot_timeline(two_stage_timeline(), tmp_path / "warm.png")  # matplotlib's one-time font setup
    tl = big_timeline()
    assert len(tl.tasks) >= 10_000
    t0 = time.process_time()  # CPU time: steady when other processes share the machine
    plot_timeline(tl, tmp_path / "big.png", title="64 ranks")
    seconds = time.process_time() - t0
    image = imread(tmp_path / "big.png")
    assert image.shape[0] == round(MAX_HEIGHT_IN * DPI)
    assert seconds < 2.0, f"10k tasks took {seconds:.2f}s"
