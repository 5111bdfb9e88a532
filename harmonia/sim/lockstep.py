"""Ranks that run in lockstep, found before the replay so that each group replays once.

The members of an LLM stage chunk's TP x CP group run the same actions on the same unit of work
(`harmonia.sim.tasks` times a unit per replica, not per rank), so wherever nothing else tells them
apart they start and end every task at the same times: a whole replay would time each of them
alike. `lockstep_groups` finds the ranks a replay cannot tell apart, and the simulator replays one
representative per group (`harmonia.sim.tasks.simulate_ranks`), its tasks standing for the group's.

Two ranks run in lockstep when everything their tasks' times depend on is the same:

- their compute action lists (the very same list: `rank_compute_actions` shares one list between
  the ranks that run it) and, for every module they hold, its replica and pipeline rank (the work
  of each unit, and so every compute and in-stage collective price);
- the price of everything they send or receive from outside: whether each stage neighbour
  (previous and next pipeline rank, same ``dp``/``cp``/``tp``) and each boundary peer (the first
  rank of an encoder replica feeding their LLM replica, of an LLM replica their encoder replica
  feeds) is the rank itself, on its node or on another (`harmonia.sim.collectives.p2p_s`), and the
  bandwidth of each DP group that reduces their gradients or gathers their FSDP weights
  (`ClusterSpec.group_bandwidth`);
- what they wait for: their stage neighbours run in lockstep with each other, and so do, replica
  by replica, the DP groups a resharded chunk couples them to (`harmonia.sim.tasks._lockstep`).
  The TP x CP group an LLM phase couples holds both ranks (same replica and pipeline rank).

The first two are read off each rank; the third is a fixed point, found by partition refinement
(Moore's, as in minimising an automaton): start from the ranks alike in the first two, split a
group wherever its members' neighbours fall in different groups, until no group splits. The
groups left are stable: each member's inputs are its representative's, task by task, so the
representative's replay is each member's (the test replays both ways and compares every rank's
tasks, iteration time and peak). A message from a member's neighbour is the message from that
neighbour's representative, priced from the member's own neighbour; a barrier over a DP group
waits for its members' representatives.

The partition costs O(ranks x neighbours) per round, a few rounds (a difference travels one
pipeline rank per round); ranks that share cores are never grouped (`harmonia.sim.shared` shares a
node's cores among all of its ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import replace

from harmonia.schedule.actions import Action
from harmonia.schedule.graph import LLM
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork, stage_ranks
from harmonia.sim.collectives import stage_group
from harmonia.sim.engine import Task, Timeline
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec


def lockstep_groups(plan: Plan, cost: CostModel, cluster: ClusterSpec, iw: IterationWork,
                    compute: Mapping[int, list[Action]]) -> dict[int, tuple[int, ...]]:
    """The groups of ``compute``'s ranks that run in lockstep (module docstring).

    Args:
        plan, cost, cluster, iw: what the ranks are simulated with.
        compute: every simulated rank's compute actions (`rank_compute_actions`); the ranks must
            be closed under messages (every rank, or an independent part: `harmonia.sim.parts`).

    Returns:
        representative (the group's lowest rank) -> the group's other ranks, for every group of
        more than one rank; empty when no two ranks run in lockstep.
    """
    if cluster.shares_cores:
        return {}
    ranks = sorted(compute)
    keys, neighbours, couplings, coupled = _signatures(plan, cost, cluster, iw, compute, ranks)
    group = _numbered(keys, ranks)
    while True:
        seen: dict = {}
        coupling = {g: _intern(tuple(group.get(p, -1 - p) for p in members), seen) for g, members in coupled.items()}
        refined = _numbered([(group[r], tuple(group.get(n, -1 - n) for n in neighbours[r]),
                              tuple(coupling[g] for g in couplings[r])) for r in ranks], ranks)
        if len(set(refined.values())) == len(set(group.values())):
            break
        group = refined
    members: dict[int, list[int]] = {}
    for r in ranks:
        members.setdefault(group[r], []).append(r)
    return {m[0]: tuple(m[1:]) for m in members.values() if len(m) > 1}


def _signatures(plan: Plan, cost: CostModel, cluster: ClusterSpec, iw: IterationWork,
                compute: Mapping[int, list[Action]], ranks: list[int]) -> tuple[list, dict, dict, dict]:
    """Per rank: what it runs and how its messages and reductions are priced (``keys``, in ``ranks``
    order), its stage neighbours (``neighbours``), and the DP groups a resharded chunk couples it
    to (``couplings``, each group's ranks in ``coupled``)."""
    layouts = sorted(plan.layouts.items())
    node = cluster.node_of
    fed, feeds = _boundary_peers(plan, iw)
    keys, neighbours, couplings, coupled = [], {}, {}, {}
    bandwidths: dict[tuple, float] = {}  # (module, pp, cp, tp) -> its DP group's bandwidth
    for r in ranks:
        mine, near, bits, locked = [id(compute[r])], [], [], []
        for m, lay in layouts:
            if not lay.holds(r):
                continue
            me = lay.coords(r)
            p, d, c, t = me["pp"], me["dp"], me["cp"], me["tp"]
            mine.append((m, d, p))
            for q in sorted({(p - 1) % lay.pp, (p + 1) % lay.pp} - {p}):
                n = lay.rank_at(pp=q, dp=d, cp=c, tp=t)
                near.append(n)
                bits.append(node(n) == node(r))
            if m == LLM and p == 0:
                bits += [_distance(src, r, node) for src in fed.get(d, ())]
            if m != LLM and p == (lay.n_stages - 1) % lay.pp:
                bits += [_distance(dst, r, node) for dst in feeds.get((m, d), ())]
            if lay.dp > 1:
                where = (m, p, c, t)
                if where not in bandwidths:
                    group = stage_group(lay, p, "dp", 0, c, t)
                    bandwidths[where] = cluster.group_bandwidth(group)
                    if cost.reshards(lay):
                        coupled[where] = group
                bits.append(bandwidths[where])
                if where in coupled:
                    locked.append(where)
        keys.append((tuple(mine), tuple(bits)))
        neighbours[r], couplings[r] = near, locked
    return keys, neighbours, couplings, coupled


def _distance(peer: int, rank: int, node: Callable[[int], int]) -> int:
    """How a message between two ranks is priced (`p2p_s`): 0 on one rank, 1 in one node, 2 across."""
    return 0 if peer == rank else 1 if node(peer) == node(rank) else 2


def _boundary_peers(plan: Plan, iw: IterationWork) -> tuple[dict[int, list[int]], dict[tuple[str, int], list[int]]]:
    """(LLM replica -> the first ranks of the encoder replicas feeding it, (encoder, replica) ->
    the first ranks of the LLM replicas it feeds), as the boundary messages are priced from."""
    pairs = sorted({(enc, e, d) for enc, e, d, _ in iw.boundary_bytes})
    fed: dict[int, list[int]] = {}
    feeds: dict[tuple[str, int], list[int]] = {}
    for enc, e, d in pairs:
        last = plan.layouts[enc].n_stages - 1
        fed.setdefault(d, []).append(stage_ranks(plan, enc, e, last)[0])
        feeds.setdefault((enc, e), []).append(stage_ranks(plan, LLM, d, 0)[0])
    return fed, feeds


def _intern(key: Hashable, seen: dict) -> int:
    return seen.setdefault(key, len(seen))


def _numbered(keys: list, ranks: list[int]) -> dict[int, int]:
    """Rank -> the number of its key (equal keys, equal numbers); ``keys`` in ``ranks`` order."""
    seen: dict = {}
    return {r: _intern(k, seen) for r, k in zip(ranks, keys)}


def stand_ins(groups: Mapping[int, tuple[int, ...]]) -> dict[int, int]:
    """Every grouped rank -> its group's representative."""
    out = {rep: rep for rep in groups}
    for rep, others in groups.items():
        for r in others:
            out[r] = rep
    return out


def with_copies(timeline: Timeline, groups: Mapping[int, tuple[int, ...]], plan: Plan) -> Timeline:
    """The replay of the representatives as every rank's timeline: each group's ranks take their
    representative's busy seconds and peak, its tasks stand for theirs (`Timeline.copies`)."""
    busy, peak = dict(timeline.busy_s), dict(timeline.peak_mem)
    for rep, others in groups.items():
        for r in others:
            busy[r], peak[r] = busy[rep], peak[rep]
    ranks = sorted({*timeline.ranks, *(r for others in groups.values() for r in others)})
    return Timeline(timeline.replayed, timeline.replayed_start, timeline.replayed_end, ranks, timeline.iteration_s,
                    busy, peak, {rep: tuple(others) for rep, others in groups.items()}, member_task(plan))


def member_task(plan: Plan) -> Callable[[Task, int], Task]:
    """A representative's task as another rank of its group runs it: the same times, its stage
    messages to and from that rank's own neighbours."""
    def copy(task: Task, rank: int) -> Task:
        a = task.action
        if a is None or a.peer_rank is None:
            return replace(task, rank=rank, deps=[])
        lay = plan.layouts[a.module]
        me = lay.coords(rank)
        peer = lay.rank_at(pp=lay.coords(a.peer_rank)["pp"], dp=me["dp"], cp=me["cp"], tp=me["tp"])
        moved = replace(a, peer_rank=peer)
        return replace(task, label="", rank=rank, deps=[], action=moved)
    return copy
