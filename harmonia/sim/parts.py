"""Independent parts of one simulated iteration: sets of ranks that no message crosses.

The simulator couples ranks only by messages (`harmonia.sim.tasks`): stage messages inside one
replica of a module, and boundary transfers between an encoder replica and the LLM replicas whose
samples it encodes, and the lockstep of a chunk that gathers its weights per microbatch (``fsdp
reshard``): its DP group runs each gathered phase together; and of an LLM stage chunk's TP x CP
group whose ranks hold different encoder replicas (inside one LLM replica). A DP gradient
reduction, a step's FSDP gather and the other TP/CP collectives are priced into a rank's own tasks
and wait for no other rank. So the ranks fall into parts: each LLM replica joined with the encoder replicas that feed
it, joined again wherever a rank holds stages of several replicas (a colocated encoder) and across
the replicas of a resharded chunk, and where a node's ranks share its cores (a CPU job), every rank of the
node. Parts replay independently: the iteration lasts as long as its
longest part, and any part's time is a lower bound on it. The planner simulates a candidate's
busiest part first and drops the candidate once a part exceeds the best score
(`harmonia.plan.search`), at a fraction of a whole simulation.

Before its busiest part, it simulates that part's busiest column (`busiest_column`: one LLM rank
per pipeline rank at the same ``dp``/``cp``/``tp`` coordinates, with the encoder copies those ranks
hold), each message from a rank outside the column taken as arrived at the start and no lockstep
with the ranks outside it. Every rank runs its list in order and a task waits only for its
rank's previous task, its messages and its lockstep barriers, so dropping waits only moves starts
earlier: every task of the column starts no later than in the whole
simulation, and the column's time is a lower bound on the part's, at the cost of its few ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

from harmonia.schedule.graph import LLM, IterationSchedule
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import IterationWork
from harmonia.sim.engine import Timeline
from harmonia.sim.tasks import simulate_ranks
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec


def independent_parts(plan: Plan, cost: CostModel, iw: IterationWork, busy: Mapping[int, float] | None = None,
                      cluster: ClusterSpec | None = None) -> list[tuple[int, ...]]:
    """The iteration's parts (see the module docstring), each its ranks in order; the parts ordered
    by their busiest rank's seconds in ``busy``, most first (default: by their first rank). On a
    ``cluster`` whose nodes' ranks share fewer cores than they are, a node's ranks are one part:
    each computes at a rate set by how many of them compute at once (`harmonia.sim.shared`). The
    parts are kept on the assignment per set of layouts (plans differing only in schedule or
    recomputation share them: messages and lockstep follow the layouts and the boundary alone)."""
    shared = cluster is not None and cluster.shares_cores
    key = ("independent parts", cost, tuple(plan.layouts.items()), cluster if shared else None)
    out = iw.assignment.memo.get(key)
    if out is None:
        out = iw.assignment.memo[key] = _parts(plan, cost, iw, cluster if shared else None)
    if busy is not None:
        return sorted(out, key=lambda p: -max(busy.get(r, 0.0) for r in p))
    return list(out)


def _parts(plan: Plan, cost: CostModel, iw: IterationWork, cluster: ClusterSpec | None) -> list[tuple[int, ...]]:
    """`independent_parts` in rank order of their first rank, found afresh (``cluster``: one whose
    nodes' ranks share their cores, else None)."""
    parent: dict[tuple[str, int], tuple[str, int]] = {}  # over module replicas: a rank joins those it holds

    def root(x: tuple[str, int]) -> tuple[str, int]:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(a: tuple[str, int], b: tuple[str, int]) -> None:
        parent[root(b)] = root(a)

    held: dict[int, tuple[str, int]] = {}  # rank -> the first replica it holds
    for module, layout in plan.layouts.items():
        group = layout.cp * layout.tp  # ranks are in grid order (pp, dp, cp, tp)
        for i, r in enumerate(layout.rank_list()):
            mine = (module, i // group % layout.dp)
            if r in held:
                join(held[r], mine)
            else:
                held[r] = root(mine)
        if cost.reshards(layout):  # its DP groups run each gathered phase in lockstep
            for d in range(1, layout.dp):
                join((module, 0), (module, d))
    for enc, e, d in {(enc, e, d) for enc, e, d, _ in iw.boundary_bytes}:  # every microbatch alike
        join((enc, e), (LLM, d))
    if cluster is not None:
        first: dict[int, tuple[str, int]] = {}  # node -> the replica of its first rank
        for r in sorted(held):
            node = cluster.node_of(r)
            if node in first:
                join(first[node], held[r])
            else:
                first[node] = held[r]
    parts: dict[tuple[str, int], list[int]] = {}
    for r in sorted(held):
        parts.setdefault(root(held[r]), []).append(r)
    return [tuple(p) for p in parts.values()]


def busiest_column(plan: Plan, part: tuple[int, ...], busy: Mapping[int, float]) -> tuple[int, ...] | None:
    """The LLM ranks of ``part`` at one ``dp``/``cp``/``tp`` position, one per pipeline rank: the
    column holding the busiest rank in ``busy``, in order (None where it is the whole part)."""
    llm = plan.layouts[LLM]
    best: tuple[int, ...] | None = None
    most = -1.0
    seen = set()
    for rank in part:
        if not llm.holds(rank):
            continue
        me = llm.coords(rank)
        position = (me["dp"], me["cp"], me["tp"])
        if position in seen:
            continue
        seen.add(position)
        column = tuple(llm.rank_at(pp=p, dp=me["dp"], cp=me["cp"], tp=me["tp"]) for p in range(llm.pp))
        load = max(busy.get(r, 0.0) for r in column)
        if load > most:
            best, most = column, load
    if best is None or len(best) >= len(part):
        return None
    return tuple(sorted(best))


def simulate_part(plan: Plan, cost: CostModel, cluster: ClusterSpec, iw: IterationWork, schedule: IterationSchedule,
                  ranks: tuple[int, ...], closed: bool = True, lockstep: bool = True) -> Timeline:
    """One part of the iteration of ``schedule``: the action lists of ``ranks`` timed as
    `harmonia.sim.tasks.simulate_schedule` times every rank's (the same start and end per task),
    each group of ranks in lockstep replayed once where ``lockstep``. ``closed=False``: ``ranks``
    are some of a part's (`busiest_column`), their messages from other ranks taken as arrived at
    the start; every task starts no later than in the whole simulation."""
    return simulate_ranks(plan, cost, cluster, iw, schedule, ranks, closed, lockstep)
