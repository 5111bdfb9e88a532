"""Frozen-aware stage partitioning: split a module's layers into contiguous pipeline stages.

The cost of a layer is its F + B + W seconds for a reference load (a profiled microbatch), taken
from the cost model, so frozen layers (no W, maybe no B) weigh less and a stage of them holds more
layers. The split minimises the slowest stage exactly, by dynamic programming over contiguous
layers (the classic linear partition problem): ``best[k][j]`` is the smallest possible maximum
stage cost when the first ``j`` layers form ``k`` stages,

    best[k][j] = min over i < j of max(best[k-1][i], sum(cost[i:j]))

in O(k n^2) time, with ties broken towards the smaller memory peak and then towards earlier
boundaries. Embedding and LM-head layers are ordinary entries of the layer list (first and last),
so they land in the first and last stage. An optional per-stage memory cap forbids stages whose
activation + state bytes exceed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harmonia.errors import LayoutError
from harmonia.workload.cost import CostModel
from harmonia.workload.work import ModuleLoad


def plan_stage_split(
    costs: Sequence[float],
    n_stages: int,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    allow_empty: bool = False,
) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage.

    Args:
        costs: seconds per layer, in order.
        n_stages: number of stage chunks.
        memory: bytes per layer (for the cap and tie-breaking); default zeros.
        memory_cap: the most bytes one stage may hold; None = no cap.
        allow_empty: permit stages without layers (only useful when ``n_stages > len(costs)``).

    Returns:
        Layer counts per stage, summing to ``len(costs)``.

    Raises:
        LayoutError: when no split satisfies the constraints (says how many stages would).
    """
    n = len(costs)
    if n_stages < 1:
        raise LayoutError(f"n_stages={n_stages} must be >= 1")
    if n_stages > n and not allow_empty:
        raise LayoutError(
            f"cannot split {n} layers into {n_stages} non-empty stages; use at most {n} stages"
        )
    cost = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    mem = np.concatenate([[0.0], np.cumsum(np.asarray(memory if memory is not None else [0.0] * n, dtype=float))])
    cap = np.inf if memory_cap is None else memory_cap
    inf = np.inf
    best = np.full((n_stages + 1, n + 1), inf)
    peak = np.full((n_stages + 1, n + 1), inf)
    arg = np.zeros((n_stages + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    peak[0, 0] = 0.0
    min_len = 0 if allow_empty else 1
    # (j, i): the last stage holds layers i .. j-1; a start must leave it at least min_len layers
    starts = np.arange(n + 1)
    allowed = starts[None, :] <= starts[:, None] - min_len
    stage_cost = cost[:, None] - cost[None, :]
    stage_mem = mem[:, None] - mem[None, :]
    allowed &= stage_mem <= cap
    for k in range(1, n_stages + 1):
        value = np.maximum(best[k - 1][None, :], stage_cost)
        value[~allowed | (best[k - 1] == inf)[None, :]] = inf
        lowest = value.min(axis=1)
        ties = (value <= lowest[:, None] + 1e-15) & (lowest[:, None] < inf)
        peaks = np.where(ties, np.maximum(peak[k - 1][None, :], stage_mem), inf)
        pick = np.argmin(peaks, axis=1)  # the smallest peak among ties, then the earliest boundary
        reached = lowest < inf
        rows = np.flatnonzero(reached)
        best[k, rows] = value[rows, pick[rows]]
        peak[k, rows] = peaks[rows, pick[rows]]
        arg[k, rows] = pick[rows]
    if best[n_stages, n] == inf:
        heaviest = float(np.max(np.diff(mem))) if n else 0.0
        hint = ("a single layer needs more than the cap; shard it further (tp/fsdp)"
                if heaviest > cap else "use more pipeline stages or shard states with FSDP")
        raise LayoutError(
            f"no split of {n} layers into {n_stages} stages keeps every stage under "
            f"{cap / 2**30:.2f} GiB; {hint}"
        )
    split, j = [], n
    for k in range(n_stages, 0, -1):
        i = int(arg[k, j])
        split.append(j - i)
        j = i
    return tuple(reversed(split))


def layer_seconds(cost: CostModel, module: str, load: ModuleLoad, tp: int = 1, cp: int = 1) -> list[float]:
    """F + B + W seconds of each layer of ``module`` for a reference load."""
    return [cost.stage_times(module, load, i, i + 1, tp, cp).total for i in range(len(cost.layers[module]))]


def layer_memory(cost: CostModel, module: str, tokens_in_flight: int, tp: int = 1, cp: int = 1,
                 fsdp_shards: int = 1) -> list[float]:
    """Bytes per layer: states (sharded) plus activations of ``tokens_in_flight`` tokens."""
    return [
        cost.state_bytes(module, i, i + 1, tp, fsdp_shards)
        + cost.activation_bytes(module, tokens_in_flight, i, i + 1, tp, cp)
        for i in range(len(cost.layers[module]))
    ]


def plan_module_stages(cost: CostModel, module: str, load: ModuleLoad, n_stages: int, tp: int = 1,
                       cp: int = 1, fsdp_shards: int = 1, tokens_in_flight: int = 0,
                       memory_cap: float | None = None) -> tuple[int, ...]:
    """Frozen-aware split of one module's layers (embedding and head included) into stages."""
    return plan_stage_split(
        layer_seconds(cost, module, load, tp, cp), n_stages,
        layer_memory(cost, module, tokens_in_flight, tp, cp, fsdp_shards), memory_cap,
    )
