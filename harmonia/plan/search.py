"""`harmonia plan`: one static layout from batch-level profiling, scored by the simulator.

Candidates are harmonia's own (disjoint rank sets sized by work share and colocated encoders,
every LLM factorisation that fits memory, frozen-aware stage splits, 1F1B or zero-bubble). A
candidate's score is its simulated iteration time averaged over the ``K`` profiled search batches.

The search is best-first branch and bound over (candidate, batch) simulations
(`harmonia.plan.branch_bound`), and finds the same best plan as simulating every candidate on every
batch:

- every candidate has, per batch ``k``, a lower bound ``b_k`` on its simulated time, computed
  without simulating and raised in steps, each dearer and tighter than the one before: the
  compute-only `lower_bound_s` (all candidates, microseconds each), then
  `harmonia.plan.bounds.plan_bound` (compute, TP/CP collectives, FSDP gathers and the DP gradient
  reduction of the busiest rank), then the largest stage-work bound found for a twin recomputing
  no more of any module (`_Scorer.twin_bound`), then the bound of the batch's actual stage work
  (`work_bound`) over each module's heaviest replicas and those sharing their ranks
  (`harmonia.plan.heavy_replicas`: a bound still, without pricing every unit of a large cluster),
  then the simulated time of the busiest part's busiest column (one LLM rank per pipeline rank,
  messages from outside it free: every task starts no later than in the whole simulation; replayed
  on its LLM replica's units alone, the schedule ordered by every replica's times,
  `harmonia.schedule.stagework.llm_replicas_work`), then
  of the batch's busiest independent part, then of all (parts are sets of ranks no message or
  lockstep crosses, `harmonia.sim.parts`: the busiest part's simulated time bounds the iteration's, and the
  longest of all is the iteration's simulated time);
- a candidate's bound on its score is ``mean_k (t_k if batch k is simulated else b_k)``; it only
  rises as its batches are refined, and equals the score once all are simulated;
- the candidate with the smallest bound is refined next: its least refined batch goes one step
  up. When the candidate popped has every batch simulated, its score is at most every other
  candidate's bound, hence at most every other score: it is the best. Popping on gives the next
  best, up to ``top``.

So a layout whose first simulated batch (or a part of it) already exceeds the best score is never
simulated further,
one whose bound exceeds it is never simulated at all, and one whose compute-only bound exceeds it
is never bounded further. Plans the simulator cannot tell apart
(zero-bubble where no stage has both an input and a weight gradient: it runs as 1F1B) share one
simulation.

The frozen-aware stage split evens out compute alone; where messages decide (the last stage sends
nothing on) the even split every baseline uses can simulate faster. So when harmonia's best plan
splits the LLM unevenly, the same plan split evenly is simulated too and ranked first if faster:
harmonia's plan is never slower than its own layout under the baselines' split. Likewise, where the
best plan runs FSDP or zero-bubble, the same plan without them is simulated too and ranked first
unless it is more than `harmonia.plan.rerank.PLAINER_TOLERANCE` slower or does not fit: the runtime pays for both
beyond what they are priced (measured in `benchmarks/pick.py`). And where the best plan's peak is
above `MEMORY_HEADROOM` of the device's memory, the first ranked plan within the same tolerance
whose peak is not goes first (`harmonia.plan.rerank.roomier_first`): the memory estimate is not exact.

Memory is checked twice. Before scoring, every candidate's estimated peak on every rank (states
of every module, activations of the microbatches its schedule keeps in flight:
`harmonia.plan.memory`) must fit the device with headroom. While scoring, a candidate is rejected
as soon as its peak on some rank exceeds the device memory (counted under one reason): first the
floor its stage work alone shows (`harmonia.plan.memory.work_peak_floor`: states plus one unit's
activations), then, once a batch's schedule is built and before it is timed, the peak of its
stages' states plus the activations each rank holds in its order (`harmonia.sim.memory`: the
simulation's own peak); for every recipe, baselines included. A plan timed on a few batches meets
heavier ones when it trains, so before a candidate is ranked it must also fit the scenario's
memory batches (further profiled batches, never scored for time): the floor of its peak on each,
and the scheduled peak of the one whose floor is highest. The report gives each ranked plan's peak
bytes on one rank over all of these.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import islice

from harmonia.errors import LayoutError
from harmonia.plan.bounds import plan_bound, work_bound_busy
from harmonia.plan.branch_bound import branch_and_bound
from harmonia.plan.candidates import lower_bound_s, state_bytes_per_rank
from harmonia.plan.heavy_replicas import HEAVIEST, heaviest_replicas
from harmonia.plan.infeasible import no_layout_error
from harmonia.plan.memory import work_peak_floor
from harmonia.plan.recipes import (Candidate, assign, assignment_key, candidate_schedule, candidates,
                                   homogeneous_candidates)
from harmonia.plan.rerank import even_split_first, plainer_first, roomier_first
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search_keys import family_key, layouts_key, recompute_shares, simulation_key
from harmonia.schedule.graph import LLM, IterationSchedule
from harmonia.schedule.iteration import IterationAssignment
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, llm_replicas_work, plan_iteration_work
from harmonia.sim.memory import activation_peaks, input_bytes
from harmonia.sim.parts import busiest_column, independent_parts, simulate_part
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec
from harmonia.workload.shapes import SampleShape


@dataclass
class PlanReport:
    """The chosen plan, the ranked candidates and why others were dropped.

    Attributes:
        best: the first ranked plan: the fastest simulated, or one within `PLAINER_TOLERANCE` of it
            that is plainer or leaves more memory free.
        ranked: the ``top`` best candidates, best first, as (iteration s, samples/s, candidate).
        peak_bytes: per ranked candidate, the most bytes one rank holds in its simulations:
            weights, gradients and optimizer states of its stages plus its activation peak.
        rejected: reasons candidates were dropped (memory, an ``accept`` filter, a schedule error).
        simulated: candidates simulated on at least one batch.
        pruned: candidates never simulated (their lower bound exceeded the scores ranked).
        timelines: single-batch simulations run (``simulated * batches`` at most).
        seconds: wall-clock time of the search.
        workers: processes that refined candidates (`harmonia.plan.refiners`; 1: this one alone).
    """

    best: Plan
    ranked: list[tuple[float, float, Candidate]]
    peak_bytes: list[float] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)
    simulated: int = 0
    pruned: int = 0
    timelines: int = 0
    seconds: float = 0.0
    workers: int = 1


@contextlib.contextmanager
def _few_collections():
    """Run the search with the cyclic garbage collector off: it allocates millions of short-lived
    actions and tasks and keeps large caches, none in reference cycles that matter (reference
    counting frees them), and the collector's passes over them cost a tenth of its time, most
    right after each replay (`harmonia.sim.tasks.simulate_ranks` turns it off and on again).
    Measured on 1,024 GPUs (omni-72b): 340 objects in cycles left when the search ends, the same
    peak memory; the collector takes them once it is on again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def search_plan(scenario: Scenario, top: int = 1, accept: Callable[[Plan], str | None] | None = None,
                samples: list[SampleShape] | None = None, homogeneous: bool = False,
                recipe: str = "harmonia", workers: int = 1) -> PlanReport:
    """Search a recipe's candidates (harmonia's by default) for a scenario.

    Args:
        top: candidates ranked exactly (each one further costs the simulations of the candidates
            whose bound is below its score).
        accept: optional filter: returns None for a plan the caller can run, else the reason it
            cannot (counted in ``rejected``), e.g. a runtime that supports only some layouts.
        samples: sample shapes to profile instead of the scenario's trace (a dataset's own).
        homogeneous: search only plans with one layout for all modules (each encoder on the LLM's
            first pipeline stage with the LLM's tp and dp), the baseline per-module layouts beat.
        recipe: whose rules the candidates follow (`harmonia.plan.recipes.RECIPES`); the bounds hold
            for every recipe, so each baseline also gets the best layout its rules allow.
        workers: processes refining candidates at once once the search has run a while
            (`harmonia.plan.refiners`); the ranking is the same for any number.

    Raises:
        LayoutError: when no candidate fits the devices' memory (naming the smallest device count on
            which one does), or no layout factorises the world size with every replica fed by the
            global batch (naming the smallest global batch and the largest world size that work).
    """
    with _few_collections():
        return _search(scenario, top, accept, samples, homogeneous, recipe, workers)


