"""Simulator time and memory against GPUs (64 -> 4,096): the lockstep replay beside the whole replay.

One iteration of a given layout, scaled with the cluster, for an LLM-only model and two multimodal
ones:

- ``llama3-70b``, 8k-token sequences, one per microbatch: ``tp8 cp2 pp8 v5`` (``cp1`` on 64 GPUs),
  ``dp`` filling the cluster, 32 microbatches per replica (the layout of the largest published
  Llama runs, as `harmonia simulate --layout` takes it);
- ``llava-siglip-8b`` on ai2d, colocated: ``vision tp4 dp N/4; llm tp4 pp2 v4 dp N/8 fsdp``, 4
  microbatches per replica (what `harmonia plan` picks on 1,024 GPUs);
- ``omni-72b`` on the synthetic mix, colocated with ``vision tp1`` (InternViT-6B's 25 heads split
  no further): every rank holds an encoder replica of its own, so no two ranks run in lockstep and
  the replay runs every rank, the simulator's worst case.

Each cell runs in a fresh process: ``prepare s`` loads the scenario and builds the iteration's stage
work and schedule (the same for both replays); ``lockstep s`` replays one representative per group
of ranks in lockstep (`harmonia.sim.lockstep`, what `harmonia simulate` and the planner run),
``whole s`` every rank; ``peak MiB`` is the process's peak resident memory, scenario included.
``same`` says whether both replays give the same iteration time, per-rank peaks and busy seconds.
Seconds are process CPU time (the machine is shared); the whole replay runs up to ``--whole-up-to``
GPUs.

    python benchmarks/sim_scale.py [--gpus 64,128,...] [--whole-up-to 1024]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table
from saved import save_table

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
GPUS = (64, 128, 256, 512, 1024, 2048, 4096)


def llama(gpus: int) -> tuple[str, str, str, int, str]:
    cp = 1 if gpus < 128 else 2
    dp = gpus // (8 * cp * 8)
    return "llama3-70b", "text:8192", f"llm tp8 cp{cp} pp8 v5 dp{dp}", 32 * dp, "dense LLM, TP x CP groups in lockstep"


def llava(gpus: int) -> tuple[str, str, str, int, str]:
    return ("llava-siglip-8b", str(TRACES / "ai2d.csv"), f"vision tp4 pp1 dp{gpus // 4}; llm tp4 pp2 v4 dp{gpus // 8} "
            "fsdp", 4 * (gpus // 8), "colocated, encoder TP groups inside the LLM's")


def omni(gpus: int) -> tuple[str, str, str, int, str]:
    return ("omni-72b", "synthetic", f"vision tp1 pp1 dp{gpus}; audio tp4 pp1 dp{gpus // 4}; llm tp8 pp8 "
            f"dp{gpus // 64}", 4 * (gpus // 64) * 8, "colocated, an encoder replica per rank: none in lockstep")


MODELS = {"llama3-70b": llama, "llava-siglip-8b": llava, "omni-72b": omni}


def measure(model: str, gpus: int, lockstep: bool) -> dict:
    """One cell, in this (fresh) process: prepare, replay once, report CPU seconds and peak memory."""
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
    from harmonia.plan.recipes import Candidate, candidate_schedule
    from harmonia.plan.scenario import Scenario, ScenarioRun
    from harmonia.sim.tasks import simulate_schedule

    name, trace, text, batch, _ = MODELS[model](gpus)
    t0 = time.process_time()
    run = ScenarioRun(Scenario("sim-scale", name, f"h100:{gpus // 8}x8", trace, batch, iterations=1,
                               search_batches=1, memory_batches=0))
    training = {m: t.mode.value for m, t in run.mllm.training.items()}
    plan = plan_from_layouts(run.mllm, name, parse_layouts(text), gpus, batch, training=training)
    cand = Candidate("harmonia", plan)
    iw = run.iteration_work(cand, 0)
    schedule = candidate_schedule(cand, run.cost, iw)
    t1 = time.process_time()
    timeline = simulate_schedule(plan, run.cost, run.cluster, iw, schedule, lockstep=lockstep)
    t2 = time.process_time()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux counts KiB
    return {"prepare_s": t1 - t0, "replay_s": t2 - t1, "peak_mib": peak_mib,
            "replayed": len({t.rank for t in timeline.replayed}), "tasks": len(timeline.replayed),
            "iteration_s": timeline.iteration_s, "peaks": timeline.peak_mem, "busy": timeline.busy_s, "layout": text}


def fresh(model: str, gpus: int, lockstep: bool) -> dict:
    """`measure` in a fresh process (so no cache or memory of another cell counts)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, model, gpus, lockstep).result()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default=",".join(map(str, GPUS)), help="cluster sizes, comma-separated")
    parser.add_argument("--models", default=",".join(MODELS), help="models, comma-separated")
    parser.add_argument("--whole-up-to", type=int, default=1024, help="largest cluster the whole replay runs on")
    args = parser.parse_args(argv)
    console = Console(record=True, width=200)
    table = Table(title="one simulated iteration against GPUs: lockstep replay vs whole replay (CPU seconds on one "
                        "core, peak resident MiB of the process)")
    for col in ("model", "GPUs", "layout", "ranks replayed", "tasks replayed", "prepare s", "lockstep s",
                "lockstep MiB", "whole s", "whole MiB", "speed-up", "same"):
        table.add_column(col, justify="left" if col in ("model", "layout") else "right")
    for model in args.models.split(","):
        for gpus in map(int, args.gpus.split(",")):
            fast = fresh(model, gpus, True)
            whole = fresh(model, gpus, False) if gpus <= args.whole_up_to else None
            alike = whole is not None and all(fast[k] == whole[k] for k in ("iteration_s", "peaks", "busy"))
            same = "-" if whole is None else "yes" if alike else "NO"
            table.add_row(model, str(gpus), fast["layout"], f"{fast['replayed']} / {gpus}", f"{fast['tasks']:,}",
                          f"{fast['prepare_s']:.1f}", f"{fast['replay_s']:.2f}", f"{fast['peak_mib']:.0f}",
                          "-" if whole is None else f"{whole['replay_s']:.2f}",
                          "-" if whole is None else f"{whole['peak_mib']:.0f}",
                          "-" if whole is None else f"{whole['replay_s'] / fast['replay_s']:.1f}x", same)
            console.print(f"{model} on {gpus} GPUs: lockstep {fast['replay_s']:.2f} s"
                          + ("" if whole is None else f", whole {whole['replay_s']:.2f} s"), highlight=False)
    console.print(table)
    console.print("targets: any given layout on up to 1,024 GPUs simulates in <= 10 s and 2 GB (one iteration, "
                  "scenario and schedule included: prepare + lockstep); the lockstep replay grows with the ranks "
                  "it replays, not with the GPUs")
    save_table(console, "sim-scale")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
