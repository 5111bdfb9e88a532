"""The replicas a search bounds a batch's stage work on: the heaviest few of every module.

`harmonia.plan.bounds.work_bound_busy` takes the busiest rank's seconds and every priced LLM
replica's pipeline fill and drain. Both are sums and maxima of non-negative unit durations, so
over the units of some replicas they are at most what they are over all: a bound still (the
search's pruning stays exact), and as sharp where those replicas hold the busiest rank and the
longest pipeline. On 1,024 GPUs an iteration has tens of thousands of units (an LLM replica per
``tp x cp x pp`` ranks, times microbatches and stage chunks; an encoder replica per rank, times
microbatches), and pricing them all for every candidate and batch was most of a search's time;
the replicas with the most work are found from the assignment's per-sample costs alone.

The ranks of the chosen replicas are then made whole: every replica of every module holding one of
them is priced too, so each of those ranks' busy seconds (its LLM work and the encoder work
colocated with it) is its full sum.
"""

from __future__ import annotations

import functools

import numpy as np

from harmonia.schedule.iteration import IterationAssignment, module_columns
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan

HEAVIEST = 8
"""Replicas of each module chosen by their work (before the ranks they share are made whole)."""


def heaviest_replicas(plan: Plan, assignment: IterationAssignment, costs: np.ndarray, modules: list[str],
                      count: int = HEAVIEST) -> dict[str, set[int]] | None:
    """Per module, the replicas to price for a bound: the ``count`` with the most work and every
    replica sharing a rank with one of them (see the module docstring); None where that is every
    replica of every module.

    Args:
        assignment: the batch's assignment (positions index ``costs``).
        costs: (n, len(modules)) seconds per sample and cost-model module.
        modules: the cost model's module names.
    """
    if all(layout.dp <= count for layout in plan.layouts.values()):
        return None
    columns, names = module_columns(costs, modules, plan.encoders)
    work = {}
    for j, name in enumerate(names):
        rows, replicas = _held_rows(assignment, name)
        work[name] = np.bincount(replicas, weights=columns[rows, j], minlength=plan.layouts[name].dp)
    chosen = {name: set(np.argsort(-w, kind="stable")[:count].tolist()) for name, w in work.items()}
    ranks = {r for name, replicas in chosen.items() for d in replicas for r in _ranks_of(plan.layouts[name])[d]}
    for name in names:
        of = _replica_of(plan.layouts[name])
        chosen[name].update(of[r] for r in ranks if r in of)
    if all(len(chosen[name]) == plan.layouts[name].dp for name in names):
        return None
    return chosen


def _held_rows(assignment: IterationAssignment, module: str) -> tuple[np.ndarray, np.ndarray]:
    """Every (batch position, replica) a module's split of the assignment holds, as two arrays
    (kept on the assignment: each candidate sharing it asks again)."""
    key = ("held rows", module)
    if key not in assignment.memo:
        split = assignment.llm_split if module == "llm" else assignment.encoder_split[module]
        rows: list[int] = []
        replicas: list[int] = []
        for samples, per_replica in zip(assignment.microbatches, split):
            for d, positions in enumerate(per_replica):
                rows.extend(samples[p] for p in positions)
                replicas.extend([d] * len(positions))
        assignment.memo[key] = (np.asarray(rows, dtype=np.int64), np.asarray(replicas, dtype=np.int64))
    return assignment.memo[key]


@functools.lru_cache(maxsize=256)
def _ranks_of(layout: Layout) -> list[list[int]]:
    """Per replica, its ranks (every stage and TP x CP position)."""
    out: list[list[int]] = [[] for _ in range(layout.dp)]
    for rank, d in _replica_of(layout).items():
        out[d].append(rank)
    return out


@functools.lru_cache(maxsize=256)
def _replica_of(layout: Layout) -> dict[int, int]:
    """Rank -> the replica it belongs to (ranks are in grid order ``(pp, dp, cp, tp)``)."""
    group = layout.cp * layout.tp
    return {r: i // group % layout.dp for i, r in enumerate(layout.rank_list())}
