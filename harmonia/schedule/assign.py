"""How each recipe splits a global batch into DP replicas and microbatches.

- ``sequential`` (Megatron-LM, Cornstarch): the batch in dataset order, cut into equal contiguous
  DP shards and then equal contiguous microbatches.
- ``reordered`` (DistTrain): samples sorted by their total work and dealt greedily (longest
  first, onto the lightest) to DP shards and then to microbatches of equal sample counts, which
  evens out the LLM work without looking at each module separately.
- ``balanced`` (harmonia): the per-iteration balancer (`harmonia.schedule.balance_dp` with
  ``n_microbatches``), which balances every module's work over all microbatches at once.
"""

from __future__ import annotations

import numpy as np

from harmonia.errors import ConfigError


def _check(n: int, dp: int, n_microbatches: int) -> None:
    if n < dp * n_microbatches:
        raise ConfigError(
            f"{n} samples cannot fill dp={dp} x n_microbatches={n_microbatches}; raise the global "
            "batch or lower dp / n_microbatches"
        )


def assign_sequential(batch: np.ndarray, dp: int, n_microbatches: int) -> dict[int, list[list[int]]]:
    """Contiguous equal DP shards, then contiguous equal microbatches (sizes differ by at most 1)."""
    _check(len(batch), dp, n_microbatches)
    out = {}
    for d, shard in enumerate(np.array_split(np.asarray(batch), dp)):
        out[d] = [list(map(int, mb)) for mb in np.array_split(shard, n_microbatches)]
    return out


def _greedy_equal_count(weights: np.ndarray, bins: int) -> list[list[int]]:
    """Longest-first onto the lightest bin that still has room (bins of equal sample count)."""
    cap = -(-len(weights) // bins)
    loads = np.zeros(bins)
    counts = np.zeros(bins, dtype=int)
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in np.argsort(-weights, kind="stable"):
        open_bins = np.flatnonzero(counts < cap)
        b = open_bins[np.argmin(loads[open_bins])]
        out[b].append(int(i))
        loads[b] += weights[i]
        counts[b] += 1
    return out


def assign_reordered(batch: np.ndarray, costs: np.ndarray, dp: int, n_microbatches: int) -> dict[int, list[list[int]]]:
    """DistTrain-style reordering on total work (``costs`` rows are the batch's samples)."""
    _check(len(batch), dp, n_microbatches)
    total = costs.sum(axis=1)
    out = {}
    for d, shard in enumerate(_greedy_equal_count(total, dp)):
        shard = np.asarray(shard)
        mbs = _greedy_equal_count(total[shard], n_microbatches)
        out[d] = [[int(batch[shard[i]]) for i in mb] for mb in mbs]
    return out