def _search(scenario: Scenario, top: int, accept: Callable[[Plan], str | None] | None,
            samples: list[SampleShape] | None, homogeneous: bool, recipe: str, workers: int) -> PlanReport:
    t0 = time.perf_counter()
    run = ScenarioRun(scenario, samples)

    def enumerate_(cluster: ClusterSpec, global_batch: int, rejected: Counter | None) -> Iterator[Candidate]:
        args = (run.cost, cluster, run.profile, global_batch, scenario.model, rejected)
        found = homogeneous_candidates(*args) if homogeneous else candidates(recipe, *args)
        for c in found:
            reason = None if accept is None else accept(c.plan)
            if reason is None:
                yield c
            elif rejected is not None:
                rejected[reason] += 1

    rejected: Counter = Counter()
    cands = _distinct(enumerate_(run.cluster, scenario.global_batch, rejected), run.cost)
    if not cands:
        raise no_layout_error(run, enumerate_, rejected, "homogeneous layout" if homogeneous else "layout")
    batches = list(range(scenario.iterations, scenario.iterations + scenario.search_batches))
    scorer = _Scorer(run, batches)
    ranked, simulated, used = branch_and_bound(scorer, cands, batches, top, rejected, workers)
    twins = 0  # even-split twins of the ranked plans, each simulated: candidates of their own
    if recipe == "harmonia" and ranked:
        ranked, twins = even_split_first(scorer, ranked, top)
        ranked, plainer = plainer_first(scorer, ranked, top, accept)
        twins += plainer
        simulated += twins
        ranked = roomier_first(ranked, [scorer.peak_bytes[simulation_key(c, run.cost)] for _, _, c in ranked],
                                run.cluster.device.mem_bytes)
    if not ranked:
        memory = sum(n for why, n in rejected.items() if why.startswith("memory"))
        raise LayoutError(f"no plan fits: none of the {len(cands)} candidate layouts of {scenario.model} on "
                          f"{scenario.cluster} could be scheduled within device memory ({memory} over memory "
                          f"when simulated; {dict(rejected)}); use more devices or a smaller global batch")
    peaks = [scorer.peak_bytes[simulation_key(c, run.cost)] for _, _, c in ranked]
    return PlanReport(ranked[0][2].plan, ranked, peaks, rejected, simulated, len(cands) + twins - simulated,
                      scorer.timelines, time.perf_counter() - t0, used)


