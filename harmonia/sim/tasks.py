"""Time every rank's action list: one task per action, in the list's order, with real costs.

The lists are the ones the executor runs (`harmonia.schedule.rank_actions.plan_rank_actions`); a
rank's tasks are exactly its actions, in its order:

- a compute action (F, B, W, BW) runs on the rank's compute stream for the cost model's seconds of
  its unit on that rank's replica (`harmonia.schedule.stagework`; nothing where the replica has no
  data in the unit), plus the collectives inside it: TP adds two all-reduces of the activations per
  block and pass, CP an all-gather of K and V per block; a recomputed module's backward runs its
  blocks' forward again, collectives included. Every price is one function of
  `harmonia.sim.collectives`;
- FSDP, as harmonia's runtime runs it, gathers every FSDP chunk of a rank once per step: the
  gathers are issued at the start on the rank's communication stream (`step_gathers`, one task per
  chunk) and the chunk's first forward with data computes beside them, slowed while they run, and
  ends no earlier than its last block after the last gather (`first_forward_gather`). A chunk that
  reshards per microbatch (``fsdp reshard``; every FSDP chunk under a cost model priced
  ``fsdp_per_microbatch``) gathers its weights before every forward and backward instead, and
  reduce-scatters its gradients in every backward, overlapped with compute: the compute runs
  slower while they do (`DeviceSpec.overlap_slowdown`) and the part longer than it adds time
  (`overlapped_extra`). Those gathers are collectives of the chunk's DP group: a block's gather
  completes only once every replica has issued it, so the group runs each such phase in lockstep
  (`_lockstep`): the replicas' phases of one microbatch start together, once each has finished
  what it ran before, and whatever follows them waits until the slowest has ended. The TP
  all-reduces and CP all-gathers inside an LLM phase couple its TP x CP group the same way where
  the group's ranks hold different encoder replicas and so run different work between its phases
  (elsewhere they run the same work and keep in step by themselves);
- a send takes no time on the stream (sends are asynchronous);
- a receive holds the stream until its message has arrived: the matching send's end plus the
  transfer (``latency + bytes / bandwidth``), within a module from the peer the action names, at a
  boundary from every replica that has rows for it (the encoder replicas encoding the LLM
  replica's samples forward, the LLM replicas packing the encoder replica's samples backward);
- a ``REDUCE`` runs the chunk's gradient all-reduce (an FSDP chunk's reduce-scatter) over ``dp``
  on the rank's communication stream, after the compute action before it (the chunk's last
  backward); an LLM FSDP chunk's last fused backward reduce-scatters its blocks as it goes
  (`reduce_exposed_s`): the reduction then starts inside that backward, which it slows while they
  overlap, and runs past its end only as far as the blocks' order allows.

A W on a stage without B (nothing trainable upstream) still backpropagates through its own interior
for its weight gradients: that work runs inside its W. Activations are kept from F and freed by the
backward (at W when split, B keeping W's output gradients until then; `harmonia.sim.memory`, which
also finds each rank's peak from its order alone).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping

from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.encoder_slots import llm_group
from harmonia.schedule.graph import LLM, IterationSchedule, StageGraph
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.rank_actions import plan_rank_actions, rank_compute_actions
from harmonia.schedule.stagework import IterationWork, MicrobatchWork, StageKey, stage_layer_range, stage_ranks
from harmonia.sim.collectives import (backward_reduce_s, chunk_blocks, first_forward_gather, fsdp_gather_s,
                                      grad_reduce_s, p2p_s, reduce_exposed_s, reduces_in_backward, stage_group,
                                      step_gathers)
from harmonia.sim.engine import Task, Timeline, replay
from harmonia.sim.lockstep import lockstep_groups, stand_ins, with_copies
from harmonia.sim.shared import replay_shared
from harmonia.sim.memory import phase, unit_memory
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec


def collective_extra(plan: Plan, cost: CostModel, key: StageKey, work: MicrobatchWork, kind: str,
                     cluster: ClusterSpec, cache: dict) -> float:
    """TP all-reduces, CP K/V all-gathers and, priced ``fsdp_per_microbatch``, exposed FSDP gathers
    inside a stage for one phase (`harmonia.sim.collectives`); ``cache`` keeps what each stage key's
    collectives take (`_stage_collectives`) and one FSDP gather price per stage chunk."""
    entry = cache.get(key)
    if entry is None:
        entry = cache[key] = _stage_collectives(plan, cost, key, cluster, cache)
    tp_form, cp_form, reshards, again = entry
    fsdp_gather = reshards and kind in ("F", "B", "BW")
    if kind == "W" or not (tp_form or cp_form or fsdp_gather):
        return 0.0
    extra, tokens = 0.0, work.tokens
    if (tp_form or cp_form) and tokens > 0:
        # recompute: the recomputed blocks' forward (a share of the stage's blocks) again
        passes = 1 + again if kind in ("B", "BW") else 1
        if tp_form:  # `tp_allreduce_s`, its operations in its order
            cp, hidden, act_bytes, ring, bw, latency, twice_blocks = tp_form
            extra += passes * (twice_blocks * (ring * (tokens / cp * hidden * act_bytes) / bw + latency))
        if cp_form:  # `cp_kv_gather_s`, likewise
            kv_dim, act_bytes, tp, share, bw = cp_form
            extra += passes * (share * (2 * tokens * kv_dim * act_bytes / tp) / bw)
    if fsdp_gather:
        # every replica's stage gathers over a DP group of the same shape: one price per stage chunk;
        # a backward also reduce-scatters its gradients, both overlapped with its blocks' compute
        if (key.module, key.stage) not in cache:
            cache[(key.module, key.stage)] = (fsdp_gather_s(cost, cluster, plan, key.module, key.stage, key.replica),
                                              backward_reduce_s(cost, cluster, plan, key.module, key.stage))
        gather, reduce = cache[(key.module, key.stage)]
        if kind == "F":
            extra += overlapped_extra(gather, work.times.F, cluster.device.overlap_slowdown)
        else:
            compute = work.times.B + (work.times.W if kind == "BW" else 0.0)
            extra += overlapped_extra(gather + reduce, compute, cluster.device.overlap_slowdown)
    return extra


def overlapped_extra(comm: float, compute: float, slowdown: float) -> float:
    """What ``comm`` seconds of collectives started with ``compute`` seconds of compute add to it.

    The compute runs ``1 + slowdown`` times slower while the collectives run (`DeviceSpec.overlap_slowdown`).
    If it ends within them (``compute (1 + slowdown) <= comm``) the pair lasts ``comm``; else
    ``comm / (1 + slowdown)`` of its work is done by then and the rest follows at full speed:
    ``comm + compute - comm / (1 + slowdown)``. So it adds ``max(comm - compute, comm s / (1 + s))``.
    """
    return max(comm - compute, comm * slowdown / (1 + slowdown)) if comm > 0 else 0.0


def _stage_collectives(plan: Plan, cost: CostModel, key: StageKey, cluster: ClusterSpec, cache: dict) -> tuple:
    """What `collective_extra` prices a replica's stage chunk's phases with: the factors of its TP
    all-reduces (`tp_allreduce_s`; None without TP) and CP K/V all-gathers (`cp_kv_gather_s`;
    None without CP) per token, whether it reshards per microbatch, and the share of its blocks
    recomputed. A replica's chunk differs from another's only in its groups' bandwidths: ``cache``
    keeps one entry per chunk and bandwidths."""
    layout = plan.layouts[key.module]
    ranks = stage_ranks(plan, key.module, key.replica, key.stage)
    tp_bw = cluster.group_bandwidth(ranks[: layout.tp]) if layout.tp > 1 else None
    cp_bw = cluster.group_bandwidth(ranks[:: layout.tp]) if layout.cp > 1 else None
    shared = ("collectives", key.module, key.stage, tp_bw, cp_bw)
    if shared in cache:
        return cache[shared]
    blocks = chunk_blocks(cost, layout, key.module, key.stage)
    tp_form = cp_form = None
    if layout.tp > 1:
        n = layout.tp
        hidden = cost.mllm.llm.hidden if key.module == "llm" else cost.mllm.encoders[key.module].out_dim
        tp_form = (layout.cp, hidden, cost.act_bytes, 2 * (n - 1) / n, tp_bw,
                   1 * 2 * (n - 1) * cluster.device.latency_s, 2 * blocks)
    if layout.cp > 1:
        spec = cost.mllm.llm.body if key.module == "llm" else cost.mllm.encoders[key.module].body
        cp_form = (spec.kv_dim, cost.act_bytes, layout.tp, blocks * (layout.cp - 1) / layout.cp, cp_bw)
    cache[shared] = tp_form, cp_form, cost.reshards(layout), plan.recompute_share(key.module)
    return cache[shared]


NO_SPLIT = (0.0, 0.0)


def compute_seconds(work: MicrobatchWork, kind: str, w_only: bool, split: tuple[float, float] = NO_SPLIT) -> float:
    """Compute seconds of one phase of a unit's work (a W-only stage's W runs its whole backward);
    ``split``: what B and W of a backward split into both add (`split_extra`)."""
    t = work.times
    if kind == "F":
        return t.F
    if kind == "B":
        return t.B + split[0]
    return t.B + t.W if kind == "BW" or w_only else t.W + split[1]


def split_extra(cost: CostModel, plan: Plan, module: str, stage: int, cache: dict) -> tuple[float, float]:
    """What splitting a stage chunk's backward into B and W adds to each (`CostModel.split_backward_extra`
    over its layers), kept in ``cache`` per chunk; pass it to `compute_seconds` only where the chunk's
    backward is split (its kinds are B and W)."""
    key = ("split", module, stage)
    found = cache.get(key)
    if found is None:
        found = cache[key] = cost.split_backward_extra(module, *stage_layer_range(cost, plan, module, stage))
    return found


_COMPUTE = frozenset(k for k in Kind if k.is_compute)
_TEXT = {k: k.value for k in Kind}


class _Builder:
    """Tasks of every rank's actions, and the receives' dependencies once every send exists."""

    def __init__(self, plan: Plan, cost: CostModel, iw: IterationWork, graph: StageGraph,
                 cluster: ClusterSpec, stand_in: Mapping[int, int] | None = None) -> None:
        self.plan, self.cost, self.iw, self.graph, self.cluster = plan, cost, iw, graph, cluster
        self.stand_in = stand_in or {}  # rank -> the representative replayed for it (`harmonia.sim.lockstep`)
        self.tasks: list[Task] = []
        self.sends: dict[tuple, int] = {}  # (rank, module, stage, kind, microbatch, sub, peer stage, peer's stand-in)
        self.recvs: list[tuple[int, int, Action]] = []  # (task, rank, action)
        self.gathers: dict = {}
        self.last_compute: dict[int, int] = {}  # rank -> its latest compute task
        self.replicas: dict[tuple[str, int], dict[str, int]] = {}  # (module, rank) -> its coordinates
        self.reductions: dict[tuple, float] = {}  # (module, chunk, cp, tp) -> one DP group's reduction
        self.first_rank: dict[tuple[str, int, int], int] = {}  # a replica's stage chunk -> its first rank
        self.crossing: tuple[dict, dict] | None = None  # `_crossing` of the stage work, on first use
        self.phases: dict[tuple[str, int, Kind], tuple[str, bool, bool]] = {}
        self.units: dict[tuple, tuple[str, float, float, float, float]] = {}  # one phase of a unit, timed
        self.gathering: dict[tuple[int, str, int], int] = {}  # (rank, module, chunk) -> its gather's task
        self.in_backward: dict[str, bool] = {}  # module -> whether it reduces inside its last backward

    def replica(self, module: str, rank: int) -> int:
        return self.coords(module, rank)["dp"]

    def coords(self, module: str, rank: int) -> dict[str, int]:
        key = (module, rank)
        if key not in self.replicas:
            self.replicas[key] = self.plan.layouts[module].coords(rank)
        return self.replicas[key]

    def first(self, module: str, replica: int, chunk: int) -> int:
        """The first rank of a replica's stage chunk (where a boundary message is priced from)."""
        key = (module, replica, chunk)
        if key not in self.first_rank:
            self.first_rank[key] = stage_ranks(self.plan, module, replica, chunk)[0]
        return self.first_rank[key]

    def add(self, rank: int, a: Action) -> int:
        i, kind = len(self.tasks), a.kind
        if kind in _COMPUTE:
            task = self._compute(rank, a)
            self.tasks.append(task)
            self.last_compute[rank] = i
            if self.gathering and task.duration > 0 and (rank, a.module, a.stage) in self.gathering:
                self._wait_for_gather(task, self.gathering.pop((rank, a.module, a.stage)))
        elif kind is Kind.REDUCE:  # after the chunk's last backward, the compute action before it
            me = self.coords(a.module, rank)
            group = (a.module, a.stage, me["cp"], me["tp"])
            if group not in self.reductions:
                self.reductions[group] = grad_reduce_s(self.cost, self.cluster, self.plan, *group)
            seconds = self.reductions[group]
            last = self.tasks[self.last_compute[rank]]
            delay = self._overlapped_reduce(last, a, seconds, me) if seconds > 0 else 0.0
            self.tasks.append(Task("", rank, seconds, [(self.last_compute[rank], delay)], a.module, "C", action=a))
        else:
            self.tasks.append(Task("", rank, 0.0, [], a.module, _TEXT[kind], action=a))
            if kind is Kind.SEND_F or kind is Kind.SEND_B:
                to = a.peer_rank if a.peer_rank is None else self.stand_in.get(a.peer_rank, a.peer_rank)
                self.sends[(rank, a.module, a.stage, kind, a.microbatch, a.sub, a.peer, to)] = i
            else:
                self.recvs.append((i, rank, a))
        return i

    def gather(self, rank: int, module: str, chunk: int, seconds: float) -> int:
        """A chunk's FSDP gather, issued at the step's start on the rank's communication stream; its
        first forward with data waits for it (`_wait_for_gather`)."""
        self.gathering[(rank, module, chunk)] = len(self.tasks)
        self.tasks.append(Task(f"fsdp gather {module}.s{chunk}", rank, seconds, [], module, "C"))
        return len(self.tasks) - 1

    def _wait_for_gather(self, task: Task, gather: int) -> None:
        """The chunk's first compute with data computes beside its gather (`first_forward_gather`)."""
        layout = self.plan.layouts[task.action.module]
        blocks = chunk_blocks(self.cost, layout, task.action.module, task.action.stage)
        extra, delay = first_forward_gather(self.tasks[gather].duration, task.duration, blocks,
                                            self.cluster.device.overlap_slowdown)
        task.duration += extra
        task.deps.append((gather, delay))

    def _overlapped_reduce(self, last: Task, a: Action, seconds: float, me: dict[str, int]) -> float:
        """Where the chunk reduces inside its last backward (a fused BW just before; `reduces_in_backward`):
        slow that backward by the share of the reduction beside it and return the reduction's start
        relative to its end (negative); else 0."""
        if a.module not in self.in_backward:
            self.in_backward[a.module] = reduces_in_backward(self.cost, self.plan, a.module)
        action = last.action
        if not self.in_backward[a.module] or action is None or action.kind is not Kind.BW \
                or (action.module, action.stage) != (a.module, a.stage):
            return 0.0
        exposed = reduce_exposed_s(self.cost, self.cluster, self.plan, a.module, a.stage, last.duration,
                                   me["cp"], me["tp"])
        slowdown = self.cluster.device.overlap_slowdown
        last.duration += (seconds - exposed) * slowdown / (1 + slowdown)
        return exposed - seconds

    def _phase(self, a: Action) -> tuple[str, bool, bool]:
        """(kind, W-only stage's W, stage has W) of a compute action, once per stage and kind."""
        key = (a.module, a.stage, a.kind)
        if key not in self.phases:
            self.phases[key] = phase(self.graph, a)
        return self.phases[key]

    def _compute(self, rank: int, a: Action) -> Task:
        kind, w_only, has_w = self._phase(a)
        key = StageKey(a.module, self.replica(a.module, rank), a.stage)
        unit = (key, a.microbatch, a.sub, kind)
        if unit not in self.units:  # every rank of the stage's TP x CP group times the unit alike
            self.units[unit] = self._unit_task(key, a, kind, w_only, has_w)
        name, duration, mem, flops, transient = self.units[unit]
        return Task(name, rank, duration, [], a.module, kind, mem, flops, transient, action=a)

    def _unit_task(self, key: StageKey, a: Action, kind: str, w_only: bool,
                   has_w: bool) -> tuple[str, float, float, float, float]:
        """(name, seconds, activation bytes, FLOPs, transient bytes) of one phase of a unit."""
        work = self.iw.unit(key, a.microbatch, a.sub)
        name = f"{a.module}.r{key.replica}.s{a.stage}.{kind}{a.microbatch}" + ("" if a.sub is None else f".{a.sub}")
        if work is None:  # this replica has no data in the unit
            return name, 0.0, 0.0, 0.0, 0.0
        split = NO_SPLIT
        if kind in ("B", "W") and has_w and not w_only:  # a backward split into B and W
            split = split_extra(self.cost, self.plan, a.module, a.stage, self.gathers)
        duration = compute_seconds(work, kind, w_only, split) + collective_extra(
            self.plan, self.cost, key, work, kind, self.cluster, self.gathers)
        share = compute_seconds(work, kind, w_only) / max(work.times.total, 1e-30)  # FLOPs: the split adds none
        mem, transient = unit_memory(work, kind, w_only, has_w)
        return name, duration, mem, work.flops * share, transient

    def link_receives(self, closed: bool) -> None:
        """Make every receive wait for its messages; where not ``closed``, a message from a rank
        whose tasks are not built is taken as arrived at the start. A message from a rank that a
        representative stands in for comes from the representative's send, priced from the rank."""
        sends, stand_in, cluster = self.sends, self.stand_in, self.cluster
        for i, rank, a in self.recvs:
            deps = []
            for src, send, nbytes in self._senders(rank, a):
                key = (stand_in.get(src, src), *send)
                if key in sends:
                    deps.append((sends[key], p2p_s(nbytes, src, rank, cluster)))
                elif closed:
                    raise KeyError(f"{a} on rank {rank}: rank {src} sends no {send}")
            self.tasks[i].deps = deps

    def _senders(self, rank: int, a: Action) -> list[tuple[int, tuple, float]]:
        """(rank, send, bytes) of every message a receive waits for, each send as the sender's
        table keys it: (module, stage, kind, microbatch, sub, peer stage, peer rank)."""
        m, iw = a.microbatch, self.iw
        if a.peer is None:  # a stage message from the neighbouring chunk's rank
            forward = a.kind is Kind.RECV_F
            src = a.stage - 1 if forward else a.stage + 1
            send = (a.module, src, Kind.SEND_F if forward else Kind.SEND_B, m, a.sub, None, rank)
            work = iw.unit(StageKey(a.module, self.replica(a.module, rank), a.stage - 1 if forward else a.stage),
                           m, a.sub)
            return [(a.peer_rank, send, work.send_bytes if work else 0.0)]
        if self.crossing is None:
            self.crossing = _crossing(iw)
        if a.module == LLM:  # boundary rows of every encoder replica holding some of this replica's
            enc, d = a.peer.module, self.replica(LLM, rank)
            send = (enc, a.peer.stage, Kind.SEND_F, m, None, StageRef(LLM, 0), None)
            return [(self.first(enc, e, a.peer.stage), send, iw.boundary_bytes[(enc, e, d, m)])
                    for e in self.crossing[0].get((enc, d, m), ())]
        e = self.replica(a.module, rank)  # boundary gradients from every LLM replica it encoded for
        send = (LLM, 0, Kind.SEND_B, m, None, StageRef(a.module, a.stage), None)
        return [(self.first(LLM, d, 0), send, iw.boundary_bytes[(a.module, e, d, m)])
                for d in self.crossing[1].get((a.module, e, m), ())]


