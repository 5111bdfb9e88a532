"""What the memory-bound scenarios would reach with more device memory, or with activations offloaded.

(b), (c), (e) and (f) stay below their share-of-bound targets with plans that fit the device. For
each, on the scenario's iterations as `simulate.py` times them, this script simulates:

- harmonia's chosen plan (checked against the simulate benchmark's result it is read from);
- the same layouts keeping more activations (less recomputation, down to none), and for (c) the
  fastest plan found beyond the device (the LLM in an interleaved pipeline, its frozen weights
  gathered once per step): each one's share of the bound and its simulated peak over the
  scenario's iterations against the device (the planner also checks its heavier search batches,
  so a plan a little under the device here can still be rejected);
- for (b) and (f), whose LLM recomputes, and (e), whose vision encoder does, the recomputed
  blocks' activations offloaded to host memory instead, a what-if priced here and nowhere else
  (`HostOffload`): a share ``o`` of the recomputed work copies the activations those blocks would
  free out over the host link during the forward and back during the backward, each copy
  overlapped with its phase's compute, so

      F' = max(F, o x bytes / link)       B' = max(B, o x bytes / link) + (1 - o) x again

  (``again``: the recomputed blocks' forward; ``bytes``: what recomputation frees; ``link``: PCIe
  Gen5 x16, 64 GB/s per direction, at the device's achievable share of link bandwidth, unshared
  with the NIC traffic that also crosses it on DGX-style nodes, so an upper bound); the device
  peak is the recomputing plan's (the copies in flight not counted: a lower bound on memory);
- harmonia's search again with the device's memory raised to 141 GiB (an H200's; the H100's
  compute and bandwidths kept, so the lower bound is the same): its plan and share.

    python benchmarks/memory_limits.py [benchmarks/results/simulate-DATE.json]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table
from saved import save_table

from harmonia.plan.compare import averages
from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
from harmonia.plan.recipes import Candidate
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import search_plan
from harmonia.schedule.plan import Plan, parse_recompute
from harmonia.workload.cost import CostModel, PhaseTimes

ROOT = Path(__file__).resolve().parents[1]
HOST_LINK = 64e9
"""PCIe Gen5 x16, bytes/s per direction (H100 SXM's host interface)."""
GIB = 2**30
MORE_MEMORY = 141 * GIB
"""An H200's memory, for the search on H100s with more of it."""


@dataclass(frozen=True)
class Variant:
    """A plan to simulate: its layouts, microbatches per LLM replica, recomputation and offload share."""

    label: str
    layouts: str
    microbatches: int
    recompute: tuple[str, ...] = ()
    offload: float = 0.0
    offloaded: str = "llm"


CHOSEN = {
    "b-qwen72b-omni-256gpu": Variant("harmonia's plan", "vision tp2 pp1 dp128 fsdp; audio tp2 pp1 dp128 fsdp; "
                                     "llm tp2 pp1 dp128 fsdp reshard", 1, ("llm", "vision", "audio:0.5")),
    "c-llama70b-clip-64gpu": Variant("harmonia's plan", "vision tp1 pp1 dp64; llm tp1 pp1 dp64 fsdp reshard", 4),
    "e-qwen7b-internvit-longvideo-64gpu": Variant("harmonia's plan", "vision tp1 pp1 dp64; llm tp2 cp4 pp1 dp8 fsdp",
                                                  8, ("vision",)),
    "f-qwen32b-omni-dynamic-64gpu": Variant("harmonia's plan", "vision tp2 pp1 dp32 fsdp; audio tp2 pp1 dp32 fsdp; "
                                            "llm tp2 pp1 dp32 fsdp reshard", 1, ("llm", "vision")),
}
"""harmonia's plan per scenario in the simulate benchmark's results (checked against them)."""


def variants(key: str, chosen: Variant) -> list[Variant]:
    """The chosen plan and what it would take to go faster."""
    out = [chosen]
    if key.startswith("e-"):
        out += [replace(chosen, label=f"recompute vision:{f}", recompute=(f"vision:{f}",)) for f in (0.75, 0.5)]
        out.append(replace(chosen, label="no recompute", recompute=()))
        out += [replace(chosen, label=f"vision offload {o:.0%} of its recompute", offload=o, offloaded="vision")
                for o in (0.25, 0.5)]
    if key.startswith("c-"):
        fast = Variant("interleaved, weights gathered once", "vision tp1 pp1 dp64; llm tp1 pp4 v5 dp16 fsdp", 32)
        out += [fast, replace(fast, label="the same, recompute llm:0.1", recompute=("llm:0.1",))]
    if key.startswith(("b-", "f-")):
        out.append(replace(chosen, label="no recompute", recompute=()))
        out += [replace(chosen, label=f"llm offload {o:.0%} of its recompute", offload=o)
                for o in (0.25, 0.4, 0.5, 0.6, 0.75)]
    return out


class HostOffload(CostModel):
    """The cost model with a share of every recomputed unit's recomputation of one module replaced
    by copying its activations to host memory and back (module docstring); a what-if only."""

    def __init__(self, base: CostModel, module: str, share: float, link: float) -> None:
        super().__init__(base.mllm, base.device, base.calibration, base.act_bytes, base.sequence_parallel,
                         base.fsdp_per_microbatch)
        self.module, self.share, self.link = module, share, link

    def unit_cost(self, module, load, start, stop, tp=1, cp=1, recompute=0.0, proj_load=None):
        times, flops, act, transient, f_transient = super().unit_cost(module, load, start, stop, tp, cp, recompute,
                                                                      proj_load)
        if module != self.module or not recompute:
            return times, flops, act, transient, f_transient
        plain, _, kept, _, _ = super().unit_cost(module, load, start, stop, tp, cp, 0.0, proj_load)
        again = times.B - plain.B
        copy = self.share * (kept - act) / self.link
        return (PhaseTimes(max(plain.F, copy), max(plain.B, copy) + (1 - self.share) * again, times.W),
                flops, act, transient, f_transient)


def simulate(run: ScenarioRun, v: Variant) -> tuple[float, float]:
    """(iteration seconds, peak GiB) of a variant over the scenario's iterations."""
    layouts = parse_layouts(v.layouts)
    sc = run.scenario
    modules, shares = parse_recompute(list(v.recompute))
    plan: Plan = plan_from_layouts(run.mllm, sc.model, layouts, run.cluster.world_size, sc.global_batch,
                                   microbatch_size=sc.global_batch // (layouts["llm"].dp * v.microbatches),
                                   recompute=modules)
    if shares:
        plan = replace(plan, recompute_fraction=shares)
    base = run.cost
    if v.offload:
        run.cost = HostOffload(base, v.offloaded, v.offload, HOST_LINK * run.cluster.device.bw_efficiency)
    try:
        result = averages(run, Candidate("harmonia", plan))
    finally:
        run.cost = base
    return result.iteration_s, result.peak_bytes / GIB


def with_more_memory(scenario: Scenario) -> tuple[str, float, float]:
    """harmonia's plan searched on the scenario's devices with `MORE_MEMORY`: (its layouts,
    iteration seconds, peak GiB)."""
    bigger = replace(scenario, device={**(scenario.device or {}), "mem_bytes": MORE_MEMORY})
    best = search_plan(bigger).ranked[0][2]
    result = averages(ScenarioRun(bigger), best)
    plan = best.plan
    text = "; ".join(f"{m} {lay.describe()}" for m, lay in plan.layouts.items())
    text += f"; {plan.n_microbatches} mb" + (f"; recompute {','.join(plan.recompute_text())}" if plan.recompute else "")
    return text, result.iteration_s, result.peak_bytes / GIB


def main(argv: list[str]) -> int:
    results = Path(argv[0]) if argv else max((ROOT / "benchmarks" / "results").glob("simulate-20*-[0-9][0-9].json"))
    summary = json.loads(results.read_text())
    console = Console(record=True, width=160)
    table = Table(title=f"what memory holds back (plans of {results.name}; peaks over the scenario's iterations, "
                  "which the planner's heavier search batches exceed)")
    for col in ("scenario", "plan", "layouts", "iteration s", "bound / time", "peak GiB", "within the device"):
        table.add_column(col, justify="left" if col in ("scenario", "plan", "layouts") else "right")
    for key, chosen in CHOSEN.items():
        scenario = Scenario.load(ROOT / "configs" / "scenarios" / f"{key}.toml")
        run = ScenarioRun(scenario)
        entry = summary[scenario.name]
        for v in variants(key, chosen):
            seconds, peak = simulate(run, v)
            if v is chosen:
                assert abs(seconds / entry["harmonia"]["iteration_s"] - 1) < 1e-6, f"{key}: not the benchmark's plan"
            table.add_row(key.split("-")[0], v.label, f"{v.layouts}; {v.microbatches} mb"
                          + (f"; recompute {','.join(v.recompute)}" if v.recompute else ""),
                          f"{seconds:.3f}", f"{entry['lower_bound_s'] / seconds:.1%}", f"{peak:.1f}",
                          "yes" if peak * GIB <= run.cluster.device.mem_bytes else "no")
            console.print(f"{key}: {v.label} {seconds:.3f} s, {entry['lower_bound_s'] / seconds:.1%}, {peak:.1f} GiB",
                          highlight=False)
        text, seconds, peak = with_more_memory(scenario)
        table.add_row(key.split("-")[0], f"searched with {MORE_MEMORY / GIB:.0f} GiB", text, f"{seconds:.3f}",
                      f"{entry['lower_bound_s'] / seconds:.1%}", f"{peak:.1f}", f"{MORE_MEMORY / GIB:.0f} GiB")
        console.print(f"{key}: {MORE_MEMORY / GIB:.0f} GiB {text} {seconds:.3f} s, "
                      f"{entry['lower_bound_s'] / seconds:.1%}, {peak:.1f} GiB", highlight=False)
    console.print(table)
    save_table(console, "memory-limits")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
