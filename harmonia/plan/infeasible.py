"""Why no layout exists for a request, and the nearest request that has one.

The planner's candidates can run out for two reasons, each with its own remedy:

- **memory**: layouts exist but none fits the device; the remedy is more devices (the smallest
  node count on which some candidate fits) or a device with more memory;
- **factorisation**: no ``tp x cp x pp x dp`` of the LLM's ranks is valid for this world size and
  global batch (``tp`` divides the heads within a node, ``pp`` at most the blocks, and every one of
  the ``dp`` replicas gets at least ``pp`` samples, one microbatch per stage); the remedy is a
  global batch large enough to feed the replicas, or fewer devices.

Every suggestion is checked by enumerating the candidates of the suggested request with the same
rules, the request's cost model and its profiled batches (only the cluster or the batch changes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from harmonia.errors import HarmoniaError, LayoutError
from harmonia.plan.scenario import ScenarioRun
from harmonia.workload.devices import ClusterSpec

Enumerate = Callable[[ClusterSpec, int, Counter | None], Iterator]
"""Candidates of a cluster and global batch (misfits counted in the counter), by the search's rules."""

MAX_DEVICES = 4096
"""The largest cluster a suggestion names."""


def no_layout_error(run: ScenarioRun, enumerate_: Enumerate, rejected: Counter, kind: str) -> HarmoniaError:
    """The error for a request without candidates, naming the change that gives it some."""
    scenario, cluster = run.scenario, run.cluster
    what = f"no {kind} of {scenario.model} on {scenario.cluster}"
    if rejected:
        need = smallest_fitting_cluster(run, enumerate_)
        reasons = ", ".join(f"{n} {why}" for why, n in rejected.items())
        fix = (f"use at least {need.world_size} devices ({need.describe()}) or devices with more memory" if need
               else "use devices with more memory or a smaller model")
        return LayoutError(f"{what} fits ({reasons}); {fix}")
    batch = smallest_feeding_batch(run, enumerate_)
    fewer = largest_fitting_cluster(run, enumerate_)
    llm = run.mllm.llm.body
    rules = (f"tp must divide the LLM's {llm.n_heads} heads and {llm.kv_heads} KV heads within a node of "
             f"{cluster.gpus_per_node}, pp is at most its {llm.n_layers} blocks, and each of the dp replicas "
             f"needs at least pp samples of the global batch of {scenario.global_batch}")
    fixes = []
    if batch is not None:
        fixes.append(f"a global batch of at least {batch}")
    if fewer is not None:
        fixes.append(f"{fewer.world_size} devices ({fewer.describe()})")
    fix = "use " + " or ".join(fixes) if fixes else "use another model or cluster"
    message = f"{what}: no way to factor its {cluster.world_size} devices into layouts ({rules}); {fix}"
    return LayoutError(message)


def _has_candidates(enumerate_: Enumerate, cluster: ClusterSpec, global_batch: int) -> bool:
    try:
        return next(iter(enumerate_(cluster, global_batch, None)), None) is not None
    except HarmoniaError:
        return False


def smallest_fitting_cluster(run: ScenarioRun, enumerate_: Enumerate) -> ClusterSpec | None:
    """The fewest nodes of the cluster's kind (more than it has) on which some candidate fits."""
    cluster = run.cluster
    for nodes in _node_counts(cluster.n_nodes + 1, MAX_DEVICES // cluster.gpus_per_node):
        bigger = ClusterSpec(cluster.device, nodes, cluster.gpus_per_node)
        if _has_candidates(enumerate_, bigger, run.scenario.global_batch):
            return bigger
    return None


def _node_counts(first: int, last: int) -> Iterator[int]:
    """Every node count up to 16, then steps of a quarter of the count so far, up to ``last``."""
    nodes = first
    while nodes <= last:
        yield nodes
        nodes += 1 if nodes < 16 else nodes // 4


def largest_fitting_cluster(run: ScenarioRun, enumerate_: Enumerate) -> ClusterSpec | None:
    """The most devices below the cluster's on which the global batch feeds some layout: whole
    nodes, or one partial node."""
    cluster = run.cluster
    per = cluster.gpus_per_node
    options = [ClusterSpec(cluster.device, n, per) for n in range(cluster.n_nodes - 1, 0, -1)]
    options += [ClusterSpec(cluster.device, 1, g) for g in range(min(per, cluster.world_size) - 1, 0, -1)]
    return next((c for c in options if _has_candidates(enumerate_, c, run.scenario.global_batch)), None)


def smallest_feeding_batch(run: ScenarioRun, enumerate_: Enumerate) -> int | None:
    """The smallest global batch above the request's with a candidate on its cluster: doubling until
    one has candidates (at most 4x the world size), then bisection below it."""
    low, cluster = run.scenario.global_batch, run.cluster
    high = low
    while True:
        high *= 2
        if _has_candidates(enumerate_, cluster, high):
            break
        if high > 4 * cluster.world_size:
            return None
        low = high
    while high - low > 1:
        mid = (low + high) // 2
        if _has_candidates(enumerate_, cluster, mid):
            high = mid
        else:
            low = mid
    return high