def _crossing(iw: IterationWork) -> tuple[dict[tuple, list[int]], dict[tuple, list[int]]]:
    """Who meets at the boundary in each microbatch: (encoder, LLM replica, microbatch) -> the
    encoder replicas sending it rows, (encoder, encoder replica, microbatch) -> the LLM replicas
    receiving its rows, each in order."""
    to_llm: dict[tuple[str, int, int], list[int]] = {}
    to_encoder: dict[tuple[str, int, int], list[int]] = {}
    for enc, e, d, m in sorted(iw.boundary_bytes):
        to_llm.setdefault((enc, d, m), []).append(e)
        to_encoder.setdefault((enc, e, m), []).append(d)
    return to_llm, to_encoder


def build_tasks(plan: Plan, cost: CostModel, iw: IterationWork, actions: dict[int, list[Action]],
                graph: StageGraph, cluster: ClusterSpec, closed: bool = True, stand_in: Mapping[int, int] | None = None,
                ) -> tuple[list[Task], dict[int, list[int]], dict[Hashable, list[int]]]:
    """Tasks, per-rank compute queues and communication queues (per rank, and one per lockstep
    barrier: `_lockstep`) for `harmonia.sim.engine.replay`.

    Args:
        plan: the layouts the actions were placed with.
        cost: the cost model.
        iw: the iteration's stage work.
        actions: every rank's action list (`plan_rank_actions`).
        graph: the schedule's stage graph (what trains where).
        cluster: the cluster model.
        closed: every message a receive of ``actions`` waits for is sent by a rank of ``actions``
            (a KeyError otherwise); False: a message from another rank is taken as arrived at the
            start, so every task starts no later than among all ranks (`harmonia.sim.parts.column_s`).
        stand_in: rank -> the rank of ``actions`` replayed in its stead, for ranks that run in
            lockstep with it (`harmonia.sim.lockstep`): their messages come from it, and a barrier
            over a DP group waits for the group's representatives.
    """
    b = _Builder(plan, cost, iw, graph, cluster, stand_in)
    queue: dict[int, list[int]] = {}
    comm: dict[Hashable, list[int]] = {}
    gathers = step_gathers(cost, cluster, plan)
    for rank, acts in actions.items():
        queue[rank], comm[rank] = [], []
        for module, chunk, seconds in gathers.get(rank, ()):  # issued first, on the communication stream
            if seconds > 0:
                comm[rank].append(b.gather(rank, module, chunk, seconds))
        for a in acts:
            (comm if a.kind is Kind.REDUCE else queue)[rank].append(b.add(rank, a))
    b.link_receives(closed)
    _lockstep(b, queue, comm)
    return b.tasks, queue, comm


