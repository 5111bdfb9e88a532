"""Split one global batch across data-parallel replicas with every module's work balanced.

The LLM's DP replicas each run a pipeline over their own microbatches. What slows an iteration is
the heaviest microbatch anywhere (it holds every stage of its replica's pipeline) and the heaviest
replica (the gradient all-reduce waits for it). So `balance_dp` forms all ``dp * n_microbatches``
microbatches of the iteration at once with `balance_bins` (every module balanced, deferral, token
cap), then deals whole microbatches to replicas, ``n_microbatches`` each, heaviest first onto the
replica lightest on the modules that microbatch needs. Balanced microbatches make balanced
replicas; the reverse (shard first, then split each shard) loses the freedom to trade samples
between replicas.

An encoder whose DP degree differs from the LLM's processes its own split of the batch: its
replicas are balanced on that encoder's work alone, and the boundary moves every sample's encoder
output to the LLM replica that holds the sample (`harmonia.runtime` does the transfer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.schedule.microbatching import (
    balance_bins,
    check_inputs,
    normalise,
    order_microbatches,
)


@dataclass(frozen=True)
class DPAssignment:
    """Where every sample of a global batch goes.

    Attributes:
        shards: sample indices of each LLM DP replica (ascending).
        microbatches: per replica, its microbatches in pipeline order (global sample indices);
            empty lists when no ``n_microbatches`` was asked for.
        encoder_shards: module (name or column index) -> sample indices of each of that encoder's
            DP replicas, for encoders whose DP degree differs from the LLM's.
        loads: (dp, n_modules) work of each replica.
    """

    shards: list[list[int]]
    microbatches: list[list[list[int]]]
    encoder_shards: dict[int | str, list[list[int]]] = field(default_factory=dict)
    loads: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))


def _deal(bin_work: np.ndarray, dp: int, per: int) -> list[list[int]]:
    """Deal ``dp * per`` bins to ``dp`` replicas, ``per`` each, balancing the replicas' vector sums:
    heaviest bin first onto the non-full replica with the smallest ``load . work``."""
    loads = np.zeros((dp, bin_work.shape[1]))
    count = np.zeros(dp, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(dp)]
    for b in np.argsort(-bin_work.sum(axis=1), kind="stable"):
        score = loads @ bin_work[b] + 1e-12 * count
        score[count >= per] = np.inf
        r = int(score.argmin())
        out[r].append(int(b))
        loads[r] += bin_work[b]
        count[r] += 1
    _swap_bins(bin_work, out, loads, max_steps=4 * len(bin_work))
    return out


def _swap_bins(bin_work: np.ndarray, groups: list[list[int]], loads: np.ndarray, max_steps: int) -> None:
    """Minimax swaps of whole bins between replicas, in place: swap a bin of the replica holding
    the worst (replica, module) load with a bin of another replica while that lowers the pair's
    largest load below it."""
    dp = len(groups)
    for _ in range(max_steps if dp > 1 else 0):
        r, j = np.unravel_index(int(loads.argmax()), loads.shape)
        current = loads[r, j]
        mine = np.array(groups[r])
        others = np.array([b for s in range(dp) if s != r for b in groups[s]])
        owner = np.array([s for s in range(dp) if s != r for _ in groups[s]])
        delta = bin_work[mine][:, None, :] - bin_work[others][None, :, :]  # (A, B, d) given minus taken
        worst = np.maximum((loads[r] - delta).max(axis=2), (loads[owner][None] + delta).max(axis=2))
        p, q = np.unravel_index(int(worst.argmin()), worst.shape)
        if not worst[p, q] < current - 1e-12:
            return
        a, b, s = int(mine[p]), int(others[q]), int(owner[q])
        groups[r][groups[r].index(a)] = b
        groups[s][groups[s].index(b)] = a
        loads[r] += bin_work[b] - bin_work[a]
        loads[s] += bin_work[a] - bin_work[b]


def _column(key: int | str, modules: Sequence[str] | None, n_modules: int) -> int:
    if isinstance(key, str):
        if modules is None or key not in modules:
            raise ScheduleError(
                f"encoder_dp names module {key!r}, which is not among modules={list(modules or [])}; "
                "pass modules= (the column names of costs) or key encoder_dp by column index"
            )
        return list(modules).index(key)
    if not 0 <= key < n_modules:
        raise ScheduleError(f"encoder_dp column {key} is out of range for {n_modules} modules")
    return int(key)


def balance_dp(costs: np.ndarray, dp: int, *, tokens: np.ndarray | None = None,
               encoder_dp: Mapping[int | str, int] | None = None, n_microbatches: int | None = None,
               token_cap: float | None = None, modules: Sequence[str] | None = None,
               seed: int = 0, kept: dict | None = None) -> DPAssignment:
    """Split a global batch across the LLM's DP replicas (and encoders' own DP replicas).

    Args:
        costs: (n_samples, n_modules) per-module work of every sample.
        dp: LLM data-parallel degree.
        tokens: (n_samples,) LLM tokens of every sample, for ``token_cap``.
        encoder_dp: module -> DP degree, for encoders whose degree differs from ``dp``; the module
            is a column index of ``costs`` or a name in ``modules``.
        n_microbatches: microbatches per replica; when given, the microbatches are formed here
            (pipeline order within each replica) and ``token_cap`` applies to each of them.
        token_cap: the most tokens one microbatch may hold (needs ``n_microbatches``).
        modules: names of the columns of ``costs``, to key ``encoder_dp`` by name.
        seed: tie-break seed; the result is deterministic for a seed.
        kept: the microbatch balances of earlier calls with the same ``costs``, ``tokens``, cap and
            seed, by microbatch count (``dp x n_microbatches``: ``dp=4, n_microbatches=2`` forms the
            same eight microbatches as ``dp=2, n_microbatches=4`` before dealing them); updated.

    Returns:
        A `DPAssignment`; every sample is on exactly one LLM replica and, per listed encoder, on
        exactly one of its replicas.

    Raises:
        ScheduleError: too few samples for the replicas (or microbatches), bad costs, a sample
            over the token cap, or an unknown encoder module.
    """
    if dp < 1:
        raise ScheduleError(f"dp must be >= 1, got {dp}")
    if token_cap is not None and n_microbatches is None:
        raise ScheduleError("token_cap applies to microbatches; pass n_microbatches= as well")
    costs = np.asarray(costs, dtype=float)
    if costs.ndim == 1:
        costs = costs[:, None]
    n_bins = dp * (n_microbatches or 1)
    unit = "microbatches (dp x n_microbatches)" if n_microbatches else "DP replicas"
    costs, tok, _ = check_inputs(costs, n_bins, tokens, token_cap, unit)
    if n_microbatches is None:
        shards, loads = balance_bins(costs, dp, seed=seed, unit="DP replicas")
        mbs: list[list[list[int]]] = [[] for _ in range(dp)]
    else:
        if n_microbatches < 1:
            raise ScheduleError(f"n_microbatches must be >= 1, got {n_microbatches}")
        key = ("bins", n_bins, tuple(modules or ()))
        found = None if kept is None else kept.get(key)
        if found is None:
            found = balance_bins(costs, n_bins, tokens=tok, token_cap=token_cap, seed=seed, unit=unit)
            if kept is not None:
                kept[key] = found
        bins, bin_loads = [list(b) for b in found[0]], found[1]
        if n_bins == 1:  # one replica's one microbatch: nothing to deal or order
            mbs, shards, loads = [[bins[0]]], [list(bins[0])], bin_loads
        else:
            work, _ = normalise(bin_loads, 1)
            dealt = _deal(work, dp, n_microbatches)
            mbs = [[bins[b] for b in np.array(group)[order_microbatches(bin_loads[group])]] for group in dealt]
            shards = [sorted(i for mb in rep for i in mb) for rep in mbs]
            loads = np.stack([bin_loads[group].sum(axis=0) for group in dealt])
    encoder_shards: dict[int | str, list[list[int]]] = {}
    for key, degree in (encoder_dp or {}).items():
        j = _column(key, modules, costs.shape[1])
        if degree < 1:
            raise ScheduleError(f"encoder_dp[{key!r}] must be >= 1, got {degree}")
        if degree == dp:
            encoder_shards[key] = [list(s) for s in shards]
            continue
        parts, _ = balance_bins(costs[:, [j]], min(degree, costs.shape[0]), seed=seed,
                                unit=f"DP replicas of encoder {key!r}")
        encoder_shards[key] = parts + [[] for _ in range(degree - len(parts))]  # more replicas than samples
    return DPAssignment(shards, mbs, encoder_shards, loads)

