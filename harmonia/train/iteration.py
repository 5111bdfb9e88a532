"""Everything one iteration needs, built on the CPU a step ahead (in the prefetch thread).

For step ``k``: the data order gives the global batch; the cost model prices every module's work per
sample from its shape (the shape index and cached token counts: nothing is decoded to balance); the
balancer forms the global microbatches, LLM replicas and encoder replicas
(`harmonia.schedule.iteration.assign_iteration`) and, with LLM ``cp > 1``, each replica's CP token
shards (`harmonia.runtime.mllm_inputs.cp_token_ranks`); the per-batch search picks the microbatch order
and then each encoder's sub-microbatch split (by cost, DIP-style) that minimise the step time
(the replayed one for the order, the simulated one on the cluster model for the split, with the
shared cost model; a fixed number of evaluations, so every rank gets the same schedule), and the rank's own
tensors are cut from the batch, encoder items in the sub-microbatch runs the schedule was priced
with. Where the step's predicted peak on some rank (states plus the activations its action list holds at
once) would exceed the device, its LLM replicas take twice as many, smaller microbatches, again
while it would (`IterationBuilder._assign_within_memory`; the per-batch search's pick is kept only
within the device too): the planner checked its plan's memory on the batches it profiled, and a
batch drawn later can be heavier. Where no count fits, the step's heaviest sample is a bad record
(``over device memory``), skipped or fatal by the data policy like a sample that fails to decode.
Under ``train.assignment=sequential`` the batch is instead cut in data order into contiguous DP
shards and fixed-size microbatches (the Megatron-LM recipe's `assign_sequential`), run in that
order with no encoder split. A rank decodes only the samples whose tensors it trains
(`harmonia.train.rank_data`), in the decoder's worker processes. Every rank runs its own action list
of that schedule (`harmonia.schedule.rank_actions`); rank 0 also simulates the step on the cluster
model: the same lists, every rank's, timed (the "simulated" time beside the measured one).

Failures are agreed in the training thread (`IterationBuilder.settle`, at the start of step ``k``):
every rank's decoding failures are gathered on the data process group, counted once by the data
policy, and, when there are any, every rank drops the same samples and prepares the step again.
So that every rank prepares the same step ``k + 1``, its preparation starts only after step ``k``'s
agreement and leaves out every sample that failed before: still one step ahead of training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from harmonia.data.decode import SampleDecoder
from harmonia.data.loader import Failed, MultimodalDataset
from harmonia.data.samples import LoadedSample
from harmonia.errors import ConfigError, HarmoniaError, SampleError
from harmonia.model.spec import MLLMSpec
from harmonia.plan.candidates import state_bytes_per_rank
from harmonia.runtime.message_program import plan_iteration_messages
from harmonia.runtime.mllm_inputs import RankBatch, build_rank_batch, cp_token_ranks
from harmonia.schedule.families import build_schedule
from harmonia.schedule.graph import LLM, IterationSchedule, StageGraph
from harmonia.schedule.assign import assign_sequential
from harmonia.schedule.item_cuts import cut_encoder_items
from harmonia.schedule.iteration import (IterationAssignment, assemble_iteration, assign_iteration, balancer_costs,
                                        feeding_replicas)
from harmonia.schedule.order_search import search_order, search_submicrobatches
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, cost_table, plan_iteration_work
from harmonia.sim.engine import Timeline
from harmonia.sim.memory import activation_bound, activation_peaks, input_bytes
from harmonia.sim.tasks import SimulatedOrders, simulate_schedule, simulated_step
from harmonia.train.rank_data import StepAgreement, agree_failures, check_decoded, rank_positions, rank_samples
from harmonia.workload.calibration import Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec
from harmonia.workload.shapes import SampleShape


ASSIGNMENTS = ("balanced", "sequential")
"""How a step's batch becomes microbatches (``train.assignment``)."""