_GATHERED = frozenset((Kind.F, Kind.B, Kind.BW))
"""The phases a chunk that reshards per microbatch gathers its weights for, and the phases whose TP
all-reduces and CP K/V all-gathers run inside."""


def _lockstep(b: _Builder, queue: dict[int, list[int]], comm: dict) -> None:
    """Couple the ranks that meet in one phase's collectives (module docstring): the DP group of
    every resharded chunk's phase, per (chunk, microbatch, sub-microbatch, phase, DP group: the
    ranks standing in for its members, where representatives replay for groups), and the
    TP x CP group of an LLM phase where the group's ranks hold different encoder replicas (so run
    different work between its phases; `_uneven_groups`). Per group with more than one member among
    the built ranks: a start barrier after each member's previous task, which every member waits
    for, and an end barrier after every member, which each member's next task waits for. The
    barriers take no time and run on queues of their own (keys ``("sync", i)`` of ``comm``); a
    member's compute stays its own, so the wait shows as idle time."""
    groups: dict[tuple, list[tuple[int, int, int]]] = {}  # group -> (rank, position in its queue, task)
    resharded = {m for m, layout in b.plan.layouts.items() if b.cost.reshards(layout)}
    uneven = _uneven_groups(b.plan)
    dp_groups: dict[tuple, int] = {}  # (module, pipeline rank, cp, tp) -> its DP group's lowest stand-in
    for rank, q in queue.items():
        coupled = resharded | {LLM} if rank in uneven else resharded  # the modules whose phases it syncs
        if not coupled:
            continue
        for at, i in enumerate(q):
            a = b.tasks[i].action
            if a is None or a.module not in coupled or a.kind not in _GATHERED:
                continue
            me = b.coords(a.module, rank)
            if a.module in resharded:
                where = (a.module, me["pp"], me["cp"], me["tp"])
                if where not in dp_groups:
                    group = stage_group(b.plan.layouts[a.module], me["pp"], "dp", 0, me["cp"], me["tp"])
                    dp_groups[where] = min(b.stand_in.get(r, r) for r in group)
                groups.setdefault(("dp", a.module, a.stage, a.microbatch, a.sub, a.kind, dp_groups[where]),
                                  []).append((rank, at, i))
            if a.module == LLM and rank in uneven:
                groups.setdefault(("tp x cp", a.module, a.stage, a.microbatch, a.sub, a.kind, me["dp"]),
                                  []).append((rank, at, i))
    for key, members in groups.items():
        if len(members) < 2:
            continue
        module, rank0 = key[1], members[0][0]
        name = f"{key[0]} sync {module}.s{key[2]}.{key[5].value}{key[3]}" + ("" if key[4] is None else f".{key[4]}")
        start = len(b.tasks)
        b.tasks.append(Task(name, rank0, 0.0, [(queue[r][at - 1], 0.0) for r, at, _ in members if at], module, "C"))
        end = len(b.tasks)
        b.tasks.append(Task(f"{name} done", rank0, 0.0, [(i, 0.0) for _, _, i in members], module, "C"))
        comm[("sync", start)], comm[("sync", end)] = [start], [end]
        for r, at, i in members:
            b.tasks[i].deps.append((start, 0.0))
            if at + 1 < len(queue[r]):
                b.tasks[queue[r][at + 1]].deps.append((end, 0.0))


