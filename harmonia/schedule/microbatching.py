"""Balanced microbatches over every module at once (vector bin balancing).

Each sample has a work vector (one entry per module). The goal is microbatches whose largest
per-module load is as small as possible relative to that module's ideal ``total / n``:

1. Normalise every module's column by its ideal load, so modules of very different cost weigh
   the same, and drop modules with no work.
2. Greedy (LPT on vectors): samples in decreasing order of their largest normalised entry; each
   goes to the microbatch whose worst module after adding it is smallest (ties: fewest tokens).
   The per-microbatch token cap is a hard constraint.
3. Local search: repeatedly take the microbatch holding the worst (microbatch, module) load and
   try moving one of its samples to, or swapping it with one of, another microbatch when that
   lowers the pair's worst load; stop when nothing improves or the pass limit is reached.
4. Pipeline order: light microbatches at both ends, heavy in the middle, which shortens warm-up
   and cool-down.
"""

from __future__ import annotations

import numpy as np

from harmonia.errors import ScheduleError


def _normalised(costs: np.ndarray, n: int) -> np.ndarray:
    costs = np.asarray(costs, dtype=float)
    if costs.ndim == 1:
        costs = costs[:, None]
    total = costs.sum(axis=0)
    keep = total > 0
    if not keep.any():
        return np.ones((costs.shape[0], 1)) / max(1, n)
    return costs[:, keep] / (total[keep] / n)


def _greedy(work: np.ndarray, n: int, tokens: np.ndarray | None, cap: float) -> tuple[list[list[int]], np.ndarray]:
    loads = np.zeros((n, work.shape[1]))
    tok = np.zeros(n)
    bins: list[list[int]] = [[] for _ in range(n)]
    for i in np.argsort(-work.max(axis=1), kind="stable"):
        worst = np.maximum(loads, loads + work[i]).max(axis=1)  # (n,)
        if tokens is not None:
            worst = np.where(tok + tokens[i] <= cap, worst, np.inf)
        b = int(np.lexsort((tok, worst))[0])
        if not np.isfinite(worst[b]):
            raise ScheduleError(
                f"sample {int(i)} ({int(tokens[i])} tokens) fits in no microbatch under the token cap "
                f"{cap:g}; raise token_cap or n_microbatches"
            )
        bins[b].append(int(i))
        loads[b] += work[i]
        tok[b] += 0 if tokens is None else tokens[i]
    return bins, loads


def _improve(work: np.ndarray, bins: list[list[int]], loads: np.ndarray, tokens: np.ndarray | None,
             cap: float, passes: int) -> None:
    """Moves and swaps out of the worst microbatch while they lower the worst load (vectorised
    over every candidate partner)."""
    n_bins = len(bins)
    where = np.empty(work.shape[0], dtype=int)
    for b, items in enumerate(bins):
        where[items] = b
    tok = np.zeros(n_bins) if tokens is None else np.array([tokens[b].sum() for b in map(np.asarray, bins)])
    t = np.zeros(work.shape[0]) if tokens is None else tokens
    for _ in range(passes if n_bins > 1 else 0):
        a = int(loads.max(axis=1).argmax())
        current = loads[a].max()
        best = (0.0, -1, -1, -1)
        others = np.flatnonzero(where != a)
        for i in np.flatnonzero(where == a):
            # moves: i into every other bin
            lb = loads + work[i]  # (n_bins, m)
            la = loads[a] - work[i]
            worst = np.maximum(lb.max(axis=1), la.max())
            worst[a] = np.inf
            worst[tok + t[i] > cap] = np.inf
            b = int(worst.argmin())
            if current - worst[b] > best[0] + 1e-12:
                best = (current - worst[b], int(i), b, -1)
            if others.size == 0:
                continue
            # swaps: i with every sample j outside a
            delta = work[i] - work[others]  # (J, m)
            lb = loads[where[others]] + delta
            la = loads[a] - delta
            worst = np.maximum(lb.max(axis=1), la.max(axis=1))
            bad = (tok[where[others]] + t[i] - t[others] > cap) | (tok[a] - t[i] + t[others] > cap)
            worst[bad] = np.inf
            k = int(worst.argmin())
            if current - worst[k] > best[0] + 1e-12:
                best = (current - worst[k], int(i), int(where[others[k]]), int(others[k]))
        if best[1] < 0:
            break
        _, i, b, j = best
        loads[a] -= work[i]
        loads[b] += work[i]
        tok[a] -= t[i]
        tok[b] += t[i]
        where[i] = b
        if j >= 0:
            loads[b] -= work[j]
            loads[a] += work[j]
            tok[b] -= t[j]
            tok[a] += t[j]
            where[j] = a
    for b in range(n_bins):
        bins[b] = [int(x) for x in np.flatnonzero(where == b)]


def light_ends(weights: np.ndarray) -> list[int]:
    """Indices ordered lightest-first at both ends, heaviest in the middle."""
    ranked = np.argsort(weights, kind="stable")
    left, right = list(ranked[0::2]), list(ranked[1::2])
    return [int(x) for x in left + right[::-1]]


def assign_microbatches(costs: np.ndarray, n_microbatches: int, *, tokens: np.ndarray | None = None,
                        token_cap: float | None = None, seed: int = 0, passes: int = 200) -> list[list[int]]:
    """Split samples into microbatches with balanced per-module work, in pipeline order.

    Args:
        costs: (n_samples, n_modules) per-module work (seconds or any additive unit).
        n_microbatches: microbatches to form.
        tokens: (n_samples,) tokens of each sample, for the cap.
        token_cap: the most tokens one microbatch may hold.
        seed: tie-break seed (the result is deterministic for a seed).
        passes: local-search moves at most.

    Returns:
        Sample indices per microbatch, in pipeline order; every index exactly once.
    """
    costs = np.asarray(costs, dtype=float)
    n = costs.shape[0]
    if n_microbatches < 1 or n < n_microbatches:
        raise ScheduleError(
            f"cannot form {n_microbatches} microbatches from {n} samples; use 1..{n} microbatches"
        )
    if (costs < 0).any() or not np.isfinite(costs).all():
        raise ScheduleError("costs must be finite and non-negative (seconds of work per sample and module)")
    tok = None if tokens is None else np.asarray(tokens, dtype=float)
    cap = np.inf if token_cap is None else float(token_cap)
    if tok is not None and token_cap is not None and (tok > cap).any():
        i = int(np.argmax(tok > cap))
        raise ScheduleError(
            f"sample {i} has {int(tok[i])} tokens, more than the microbatch token cap {cap:g}; "
            "raise token_cap or drop the sample"
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)  # seed-dependent tie-breaking among equal samples
    work = _normalised(costs[perm], n_microbatches)
    bins, loads = _greedy(work, n_microbatches, None if tok is None else tok[perm], cap)
    _improve(work, bins, loads, None if tok is None else tok[perm], cap, passes)
    bins = [[int(perm[i]) for i in b] for b in bins]
    order = light_ends(loads.max(axis=1))
    return [sorted(bins[k]) for k in order]