class DataOrder:
    """Which dataset indices each step trains on: epoch-wise permutations of the usable samples.

    Step ``k`` takes positions ``[p_k, p_k + B)`` of the concatenated epochs, ``p_k = k B`` from the
    start; a run resumed at step ``s`` from data position ``p`` (`resume_at`: the checkpoint's) takes
    ``p_k = p + (k - s) B``, so the same stream continues where it stopped even when the global batch
    changed between the runs (no sample skipped, none repeated).
    """

    def __init__(self, indices: list[int], global_batch: int, seed: int) -> None:
        if len(indices) < global_batch:
            raise SampleError(f"the dataset has {len(indices)} usable samples, fewer than train.global_batch="
                              f"{global_batch}; add data or lower the batch")
        self.indices, self.global_batch, self.seed = np.asarray(indices), global_batch, seed
        self._perms: dict[int, np.ndarray] = {}
        self._anchor = (0, 0)  # (step, data position) the positions count from

    def resume_at(self, step: int, position: int) -> None:
        """Step ``step`` starts at data position ``position`` (later steps follow it)."""
        self._anchor = (step, position)

    def position(self, step: int) -> int:
        """The data position step ``step`` starts at (samples of the stream trained before it)."""
        at, position = self._anchor
        return position + (step - at) * self.global_batch

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._perms:
            self._perms[e] = np.random.default_rng([self.seed, e]).permutation(self.indices)
        return self._perms[e]

    def batch(self, step: int) -> list[int]:
        n = len(self.indices)
        start = self.position(step)
        return [int(self._epoch(p // n)[p % n]) for p in range(start, start + self.global_batch)]

    def epoch_of(self, step: int) -> float:
        return self.position(step) / len(self.indices)


@dataclass
class PreparedIteration:
    """One step's data and schedule on one rank.

    Attributes:
        step: the step (0-based).
        sample_ids: dataset indices trained this step (decoded successfully).
        skipped: samples of the step's batch dropped by the data policy (failed now or before).
        assignment: global microbatches and replicas (batch positions).
        schedule: the schedule every rank expands to its action list (None while a failure of this
            rank's decoding awaits `IterationBuilder.settle`).
        batch: this rank's tensors (None likewise).
        n_tokens: LLM tokens of the step's batch.
        predicted: the simulated step on the cluster model (rank 0 only).
        prepare_s: seconds spent building this.
        calibrated: whether ``predicted`` used a cost model fitted to measured steps.
        n_sub: encoder -> the sub-microbatches each of its microbatches was split into (the
            per-batch search's choice; 1 = not split).
        failed: this rank's decoding failures (not yet agreed; `IterationBuilder.settle` clears them).
        decoded: dataset index -> what this rank decoded for the step.
        settle_s: seconds the training thread spent agreeing on failures (and preparing again).
        stops: rank -> pending stop signal, as every rank agreed in `IterationBuilder.settle`.
        rows: ``(world, R)`` every rank's row gathered by `IterationBuilder.settle` (None: none passed).
        summed: ``(E,)`` every rank's ``extra`` summed by `IterationBuilder.settle` (None: none passed).
        predicted_peak: this rank's bytes at the step's peak as the planner prices them: its states
            (weights, gradients, optimizer states) plus the activations its action list holds at once
            (computed where a measured peak is recorded beside it; else 0).
    """

    step: int
    sample_ids: list[int]
    skipped: int
    assignment: IterationAssignment
    schedule: IterationSchedule
    batch: RankBatch
    n_tokens: int
    predicted: Timeline | None
    prepare_s: float
    calibrated: bool = False
    n_sub: dict[str, int] = field(default_factory=dict)
    failed: list[Failed] = field(default_factory=list)
    decoded: dict[int, LoadedSample | Failed] = field(default_factory=dict, repr=False)
    settle_s: float = 0.0
    predicted_peak: float = 0.0
    stops: dict[int, int] = field(default_factory=dict)
    rows: torch.Tensor | None = None
    summed: torch.Tensor | None = None


class BuilderClosed(HarmoniaError):
    """The builder was closed while a preparation waited for the previous step's agreement."""


class IterationBuilder:
    """Builds `PreparedIteration` for any step, deterministically (the same schedule on every rank).

    Steps are prepared in order: ``builder(k)`` (in the prefetch thread) waits for step ``k - 1``'s
    `settle` (in the training thread); `build` prepares and settles a step in the calling thread, for
    callers without a prefetcher.

    Args:
        spec: the MLLM.
        plan: the job's plan.
        dataset: the training set.
        order: the data order.
        cost: the cost model of the cluster's device (balancing and simulation).
        cluster: the cluster model (simulated step time).
        graph: one LLM replica's stage graph (`harmonia.train.rank.schedule_graph`).
        rank: this process's rank.
        search_evaluations: schedules the per-batch order search replays, and the most encoder splits
            the sub-microbatch search replays (0 = the balancer's order, no split).
        simulate: also simulate the step (rank 0).
        simulate_steps: the steps ``simulate`` covers (None: every step; the trainer's: those it logs
            and the ones it calibrates and draws).
        shapes: dataset index -> shape of every usable sample (`MultimodalDataset.shapes`).
        decoder: decodes this rank's samples (default: in this process).
        agree: ``(failures, stop signal, row, extra)`` -> every rank's
            (`harmonia.train.rank_data.agree_failures` on the data group); default: one process.
        assignment: ``balanced`` (the balancer, the order search and the sub-microbatch search) or
            ``sequential`` (fixed-size microbatches in data order, `assign_sequential`, as the
            Megatron-LM recipe: the balancer's order is not searched and no encoder is split).
    """

    def __init__(self, spec: MLLMSpec, plan: Plan, dataset: MultimodalDataset, order: DataOrder, cost: CostModel,
                 cluster: ClusterSpec, graph: StageGraph, rank: int, search_evaluations: int = 64,
                 simulate: bool = False, *, shapes: Mapping[int, SampleShape],
                 simulate_steps: Callable[[int], bool] | None = None,
                 decoder: SampleDecoder | None = None,
                 agree: Callable[[list[Failed], int, torch.Tensor | None, torch.Tensor | None],
                                 StepAgreement] | None = None,
                 assignment: str = "balanced", predict_peaks: bool = False) -> None:
        if assignment not in ASSIGNMENTS:
            raise ConfigError(f"train.assignment={assignment!r} is invalid: expected one of {ASSIGNMENTS}")
        self.spec, self.plan, self.dataset, self.order, self.cost = spec, plan, dataset, order, cost
        self.cluster, self.graph, self.rank = cluster, graph, rank
        self.search_evaluations, self.simulate, self.simulate_steps = search_evaluations, simulate, simulate_steps
        self.assignment = assignment
        self.predict_peaks = predict_peaks  # this rank's predicted step peak, for a measured one beside it
        self.shapes = shapes
        self.decoder = decoder or SampleDecoder(dataset, 0)
        self.agree = agree or (lambda failed, stop, row, extra: agree_failures(failed, None, stop, row, extra))
        self.sim_cost = cost  # what the simulated step is priced with (`calibrate` refits it)
        self.feeds = {e: feeding_replicas(plan, e) for e in plan.encoders}
        self.states = state_bytes_per_rank(cost, plan)  # weights, gradients, optimizer states per rank
        self.bad: set[int] = set()  # samples every rank agreed failed, dropped before balancing
        self._cost_rows: tuple[np.ndarray, np.ndarray] | None = None  # `_balancer_costs`: rows by sample index
        self._balanced_ahead: tuple[tuple, IterationAssignment] | None = None  # `_decode_ahead`'s, by its inputs
        self._settled: int | None = None  # the newest step agreed on
        self._closed = False
        self._cond = threading.Condition()

    def calibrate(self, calibration: Calibration) -> None:
        """Price later simulated steps with ``calibration`` (balancing and the order search keep the
        shared cost model, so every rank still builds the same schedule)."""
        self.sim_cost = CostModel(self.spec, self.cost.device, calibration, self.cost.act_bytes)

    def __call__(self, step: int) -> PreparedIteration:
        """Prepare ``step`` once step ``step - 1`` is settled (the first call prepares at once)."""
        with self._cond:
            if self._settled is None:
                self._settled = step - 1
            while not self._closed and self._settled < step - 1:
                self._cond.wait()
            if self._closed:
                raise BuilderClosed(f"step {step} was not prepared: the iteration builder was closed")
            bad = set(self.bad)
        return self._prepare(step, bad, {})

    def settle(self, it: PreparedIteration, stop: int = 0, row: torch.Tensor | None = None,
               extra: torch.Tensor | None = None) -> PreparedIteration:
        """Agree with every rank on the step's failures and pending stop signals (``stop``: this
        rank's; one collective on the data group, which also gathers every rank's ``row`` into
        ``it.rows`` and sums every rank's ``extra`` into ``it.summed``): each failure is counted once
        by the data policy (``on_error=fail`` raises here, on every rank), and the step is prepared
        again without them until no rank fails. Returns the step every rank trains, with the agreed
        stop signals. ``it.settle_s`` counts from the first agreement on where it carries ``extra``
        (that collective is the step before's own)."""
        t0 = time.perf_counter()
        first = None
        while True:
            agreed = self.agree(it.failed, stop if first is None else 0, row if first is None else None,
                                extra if first is None else None)
            if first is None and extra is not None:
                t0 = time.perf_counter()
            first = agreed if first is None else first
            failed = agreed.failed
            if not failed:
                break
            for f in failed:
                self.dataset.report(f)
            with self._cond:
                self.bad.update(f.index for f in failed)
            it = self._prepare(it.step, set(self.bad), it.decoded)
        self.dataset.stats.loaded += len(it.sample_ids)
        it.decoded = {}
        it.stops, it.rows, it.summed = first.stops, first.rows, first.summed
        it.settle_s = time.perf_counter() - t0
        with self._cond:
            self._settled = it.step
            self._cond.notify_all()
        return it

    def build(self, step: int) -> PreparedIteration:
        """Prepare and settle ``step`` in this thread (any step: nothing runs beside it)."""
        with self._cond:
            bad = set(self.bad)
        return self.settle(self._prepare(step, bad, {}))

    def close(self) -> None:
        """Stop waiting preparations and the decoder's workers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.decoder.close()

    def _prepare(self, step: int, bad: set[int], decoded: dict[int, LoadedSample | Failed]) -> PreparedIteration:
        """Balance the step's samples not in ``bad`` from their shapes, decode the ones this rank trains
        (those not in ``decoded`` yet), and build its schedule and tensors; with a failure of its own,
        the step is returned unbuilt, to be prepared again after `settle`."""
        t0 = time.perf_counter()
        wanted = self.order.batch(step)
        plan, llm = self.plan, self.plan.layouts[LLM]
        ids, shapes, tokens, assignment = self._assign(step, wanted, bad)
        mine = rank_positions(plan.layouts, self.rank, assignment, shapes, self.spec)
        todo = [p for p in mine if ids[p] not in decoded]
        for p, r in zip(todo, self.decoder.decode([ids[p] for p in todo])):
            decoded[ids[p]] = check_decoded(r, shapes[p], self.dataset)
        self._decode_ahead(step + 1, bad)
        failed = [decoded[ids[p]] for p in mine if isinstance(decoded[ids[p]], Failed)]
        if failed:
            return PreparedIteration(step, ids, len(wanted) - len(ids), assignment, None, None, 0, None,
                                     time.perf_counter() - t0, failed=failed, decoded=decoded)
        sim_cost = self.sim_cost
        simulated = self.simulate and (self.simulate_steps is None or self.simulate_steps(step))
        schedule, iw, predicted = self._schedule(shapes, assignment, sim_cost if simulated else None)
        micro = rank_samples(assignment, ids, shapes, decoded, set(mine), self.dataset)
        llm_cp = None
        if llm.cp > 1:  # each replica's tokens over its CP ranks, balanced on the LLM's FLOPs
            llm_cp = [[cp_token_ranks([mb[i] for i in replica], llm.cp, body=self.spec.llm.body)
                       for replica in split] for mb, split in zip(micro, assignment.llm_split)]
        batch = build_rank_batch(plan.layouts, self.rank, micro, assignment.llm_split, assignment.encoder_split,
                                 iw.n_sub, iw.sub_runs, llm_cp=llm_cp, encoder_cuts=assignment.encoder_cuts)
        batch.messages = plan_iteration_messages(plan.layouts, schedule, batch.plans, self.rank)  # a step ahead
        peak = 0.0
        if self.predict_peaks:
            mine = [self.rank]
            peak = (self.states.get(self.rank, 0.0) + activation_peaks(plan, iw, schedule, mine).get(self.rank, 0.0)
                    + input_bytes(self.spec, iw, mine).get(self.rank, 0.0))
        return PreparedIteration(step, ids, len(wanted) - len(ids), assignment,
                                 schedule, batch, int(tokens.sum()), predicted, time.perf_counter() - t0,
                                 calibrated=sim_cost is not self.cost,
                                 n_sub={e: max(iw.n_sub.get(e, (1,))) for e in plan.encoders}, decoded=decoded,
                                 predicted_peak=peak)

    def _assign(self, step: int, wanted: list[int], bad: set[int]) -> tuple[list[int], list[SampleShape],
                                                                          np.ndarray, IterationAssignment]:
        """The step's usable samples (``wanted`` not in ``bad``), their shapes and LLM tokens, and their
        assignment; a sample no microbatch count fits on the device (`_assign_within_memory`) is
        reported to the data policy and joins ``bad``, and the step is balanced again without it."""
        plan, llm = self.plan, self.plan.layouts[LLM]
        while True:
            ids = [i for i in wanted if i not in bad]
            if len(ids) < llm.dp * plan.n_microbatches:
                raise SampleError(f"step {step}: only {len(ids)} of {len(wanted)} samples usable (the rest failed to "
                                  f"decode or exceed the device), fewer than llm dp x n_microbatches = "
                                  f"{llm.dp * plan.n_microbatches}; fix the data")
            shapes = [self.shapes[i] for i in ids]
            costs, columns, tokens = self._balancer_costs(ids, shapes)
            if self.assignment == "sequential":  # contiguous DP shards, then contiguous microbatches
                per_replica = assign_sequential(np.arange(len(ids)), llm.dp, plan.n_microbatches)
                encoder_dp = {e: plan.layouts[e].dp for e in plan.encoders}
                return ids, shapes, tokens, assemble_iteration([per_replica[d] for d in range(llm.dp)], costs,
                                                               columns, encoder_dp, feeds=self.feeds)
            found = self._assign_within_memory(step, ids, shapes, costs, columns, tokens)
            if isinstance(found, IterationAssignment):
                return ids, shapes, tokens, found
            heaviest, message = found
            index = ids[heaviest]
            self.dataset.report(Failed(index, "over device memory", message, self.dataset.records[index].where))
            bad.add(index)
            with self._cond:
                self.bad.add(index)

    def _balancer_costs(self, ids: list[int], shapes: list[SampleShape]) -> tuple[np.ndarray, list[str], np.ndarray]:
        """`balancer_costs` of the step's samples, each sample's row priced once per job (a row
        depends only on its shape and the balancing cost model, which never change; kept in arrays
        over the dataset's indices, 8 bytes per column and sample): ``(n, 1 + encoders)`` seconds,
        the column names and ``(n,)`` LLM tokens."""
        columns = ["llm", *self.plan.encoders]
        if self._cost_rows is None:
            n = max(self.shapes, default=-1) + 1
            self._cost_rows = (np.full((n, len(columns)), np.nan), np.zeros(n, dtype=np.int64))
        rows, llm_tokens = self._cost_rows
        index = np.asarray(ids, dtype=np.int64)
        todo = np.flatnonzero(np.isnan(rows[index, 0]))  # positions of samples not priced yet
        if todo.size:
            costs, _, tokens = balancer_costs(self.cost, [shapes[k] for k in todo], self.plan.encoders)
            rows[index[todo]], llm_tokens[index[todo]] = costs, tokens
        return rows[index], columns, llm_tokens[index]

    def _assign_within_memory(self, step: int, ids: list[int], shapes: list[SampleShape], costs: np.ndarray,
                              columns: list[str], tokens: np.ndarray) -> IterationAssignment | tuple[int, str]:
        """The balancer's assignment with the plan's microbatches per LLM replica, or, where the step's
        predicted peak on some rank (its states plus the activations its action list holds at once:
        what the planner checked its plan with, on the batches it profiled) exceeds the device, with
        twice as many, again while it does: smaller microbatches hold fewer activations at once.
        Every rank computes the same, so all agree on the count. Where no count fits, the position of
        the step's heaviest sample (the largest share of the batch's work, summed over modules) and
        why, for the data policy to drop it before any rank runs out of memory. The peak under the
        schedule is found only where a bound of any order's does not fit (`_fits_any_order`)."""
        plan, llm = self.plan, self.plan.layouts[LLM]
        n = plan.n_microbatches
        while True:
            assignment = self._balanced(step, ids, shapes, costs, columns, tokens, n)
            if self._fits_any_order(shapes, assignment):
                return assignment
            rank, peak = self._peak(shapes, assignment)
            if peak <= self.cluster.device.mem_bytes:
                return assignment
            if llm.dp * 2 * n > len(shapes) or (plan.schedule == "interleaved" and (2 * n) % llm.pp):
                share = costs / np.maximum(costs.sum(axis=0), 1e-30)
                heaviest = int(np.argmax(share.sum(axis=1)))
                return heaviest, (
                    f"step {step}: rank {rank} would hold {peak / 2**30:.1f} GiB, over the device's "
                    f"{self.cluster.device.mem_bytes / 2**30:.0f} GiB, even with {n} microbatches per LLM replica; "
                    f"its heaviest sample ({int(tokens[heaviest])} LLM tokens) is left out; recompute more "
                    "activations or choose a plan with more memory to spare to keep such samples")
            n *= 2

    def _balanced(self, step: int, ids: list[int], shapes: list[SampleShape], costs: np.ndarray,
                  columns: list[str], tokens: np.ndarray, n: int, keep: bool = False) -> IterationAssignment:
        """The balancer's assignment of the step's samples ``ids`` to ``n`` microbatches per LLM
        replica, its encoders' items cut; the one kept (``keep``: `_decode_ahead`'s) for the same
        samples and count taken as it is (the balancer is deterministic in them)."""
        if self._balanced_ahead is not None:
            kept_key, kept = self._balanced_ahead
            if kept_key == (step, n, tuple(ids)):
                return kept
        encoder_dp = {e: self.plan.layouts[e].dp for e in self.plan.encoders}
        assignment = cut_encoder_items(assign_iteration(costs, columns, self.plan.layouts[LLM].dp, encoder_dp, n,
                                                        tokens=tokens, seed=step, feeds=self.feeds),
                                       self.plan, self.cost, shapes)
        if keep:
            self._balanced_ahead = ((step, n, tuple(ids)), assignment)
        return assignment

    def _decode_ahead(self, step: int, bad: set[int]) -> None:
        """With decoding workers, start decoding the samples this rank will train at ``step`` as the
        balancer assigns them now (without a sample found bad or over the device before then: a
        guess; a wrong one only decodes a sample the rank does not train yet); the assignment is
        kept for that step's own preparation (`_balanced`)."""
        plan, n = self.plan, self.plan.n_microbatches
        if not self.decoder.has_workers or self.assignment != "balanced":
            return
        ids = [i for i in self.order.batch(step) if i not in bad]
        if len(ids) < plan.layouts[LLM].dp * n:
            return
        shapes = [self.shapes[i] for i in ids]
        try:
            costs, columns, tokens = self._balancer_costs(ids, shapes)
            assignment = self._balanced(step, ids, shapes, costs, columns, tokens, n, keep=True)
        except HarmoniaError:  # raised again by that step's own preparation, where it belongs
            return
        self.decoder.prefetch([ids[p] for p in rank_positions(plan.layouts, self.rank, assignment, shapes, self.spec)])

    def _fits_any_order(self, shapes: list[SampleShape], assignment: IterationAssignment) -> bool:
        """Whether every rank fits the device under any order of the step's actions (`activation_bound`
        beside its states and encoder inputs): then its peak under the schedule need not be found."""
        iw = self._work(shapes, assignment)
        bound, inputs = activation_bound(iw), input_bytes(self.spec, iw)
        ranks = {*self.states, *bound}
        return all(self.states.get(r, 0.0) + bound.get(r, 0.0) + inputs.get(r, 0.0) <= self.cluster.device.mem_bytes
                   for r in ranks)

    def _peak(self, shapes: list[SampleShape], assignment: IterationAssignment,
              iw: IterationWork | None = None, schedule: IterationSchedule | None = None) -> tuple[int, float]:
        """(rank, bytes) of the largest predicted peak of a step: states plus activation peak plus the
        encoder inputs held, under ``schedule`` (default: the balancer's order, unsplit) of its stage
        work."""
        if iw is None:
            iw, schedule = self._work(shapes, assignment), self._plain_schedule(shapes, assignment)
        peaks, inputs = activation_peaks(self.plan, iw, schedule), input_bytes(self.spec, iw)
        return max(((r, self.states.get(r, 0.0) + b + inputs.get(r, 0.0)) for r, b in peaks.items()),
                   key=lambda x: x[1], default=(0, 0.0))

    def _work(self, shapes: list[SampleShape], assignment: IterationAssignment) -> IterationWork:
        """The step's stage work, unsplit, priced by the balancing cost model once per assignment (the
        memory check and the schedule's search share it; kept on the assignment's memo)."""
        if "step work" not in assignment.memo:
            assignment.memo["step work"] = plan_iteration_work(shapes, self.plan, self.cost, assignment)
        return assignment.memo["step work"]

    def _plain_schedule(self, shapes: list[SampleShape], assignment: IterationAssignment) -> IterationSchedule:
        """The schedule of the balancer's order on the unsplit stage work (the memory check's; the step's
        own where the search changes nothing), built once per assignment (kept on its memo)."""
        if "plain schedule" not in assignment.memo:
            assignment.memo["plain schedule"] = build_schedule(
                self.graph, assignment.n_microbatches, self.plan.schedule,
                costs=cost_table(self.plan, self._work(shapes, assignment)))
        return assignment.memo["plain schedule"]

    def _schedule(self, shapes: list, assignment: IterationAssignment,
                  sim_cost: CostModel | None) -> tuple[IterationSchedule, IterationWork, Timeline | None]:
        """The searched microbatch order and encoder sub-microbatches' schedule, its stage work, and
        (rank 0) the simulated timeline of exactly the action lists every rank runs from it."""
        plan, n = self.plan, assignment.n_microbatches
        iw = unsplit = self._work(shapes, assignment)
        order = list(range(n))
        searched = self.search_evaluations if self.assignment == "balanced" else 0
        if searched and n > 1:  # the pick replaces the balancer's order only where it simulates faster too
            table = cost_table(plan, iw)
            steps = SimulatedOrders(plan, self.cost, self.cluster, iw, lambda o: build_schedule(
                self.graph, n, plan.schedule, order=o, costs=table))
            order = search_order(self.graph, table, n, (plan.schedule,), budget_s=float("inf"),
                                 max_evaluations=self.search_evaluations, step=steps).order
        if searched and plan.encoders:
            iw = search_submicrobatches(self.graph, plan, self.cost, iw, order, max_evaluations=self.search_evaluations,
                                        score=simulated_step(plan, self.cost, self.cluster)).work
        if iw is unsplit and order == list(range(n)):  # the search kept the balancer's order and split nothing
            return self._simulated(shapes, assignment, sim_cost, iw, self._plain_schedule(shapes, assignment))
        schedule = build_schedule(self.graph, n, plan.schedule, order=order, costs=cost_table(plan, iw),
                                  n_sub=iw.n_sub or None)
        if searched and self._peak(shapes, assignment, iw, schedule)[1] > self.cluster.device.mem_bytes:
            # the pick holds more at once than the device does (the balancer's order was checked): not taken
            iw, schedule = unsplit, self._plain_schedule(shapes, assignment)
        return self._simulated(shapes, assignment, sim_cost, iw, schedule)

    def _simulated(self, shapes: list, assignment: IterationAssignment, sim_cost: CostModel | None, iw: IterationWork,
                   schedule: IterationSchedule) -> tuple[IterationSchedule, IterationWork, Timeline | None]:
        """``(schedule, iw, predicted)``: the step simulated on ``sim_cost`` (None: not simulated)."""
        plan = self.plan
        predicted = None
        if sim_cost is not None:
            sim_iw = iw if sim_cost is self.cost else plan_iteration_work(shapes, plan, sim_cost, assignment,
                                                                           iw.n_sub, iw.sub_runs)
            predicted = simulate_schedule(plan, sim_cost, self.cluster, sim_iw, schedule)
        return schedule, iw, predicted