def _uneven_groups(plan: Plan) -> frozenset[int]:
    """LLM ranks whose TP x CP group (one replica's stage chunk) holds different encoder replicas:
    their encoder work between two LLM phases differs, and the phase's collectives wait for the
    last of them."""
    return _uneven(tuple(plan.layouts.items()))


@functools.lru_cache(maxsize=4096)
def _uneven(layouts: tuple[tuple[str, Layout], ...]) -> frozenset[int]:
    """`_uneven_groups` of a plan's layouts (kept: every simulation of a plan asks again)."""
    llm = dict(layouts)[LLM]
    if llm.tp * llm.cp == 1:
        return frozenset()
    out: set[int] = set()
    for d in range(llm.dp):
        for p in range(llm.pp):
            group = llm_group(llm, d, p)
            held = {tuple((m, lay.coords(r)["dp"]) for m, lay in layouts if m != LLM and lay.holds(r)) for r in group}
            if len(held) > 1:
                out.update(group)
    return frozenset(out)


def simulate_schedule(plan: Plan, cost: CostModel, cluster: ClusterSpec, iw: IterationWork,
                      schedule: IterationSchedule, lockstep: bool = True) -> Timeline:
    """One iteration of ``schedule`` as the executor runs it: every rank's action list
    (`plan_rank_actions`), timed with the stage work ``iw`` on the cluster model; ``lockstep``:
    each group of ranks that run in lockstep replayed once (`simulate_ranks`), else every rank."""
    return simulate_ranks(plan, cost, cluster, iw, schedule, lockstep=lockstep)


