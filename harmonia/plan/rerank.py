"""Re-ranking a plan search's best plans: the same layout split evenly, or without features the
runtime pays for beyond their price, or with more memory to spare, goes first where it simulates
(nearly) as fast (`harmonia.plan.search`'s module docstring says when)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from harmonia.errors import HarmoniaError
from harmonia.plan.candidates import even_split
from harmonia.plan.recipes import MEMORY_HEADROOM, Candidate
from harmonia.plan.scenario import ScenarioRun
from harmonia.plan.search_keys import simulation_key
from harmonia.schedule.plan import Plan


class Scorer(Protocol):
    """What re-ranking asks of the search's scorer (`harmonia.plan.search._Scorer`)."""

    run: ScenarioRun
    batches: list[int]

    def simulate(self, cand: Candidate, key: tuple, j: int) -> float: ...

    def over_memory(self, key: tuple) -> str | None: ...

    def heavier_batches_over(self, cand: Candidate, key: tuple) -> str | None: ...


def even_split_first(scorer: Scorer, ranked: list[tuple[float, float, Candidate]],
                      top: int) -> tuple[list[tuple[float, float, Candidate]], int]:
    """The ranked plans with the best one's LLM split evenly ranked first where that differs and is
    faster on every search batch together (see the module docstring); and 1 if it was simulated."""
    best = ranked[0][2]
    even = even_split(scorer.run.cost, "llm", best.plan.layouts["llm"])
    if even is None:
        return ranked, 0
    twin = replace(best, plan=replace(best.plan, layouts={**best.plan.layouts, "llm": even}))
    score = twin_score(scorer, twin, lambda t: t < ranked[0][0])
    if score is None:
        return ranked, 1
    return [(score, scorer.run.scenario.global_batch / score, twin), *ranked][:top], 1


def twin_score(scorer: Scorer, twin: Candidate, fast_enough: Callable[[float], bool]) -> float | None:
    """A ranked plan's twin's mean simulated seconds over the search batches; None where it cannot
    be scheduled, is not ``fast_enough``, or exceeds device memory on a search batch or (checked
    last, the dearest) a heavier one."""
    key = simulation_key(twin, scorer.run.cost)
    try:
        score = sum(scorer.simulate(twin, key, j) for j in range(len(scorer.batches))) / len(scorer.batches)
    except HarmoniaError:
        return None
    if scorer.over_memory(key) or not fast_enough(score) or scorer.heavier_batches_over(twin, key):
        return None
    return score


PLAINER_TOLERANCE = 0.02
"""How much slower than the best plan its plainer twin (`plainer_first`) may simulate and still be
picked: FSDP and zero-bubble's split backward cost the runtime per-step work the simulator prices
as free or does not see (FSDP2's per-unit hooks and gathers; a second autograd pass for W, priced
on the CPU since by `DeviceSpec.split_backward_s`, not on accelerators). Measured
in `benchmarks/pick.py` (pick-2026-11-28): at LLM pp1, the zero-bubble pick ran 0.70-0.83x the
samples/s of the same plan under 1F1B, and LLM FSDP on 4 CPU ranks 0.56-0.77x of plain data
parallelism, where the search scored them within 1% of each other."""


def plainer(plan: Plan) -> list[Plan]:
    """The plan without FSDP and with 1F1B for zero-bubble (both first, then each alone), where it has
    them: what the same layout runs without features the runtime pays for beyond their price."""
    no_fsdp = {m: replace(lay, fsdp=False, reshard=False) for m, lay in plan.layouts.items()}
    sharded = no_fsdp != plan.layouts
    zb = plan.schedule == "zb"
    forms = [(sharded, zb), (sharded, False), (False, zb)] if sharded and zb else [(sharded, zb)]
    return [replace(plan, layouts=no_fsdp if drop_fsdp else plan.layouts, schedule="1f1b" if to_1f1b else plan.schedule)
            for drop_fsdp, to_1f1b in forms if drop_fsdp or to_1f1b]


def plainer_first(scorer: Scorer, ranked: list[tuple[float, float, Candidate]], top: int,
                   accept: Callable[[Plan], str | None] | None) -> tuple[list[tuple[float, float, Candidate]], int]:
    """The ranked plans with the best one's plainer twin (`plainer`) ranked first where it is
    accepted, fits memory on every batch and simulates at most `PLAINER_TOLERANCE` slower; and the
    twins simulated."""
    best_score, _, best = ranked[0]
    tried = 0
    for plan in plainer(best.plan):
        if accept is not None and accept(plan) is not None:
            continue
        twin = replace(best, plan=plan)
        tried += 1
        score = twin_score(scorer, twin, lambda t: t <= best_score * (1 + PLAINER_TOLERANCE))
        if score is None:
            continue
        key = simulation_key(twin, scorer.run.cost)
        rest = [r for r in ranked if simulation_key(r[2], scorer.run.cost) != key]
        return [(score, scorer.run.scenario.global_batch / score, twin), *rest][:top], tried
    return ranked, tried


def roomier_first(ranked: list[tuple[float, float, Candidate]], peaks: list[float],
                   capacity: float) -> list[tuple[float, float, Candidate]]:
    """The ranked plans with the first one whose peak is within `MEMORY_HEADROOM` of the device's
    memory moved to the front, where the best's is not and it simulates at most `PLAINER_TOLERANCE`
    slower: the planner's peak estimate is not exact (on an H200 a 2B LLaVA's step peaked 9.6% above it,
    benchmarks/results/gpu-check-2026-11-28.txt), so a plan within a few percent of the device may
    not start, and a percent of speed does not pay for that."""
    room = capacity * MEMORY_HEADROOM
    if not ranked or peaks[0] <= room:
        return ranked
    best = ranked[0][0]
    for i in range(1, len(ranked)):
        if peaks[i] <= room and ranked[i][0] <= best * (1 + PLAINER_TOLERANCE):
            return [ranked[i], *ranked[:i], *ranked[i + 1:]]
    return ranked
