"""Timelines: Chrome trace schema, PNG output, speed on large replays."""

import json

from matplotlib.image import imread

from harmonia.sim.engine import Task, replay
from harmonia.sim.timeline import plot_timeline, summary_rows, to_chrome_trace


def small_timeline():
    tasks = [Task("llm.r0.s0.F0.0", 0, 1.0, module="llm"), Task("llm.r0.s1.F0.0", 1, 1.0, [(0, 0.1)], module="llm"),
             Task("llm.r0.s1.BW0.0", 1, 2.0, [(1, 0)], "llm", "BW"),
             Task("vision.r0.s0.W0.0", 0, 0.5, [(2, 0.1)], "vision", "W"),
             Task("llm.r0.s0.allreduce", 0, 0.3, [(3, 0)], "llm", "C")]
    return replay(tasks, {0: [0, 3], 1: [1, 2]}, {0: [4]})


def test_chrome_trace_schema(tmp_path) -> None:
    tl = small_timeline()
    path = tmp_path / "t.json"
    to_chrome_trace(tl, path, title="x")
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == sorted(t.name for t in tl.tasks)
    for e in spans:
        i = next(k for k, t in enumerate(tl.tasks) if t.name == e["name"])
        assert abs(e["dur"] - tl.tasks[i].duration * 1e6) < 1e-6 and e["pid"] == tl.tasks[i].rank
        assert e["tid"] == (1 if tl.tasks[i].kind == "C" else 0)
    assert trace["otherData"]["iteration_s"] == tl.iteration_s


def test_png_and_summary(tmp_path) -> None:
    tl = small_timeline()
    path = tmp_path / "t.png"
    plot_timeline(tl, path, title="two stages", width=10)
    image = imread(path)
    assert image.shape[1] == 1000 and image.shape[0] > 100
    rows = summary_rows(tl)
    assert [r["rank"] for r in rows] == [0, 1] and 0 < rows[1]["utilisation"] <= 1


def test_ten_thousand_tasks_render(tmp_path) -> None:
    tasks, order = [], {r: [] for r in range(64)}
    for r in range(64):
        for k in range(160):
            order[r].append(len(tasks))
            tasks.append(Task(f"llm.r0.s{r}.F0.{k}", r, 1e-3, module="llm"))
    tl = replay(tasks, order)
    plot_timeline(tl, tmp_path / "big.png")
    assert imread(tmp_path / "big.png").shape[0] <= 18 * 100