def simulate_ranks(plan: Plan, cost: CostModel, cluster: ClusterSpec, iw: IterationWork, schedule: IterationSchedule,
                   ranks: Iterable[int] | None = None, closed: bool = True, lockstep: bool = True) -> Timeline:
    """The action lists of ``ranks`` (default: every rank) timed with the stage work ``iw``.

    With ``lockstep`` (and ``closed``: ``ranks`` are every rank, or a part no message leaves), the
    ranks that run in lockstep replay once, one representative per group
    (`harmonia.sim.lockstep`): the result is the whole replay's, every rank's tasks, times and peak,
    at the cost of the distinct ranks. ``closed=False`` as `build_tasks` takes it."""
    with _no_cycle_collection():
        groups = {}
        if lockstep and closed and not cluster.shares_cores:
            groups = lockstep_groups(plan, cost, cluster, iw, rank_compute_actions(plan.layouts, schedule, ranks))
        if not groups:
            actions = plan_rank_actions(plan.layouts, schedule, ranks)
            return replay_on(cluster, cost, *build_tasks(plan, cost, iw, actions, schedule.graph, cluster, closed))
        stand_in = stand_ins(groups)
        wanted = {r for lay in plan.layouts.values() for r in lay.rank_list()} if ranks is None else set(ranks)
        actions = plan_rank_actions(plan.layouts, schedule, [r for r in wanted if stand_in.get(r, r) == r])
        timeline = replay(*build_tasks(plan, cost, iw, actions, schedule.graph, cluster, closed, stand_in))
        return with_copies(timeline, groups, plan)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Keep the cyclic garbage collector off while a replay is built and run: it allocates hundreds
    of thousands of actions, tasks and lists, none in a reference cycle, and the collector's
    repeated scans of them would cost a third of its time (reference counting still frees them)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def replay_on(cluster: ClusterSpec, cost: CostModel, tasks: list[Task], queue: dict[int, list[int]],
              comm: dict[Hashable, list[int]]) -> Timeline:
    """`build_tasks`' output replayed on ``cluster``: its ranks sharing its cores where they
    outnumber them (`harmonia.sim.shared`), with the CPU the calibration measured their processes
    spending beside their compute; each on a device of its own otherwise."""
    if cluster.shares_cores:
        host = cost.calibration.host_cpu_s if cost.calibration is not None else {}
        return replay_shared(tasks, queue, comm, cluster.node_of, cluster.cores, host)
    return replay(tasks, queue, comm)