def _distinct(found: Iterator[Candidate], cost: CostModel) -> list[Candidate]:
    """The first of each set of candidates that simulate alike (`simulation_key`): several rules
    reach the same plan (a colocated encoder with the LLM's tp is also the one-layout plan), and a
    zero-bubble plan whose stages split no backward runs as its 1F1B twin."""
    out: dict[tuple, Candidate] = {}
    for cand in found:
        out.setdefault(simulation_key(cand, cost), cand)
    return list(out.values())


class _Scorer:
    """The levels of a candidate's value on a search batch, with the work they share cached:
    the recipe's assignment per (assignment key, batch) and the last iterations' stage work,
    which depends on the layouts and the assignment but not on the schedule (a 1F1B candidate and
    its zero-bubble twin share it)."""

    def __init__(self, run: ScenarioRun, batches: list[int], keep: int | None = None) -> None:
        """``keep``: iterations' stage work kept (default: more the fewer ranks, 16 from 1,024 GPUs)."""
        self.run, self.batches = run, batches
        self.keep = keep if keep is not None else max(16, 16384 // run.cluster.world_size)
        self.assignments: dict[tuple, IterationAssignment] = {}
        self._akeys: dict[int, tuple[Candidate, tuple]] = {}  # id(candidate) -> (it, its `assignment_key`)
        self.kept: dict[int, dict] = {}  # batch -> what its assignments share (`assign`'s ``kept``)
        self.work_cache: dict[tuple, IterationWork] = {}
        self.peak_bytes: dict[tuple, float] = {}  # simulation key -> most bytes on one rank so far
        self.parts: dict[tuple, _Parts] = {}  # (simulation key, batch) -> its parts being simulated
        self.work_bounds: dict[tuple, list] = {}  # (plan but recompute, batch) -> [(shares, work bound)]
        self.timelines = 0

    def compute_bound(self, cand: Candidate) -> list[float]:
        """Per batch, the compute-only bound (`lower_bound_s`)."""
        return [lower_bound_s(self.run.profile, cand.plan.layouts, [k]) for k in self.batches]

    def analytic(self, cand: Candidate, j: int) -> float:
        """The communication-aware bound of batch ``j`` (`plan_bound`)."""
        run = self.run
        return plan_bound(cand.plan, run.cost, run.cluster, run.profile, [self.batches[j]]).lower_s

    def _assignment(self, cand: Candidate, j: int) -> IterationAssignment:
        """The recipe's assignment of search batch ``j`` (kept: candidates with one `assignment_key`
        share it)."""
        return self._assignment_of(cand, self.batches[j])

    def _assignment_of(self, cand: Candidate, k: int) -> IterationAssignment:
        """The recipe's assignment of profiled batch ``k`` (kept, as `_assignment`)."""
        run = self.run
        akey = (*self._assignment_key(cand), k)
        if akey not in self.assignments:
            batch = run.profile.batches[k]
            self.assignments[akey] = assign(cand, run.costs[batch], run.tokens[batch], run.cost,
                                            [run.samples[i] for i in batch], self.kept.setdefault(k, {}))
        return self.assignments[akey]

    def assignments_since(self, n: int) -> dict[tuple, IterationAssignment]:
        """The assignments computed after the first ``n``, for another process's scorer (`absorb`):
        without their memo (the stage work this one derived from them)."""
        return {key: replace(a, memo={}) for key, a in islice(self.assignments.items(), n, None)}

    def absorb(self, assignments: dict[tuple, IterationAssignment]) -> None:
        """Keep assignments another process's scorer computed (`assignments_since`), as its own
        `_assignment_of` would have (sharing their batch's loads); those it has stay."""
        for akey, assignment in assignments.items():
            if akey not in self.assignments:  # a copy: the one given may go on to other processes as it is
                loads = self.kept.setdefault(akey[-1], {}).setdefault("batch loads", {})
                self.assignments[akey] = replace(assignment, memo={"batch loads": loads})

    def _assignment_key(self, cand: Candidate) -> tuple:
        """`assignment_key` of a candidate, computed once per candidate (its encoders' feeding lists
        hold a rank per replica: thousands on a large cluster)."""
        held, key = self._akeys.get(id(cand), (None, None))
        if held is not cand:  # kept with the candidate itself, so a reused id is not mistaken for it
            key = assignment_key(cand)
            self._akeys[id(cand)] = (cand, key)
        return key

    def _heaviest_work(self, cand: Candidate, j: int) -> IterationWork:
        """Batch ``j``'s stage work of the heaviest replicas alone (`heaviest_replicas`): what its
        bound is taken over (every replica's where those are all)."""
        run, batch = self.run, self.run.profile.batches[self.batches[j]]
        assignment = self._assignment(cand, j)
        replicas = heaviest_replicas(cand.plan, assignment, run.costs[batch], run.cost.modules)
        if replicas is None:
            return self._iteration(cand, j)
        return plan_iteration_work([run.samples[i] for i in batch], cand.plan, run.cost, assignment,
                                   replicas=replicas)

    def _work_key(self, cand: Candidate, j: int) -> tuple:
        """What batch ``j``'s whole stage work is kept under (candidates alike but for the schedule share it)."""
        plan = cand.plan
        return (cand.recipe, cand.fused, plan.placement.value, plan.n_microbatches, layouts_key(plan, self.run.cost),
                plan.recompute_key, j)

    def _iteration(self, cand: Candidate, j: int) -> IterationWork:
        plan = cand.plan
        wkey = self._work_key(cand, j)
        if wkey in self.work_cache:
            return self.work_cache[wkey]
        run = self.run
        batch = run.profile.batches[self.batches[j]]
        iw = plan_iteration_work([run.samples[i] for i in batch], plan, run.cost, self._assignment(cand, j))
        if len(self.work_cache) >= self.keep:
            self.work_cache.pop(next(iter(self.work_cache)))
        self.work_cache[wkey] = iw
        return iw

    def _column_iteration(self, cand: Candidate, j: int, column: tuple[int, ...]) -> IterationWork:
        """Batch ``j``'s stage work as a busiest column's replay reads it: the column's LLM replica's
        units and every encoder's (`llm_replicas_work`), where the LLM has more replicas than the
        heaviest few a bound prices; else (or where it is kept) the whole iteration's. Most columns
        end their candidate (1,076 columns and 62 busiest parts replayed on 4,096 GPUs)."""
        plan, run = cand.plan, self.run
        llm = plan.layouts[LLM]
        if llm.dp <= HEAVIEST or self._work_key(cand, j) in self.work_cache:
            return self._iteration(cand, j)
        batch = run.profile.batches[self.batches[j]]
        return llm_replicas_work([run.samples[i] for i in batch], plan, run.cost, self._assignment(cand, j),
                                 {llm.coords(column[0])["dp"]})

    def over_memory(self, key: tuple) -> str | None:
        """Why a candidate cannot run: its peak on some rank under a batch's schedule, or before
        scheduling the floor of its stage work's peak (`work_peak_floor`), exceeds the device
        (None if it fits)."""
        peak, capacity = self.peak_bytes.get(key, 0.0), self.run.cluster.device.mem_bytes
        if peak <= capacity:
            return None
        return f"memory: peak above the device's {capacity / 2**30:.0f} GiB"

    def _record(self, key: tuple, nbytes: float) -> None:
        """Raise a candidate's peak bytes on one rank to ``nbytes`` if that is more."""
        self.peak_bytes[key] = max(self.peak_bytes.get(key, 0.0), nbytes)

    def _record_schedule(self, key: tuple, plan: Plan, iw: IterationWork, schedule: IterationSchedule,
                         ranks: tuple[int, ...] | None = None) -> None:
        """Record the peak of a schedule of stage work on ``ranks`` (default: all): each rank's
        states plus its activation peak (`activation_peaks`: what simulating it would report,
        found from each rank's order alone) plus the encoder inputs it holds (`input_bytes`)."""
        states = state_bytes_per_rank(self.run.cost, plan)
        peaks = activation_peaks(plan, iw, schedule, ranks)
        inputs = input_bytes(self.run.cost.mllm, iw, ranks)
        self._record(key, max(states.get(r, 0.0) + peaks[r] + inputs.get(r, 0.0) for r in peaks))

    def heavier_batches_over(self, cand: Candidate, key: tuple) -> str | None:
        """Why a scored candidate cannot train on the scenario's memory batches (None if it can):
        the floor of its stage work's peak on each (`work_peak_floor`), then the scheduled peak
        of the one whose floor is highest; both count towards its peak bytes."""
        run = self.run
        first = run.scenario.iterations + run.scenario.search_batches
        works = [plan_iteration_work([run.samples[i] for i in run.profile.batches[k]], cand.plan, run.cost,
                                     self._assignment_of(cand, k))
                 for k in range(first, first + run.scenario.memory_batches)]
        if not works:
            return None
        floors = [max(work_peak_floor(run.cost, cand.plan, iw).values(), default=0.0) for iw in works]
        heaviest = works[floors.index(max(floors))]
        self._record(key, max(floors))
        if not self.over_memory(key):
            self._record_schedule(key, cand.plan, heaviest, candidate_schedule(cand, run.cost, heaviest))
        over = self.over_memory(key)
        return f"{over} on a heavier batch" if over else None

    def work(self, cand: Candidate, key: tuple, j: int) -> float:
        """The bound of batch ``j``'s actual stage work (`harmonia.plan.bounds.work_bound`) on its
        heaviest replicas (`_heaviest_work`); the iteration's independent parts are queued for
        simulation: the busiest part's busiest column, the busiest part, then the others together
        (one replay of a few ranks costs little beside building the schedule's lists), the parts
        ordered by the busy seconds of the ranks priced."""
        iw = self._heaviest_work(cand, j)
        self._record(key, max(work_peak_floor(self.run.cost, cand.plan, iw).values(), default=0.0))
        if self.over_memory(key):  # rejected unsimulated: its bound no longer matters
            return 0.0
        bound, busy = work_bound_busy(cand.plan, self.run.cost, self.run.cluster, iw)
        self.work_bounds.setdefault((family_key(cand, self.run.cost), j), []).append(
            (recompute_shares(cand.plan), bound))
        busiest, *rest = independent_parts(cand.plan, self.run.cost, iw, busy, self.run.cluster)
        self.parts[(key, j)] = _Parts([busiest, _union(rest)] if rest else [busiest],
                                      column=busiest_column(cand.plan, busiest, busy))
        return bound

    def twin_bound(self, cand: Candidate, j: int) -> float:
        """The largest work bound of batch ``j`` (`work`) found so far for a twin of the candidate
        that differs only in recomputing no more of any module (0 if none): a bound on the
        candidate's own. Recomputation changes only the backward, adding the recomputed blocks'
        forward and a pass of their collectives; every duration the work bound sums or takes the
        largest of (a phase's compute, its collectives, ``max(comm, compute + ...)`` where FSDP
        overlaps them) grows with the recomputed blocks, and both share the assignment and so the
        replicas bounded."""
        mine = recompute_shares(cand.plan)
        return max((bound for shares, bound in self.work_bounds.get((family_key(cand, self.run.cost), j), ())
                    if all(mine[m] >= s for m, s in shares.items())), default=0.0)

    def simulate_part(self, cand: Candidate, key: tuple, j: int) -> tuple[float, bool]:
        """Simulate batch ``j``'s next independent part, or first the busiest part's column (the
        balancer's order; no per-batch order search). Returns the longest part (or column) so far
        and whether every part is simulated: the iteration's simulated seconds
        (`harmonia.sim.parts`). The ranks' peak memory is recorded first: a plan over the devices'
        memory is not timed."""
        run = self.run
        if (key, j) not in self.parts:  # not bounded first: every part at once
            iw = self._iteration(cand, j)
            self.parts[(key, j)] = _Parts([_union(independent_parts(cand.plan, run.cost, iw, cluster=run.cluster))])
        parts = self.parts[(key, j)]
        column = parts.column
        iw = self._iteration(cand, j) if column is None else self._column_iteration(cand, j, column)
        if parts.schedule is None:  # the same from a column's work as from the whole (`llm_replicas_work`)
            self.timelines += 1
            parts.schedule = candidate_schedule(cand, run.cost, iw)
        ranks = parts.ranks[parts.done] if column is None else column
        self._record_schedule(key, cand.plan, iw, parts.schedule, ranks)
        if self.over_memory(key):  # a plan that cannot run is not timed
            return parts.seconds, False
        timeline = simulate_part(cand.plan, run.cost, run.cluster, iw, parts.schedule, ranks, closed=column is None)
        parts.seconds = max(parts.seconds, float(timeline.iteration_s))
        if column is not None:  # a bound on the busiest part's time: that part comes next
            parts.column = None
            return parts.seconds, False
        parts.done += 1
        whole = parts.done == len(parts.ranks)
        if whole:
            del self.parts[(key, j)]
        return parts.seconds, whole

    def simulate(self, cand: Candidate, key: tuple, j: int) -> float:
        """Simulated seconds of batch ``j``: every part not yet simulated (infinite for a plan that
        cannot fit the devices' memory)."""
        while True:
            seconds, whole = self.simulate_part(cand, key, j)
            if whole:
                return seconds
            if self.over_memory(key):
                return math.inf


def _union(parts: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Independent parts as one set of ranks (replayed together, each as it would alone)."""
    return tuple(sorted(r for p in parts for r in p))


@dataclass
class _Parts:
    """A candidate's simulation of one batch, one independent part at a time.

    Attributes:
        ranks: what is simulated, in turn: the busiest part, then the union of the others.
        done: parts simulated.
        seconds: the longest of them (or, before any, the busiest part's column's time).
        schedule: the schedule they run (built with the first simulation).
        column: the busiest part's busiest column (`busiest_column`), simulated before the parts;
            None once it is (or where the part has no fewer ranks).
    """

    ranks: list[tuple[int, ...]]
    done: int = 0
    seconds: float = 0.0
    schedule: IterationSchedule | None = None
    column: tuple[int, ...] | None = None
