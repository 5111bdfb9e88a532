"""Packing samples into bins under a token cap when the balancing greedy cannot.

The balancer's greedy (`harmonia.schedule.microbatching`) places samples by work, so it can paint
itself into a corner: tokens ``[83, 2, 25, 25, 23]``, cap 106, 3 microbatches; the greedy puts 83
alone, then the 25s beside it, and 23 fits nowhere, although ``{83, 2} {25, 25} {23}`` fits. Bin
packing is NP-hard, so this module answers in three steps, cheapest first:

1. **Proofs of infeasibility** that need no search: more tokens than ``n_bins * cap``; more
   samples above ``cap / 2`` than bins (two of them never share one).
2. **Decreasing heuristics**: worst-fit decreasing (each sample, largest first, into the bin with
   most room: even token loads) and first-fit decreasing (into the first bin it fits: tight bins).
3. **Exact search** (depth-first, largest sample first, bins of equal load tried once, a branch
   cut when the tokens left exceed the room left) within ``max_nodes`` visits. An exhausted search
   proves that no packing exists; a search out of budget says so.

Only feasibility is decided here; the balancer's exchange and polish passes then even the work of
the packing found, never breaking the cap.
"""

from __future__ import annotations

import numpy as np

from harmonia.errors import ScheduleError


def _infeasible(tok: np.ndarray, n_bins: int, cap: float, unit: str) -> str | None:
    """A reason no packing exists that needs no search, or None."""
    if tok.sum() > cap * n_bins:
        return f"{int(tok.sum())} tokens exceed {n_bins} {unit} x {cap:g}"
    big = int((tok > cap / 2).sum())
    if big > n_bins:
        return f"{big} samples have more than half the cap ({cap:g} / 2) each and no two share one of {n_bins} {unit}"
    return None


def _decreasing_fit(tok: np.ndarray, n_bins: int, cap: float, worst: bool) -> np.ndarray | None:
    """Worst-fit (``worst``) or first-fit decreasing; the bin of each sample, or None if one fits nowhere."""
    load = np.zeros(n_bins)
    where = np.empty(tok.size, dtype=np.int64)
    for i in np.argsort(-tok, kind="stable"):
        fits = np.flatnonzero(load + tok[i] <= cap)
        if fits.size == 0:
            return None
        b = int(fits[np.argmin(load[fits])]) if worst else int(fits[0])
        where[i] = b
        load[b] += tok[i]
    return where


def _exact(tok: np.ndarray, n_bins: int, cap: float, max_nodes: int) -> tuple[np.ndarray | None, bool]:
    """Depth-first search; returns ``(where or None, exhausted)``: None with ``exhausted`` proves infeasible."""
    order = np.argsort(-tok, kind="stable")
    sizes = tok[order].tolist()
    suffix = np.cumsum(sizes[::-1])[::-1].tolist() + [0.0]
    load = [0.0] * n_bins
    pick = [0] * len(sizes)
    nodes = 0

    def place(k: int) -> bool | None:  # True: packed; False: none below; None: out of budget
        nonlocal nodes
        if k == len(sizes):
            return True
        nodes += 1
        if nodes > max_nodes:
            return None
        if suffix[k] > sum(cap - x for x in load) + 1e-9:
            return False
        tried: set[float] = set()
        for b in range(n_bins):
            if load[b] in tried or load[b] + sizes[k] > cap:
                continue
            tried.add(load[b])
            load[b] += sizes[k]
            pick[k] = b
            found = place(k + 1)
            load[b] -= sizes[k]
            if found is not False:
                return found
        return False

    found = place(0)
    if found:
        where = np.empty(tok.size, dtype=np.int64)
        where[order] = pick
        return where, True
    return None, found is False


def _fill_empty(where: np.ndarray, tok: np.ndarray, n_bins: int) -> np.ndarray:
    """Move the smallest sample of a bin holding several into each empty bin (a sample alone in a
    bin always fits), so every bin has a sample when there are at least ``n_bins``."""
    for b in range(n_bins):
        counts = np.bincount(where, minlength=n_bins)
        if counts[b] or counts.max() < 2:
            continue
        movable = np.flatnonzero(counts[where] > 1)
        where[movable[np.argmin(tok[movable])]] = b
    return where


def pack_under_cap(tokens: np.ndarray, n_bins: int, cap: float, *, max_nodes: int = 200_000,
                   unit: str = "microbatches") -> np.ndarray:
    """A bin for every sample such that no bin holds more than ``cap`` tokens.

    Args:
        tokens: (n,) tokens per sample.
        n_bins: bins to fill (some may stay empty).
        cap: the most tokens one bin may hold.
        max_nodes: search budget of the exact step.
        unit: what the bins are called in error messages.

    Returns:
        (n,) bin index of every sample; no bin is empty when ``n >= n_bins``.

    Raises:
        ScheduleError: no packing exists (the message says why), or none was found within the budget.
    """
    tok = np.asarray(tokens, dtype=float).reshape(-1)
    what = f"{tok.size} samples ({int(tok.sum())} tokens) into {n_bins} {unit} of at most {cap:g} tokens"
    reason = _infeasible(tok, n_bins, cap, unit)
    if reason is not None:
        raise ScheduleError(f"no packing of {what} exists: {reason}; raise token_cap or use more {unit}")
    for worst in (True, False):
        where = _decreasing_fit(tok, n_bins, cap, worst)
        if where is not None:
            return _fill_empty(where, tok, n_bins)
    where, exhausted = _exact(tok, n_bins, cap, max_nodes)
    if where is not None:
        return _fill_empty(where, tok, n_bins)
    if exhausted:
        raise ScheduleError(f"no packing of {what} exists (exhaustive search); raise token_cap or use more {unit}")
    raise ScheduleError(f"no packing of {what} found in {max_nodes} search steps; raise token_cap or use "
                        f"more {unit}")