def simulated_step(plan: Plan, cost: CostModel, cluster: ClusterSpec) -> Callable[[IterationWork, IterationSchedule], float]:
    """The simulated iteration seconds of stage work under a schedule: the score the per-batch
    sub-microbatch search chooses by (`harmonia.schedule.order_search.search_submicrobatches`)."""
    def step(work: IterationWork, schedule: IterationSchedule) -> float:
        return simulate_schedule(plan, cost, cluster, work, schedule).iteration_s
    return step


class SimulatedOrders:
    """The simulated step of one iteration's stage work under each microbatch order asked for, each
    order simulated once: the ``step`` the per-batch order search checks its pick against the
    default order with (`harmonia.schedule.order_search.search_order`), whose timelines the caller
    then reuses for the order it runs."""

    def __init__(self, plan: Plan, cost: CostModel, cluster: ClusterSpec, work: IterationWork,
                 schedule_of: Callable[[list[int] | None], IterationSchedule]) -> None:
        """``schedule_of`` builds the schedule every rank runs for an order (None: the default)."""
        self.plan, self.cost, self.cluster, self.work, self.schedule_of = plan, cost, cluster, work, schedule_of
        self._timelines: dict[tuple[int, ...] | None, Timeline] = {}

    def timeline(self, order: list[int] | None) -> Timeline:
        """The simulated iteration with the microbatches in ``order``."""
        key = None if order is None else tuple(order)
        if key not in self._timelines:
            self._timelines[key] = simulate_schedule(self.plan, self.cost, self.cluster, self.work,
                                                     self.schedule_of(order))
        return self._timelines[key]

    def __call__(self, order: list[int], family: str) -> float:
        """Simulated seconds of the iteration in ``order`` (``family`` is the plan's schedule)."""
        return self.timeline(order).iteration_s
