"""Balanced microbatches over every module at once (multi-dimensional bin balancing).

Each sample has a work vector, one entry per module (vision, audio, projectors, LLM). A sample
heavy on images may be light on text, so balancing one scalar (tokens, or total work) leaves some
module's microbatches uneven. The goal here is the smallest *worst-module ratio*

    max over modules j of  max_b load[b, j] / bound_j,   bound_j = max(total_j / n, largest sample_j)

where ``bound_j`` is a lower bound on the largest microbatch of module ``j``. The algorithm:

1. **Normalise.** Divide each module's column by ``bound_j``; drop modules with no work and merge
   modules whose columns are proportional (a projector follows its encoder), so the search runs
   over the few independent dimensions only. Every microbatch's target is ``total_j / n``.
2. **Greedy with deferral** (complementary vector LPT). Samples in decreasing order of their
   total normalised work; each goes to the microbatch whose loads point least in its direction
   (smallest ``load . work``), i.e. the one lightest on the modules this sample needs. A sample
   that would push a microbatch past its target (plus ``slack``) on any module is deferred to
   another microbatch of the same iteration that has room (never to the next iteration); only
   when none has room does it go where the score is best. The token cap is a hard constraint; when
   the greedy leaves a sample with no microbatch under the cap, `pack_under_cap` finds a packing
   (or proves there is none) and the passes below balance it.
3. **Pairwise exchange** (variance reduction). Sweeps pair the heaviest microbatch with the
   lightest on one module (each module in turn, then random pairings) and apply, in every pair at
   once, the single swap or move that most lowers the pair's sum of squared loads without raising
   any load above the current worst. This evens every module, not only the worst one.
4. **Minimax polish.** Moves and swaps out of the microbatch holding the worst (microbatch,
   module) load, into the microbatches lightest on that module, while that lowers it.
5. **Pipeline order.** Light microbatches at both ends, heavy in the middle (`light_ends`), which
   shortens the pipeline's warm-up and cool-down.

Cost: the greedy is one pass over samples with ``O(n_microbatches * dims)`` numpy work each; a
sweep is one batched ``(n/2, P, d) @ (n/2, d, P)`` product, ``P`` the most samples in a microbatch,
with loads and memberships updated in place between sweeps.
"""

from __future__ import annotations

import functools

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.schedule.packing import pack_under_cap

EPS = 1e-12


def check_inputs(costs: np.ndarray, n_bins: int, tokens: np.ndarray | None, token_cap: float | None,
                 what: str = "microbatches") -> tuple[np.ndarray, np.ndarray | None, float]:
    """Validate balancer inputs; return ``(costs (n, m) float, tokens or None, cap)``.

    Raises:
        ScheduleError: bad shapes, negative or non-finite costs, too few samples, or a sample
            whose tokens alone exceed ``token_cap`` (the message names it).
    """
    costs = np.asarray(costs, dtype=float)
    if costs.ndim == 1:
        costs = costs[:, None]
    if costs.ndim != 2:
        raise ScheduleError(f"costs must have shape (n_samples, n_modules), got {costs.shape}")
    n = costs.shape[0]
    if n_bins < 1 or n < n_bins:
        raise ScheduleError(f"cannot form {n_bins} {what} from {n} samples; use 1..{n} {what}")
    if (costs < 0).any() or not np.isfinite(costs).all():
        raise ScheduleError("costs must be finite and non-negative (seconds of work per sample and module)")
    tok = None
    if tokens is not None:
        tok = np.asarray(tokens, dtype=float).reshape(-1)
        if tok.shape[0] != n:
            raise ScheduleError(f"tokens has {tok.shape[0]} entries for {n} samples; pass one count per sample")
    cap = np.inf if token_cap is None else float(token_cap)
    if token_cap is not None and tok is None:
        raise ScheduleError("token_cap needs tokens= (the token count of every sample)")
    if tok is not None and (tok > cap).any():
        i = int(np.argmax(tok > cap))
        raise ScheduleError(
            f"sample {i} has {int(tok[i])} tokens, more than the microbatch token cap {cap:g}; "
            "raise token_cap or drop the sample"
        )
    if tok is not None and np.isfinite(cap) and tok.sum() > cap * n_bins:
        raise ScheduleError(
            f"{int(tok.sum())} tokens cannot fit {n_bins} {what} of at most {cap:g} tokens; raise "
            f"token_cap to at least {int(np.ceil(tok.sum() / n_bins))} or use more {what}"
        )
    return costs, tok, cap


def normalise(costs: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns divided by their lower bound ``max(total / n_bins, largest sample)``.

    Drops empty columns and merges proportional ones (a projector's column is its encoder's times
    a constant). Returns ``(work (n, d), target (d,))`` with ``target = total / n_bins / bound <= 1``.
    """
    total = costs.sum(axis=0)
    keep = total > 0
    if not keep.any():
        return np.ones((costs.shape[0], 1)), np.full(1, costs.shape[0] / n_bins)
    c = costs[:, keep]
    bound = np.maximum(total[keep] / n_bins, c.max(axis=0))
    work = c / bound
    shares = c / total[keep]  # proportional columns have identical shares
    first = [j for j in range(c.shape[1]) if not any(_proportional(shares[:, j], shares[:, k]) for k in range(j))]
    return np.ascontiguousarray(work[:, first]), (total[keep] / n_bins / bound)[first]


def _proportional(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two columns' shares are equal to a relative 1e-9 (``np.allclose(a, b, rtol=1e-9,
    atol=0)`` on finite shares, without its general checks: 10x faster on a step's few samples)."""
    return bool((np.abs(a - b) <= 1e-9 * np.abs(b)).all())


def _greedy(work: np.ndarray, n_bins: int, order: np.ndarray, tok: np.ndarray | None,
            cap: float, target: np.ndarray) -> np.ndarray | None:
    """Complementary vector LPT with deferral; returns the bin of every sample, or None when a
    sample fits in no microbatch under the token cap (a packing may still exist: `pack_under_cap`).

    Largest samples first, each onto the microbatch whose loads point least in its direction
    (smallest ``load . work``): the lightest microbatch on the modules this sample needs. A
    microbatch the sample would push past its target on any module is passed over (the sample is
    deferred to another microbatch of the same iteration) while some microbatch still has room;
    only when none has does the sample go where the complementary score is smallest. The token
    cap is a hard constraint. Samples with no work at all go to the microbatches holding fewest.

    With ``room = target - load``, ``load . w = target . w - room . w`` and ``target . w`` is the
    same for every microbatch, so the loop keeps only ``room`` and takes the largest ``room . w``.
    """
    n, _d = work.shape
    room = np.tile(target.astype(float), (n_bins, 1))  # (n_bins, d) left before each target
    bin_tok = np.zeros(n_bins)
    where = np.empty(n, dtype=np.int64)
    capped = tok is not None and np.isfinite(cap)
    busy = work.sum(axis=1) > 0
    ranked = order[busy[order]]
    # the largest n_bins samples land one per (empty) microbatch, whatever the rule: do it at once
    first = ranked[:n_bins]
    where[first] = np.arange(first.size)
    room[: first.size] -= work[first]
    if capped:
        bin_tok[: first.size] = tok[first]
    defer = 1e6  # taken off the score of a microbatch the sample would overfill: any with room wins
    for i in ranked[n_bins:]:
        w = work[i]
        score = room @ w
        if capped:
            score[bin_tok + tok[i] > cap] = -np.inf
        b = int(score.argmax())
        if (room[b] < w).any():  # the best one would overfill: look for one with room
            score[np.logical_or.reduce(room < w, axis=1)] -= defer
            b = int(score.argmax())
        if capped:
            if np.isinf(score[b]):
                return None
            bin_tok[b] += tok[i]
        where[i] = b
        room[b] -= w
    count = np.bincount(where[ranked], minlength=n_bins)
    for i in order[~busy[order]]:
        fits = bin_tok + (tok[i] if capped else 0.0) <= cap
        if not fits.any():
            return None
        b = int(np.where(fits, count, np.iinfo(np.int64).max).argmin())
        where[i] = b
        count[b] += 1
        if capped:
            bin_tok[b] += tok[i]
    return where


def bin_loads(where: np.ndarray, work: np.ndarray, n_bins: int) -> np.ndarray:
    """(n_bins, d) sum of ``work`` rows per bin, ``where`` giving each row's bin."""
    return np.stack([np.bincount(where, work[:, j], minlength=n_bins) for j in range(work.shape[1])], axis=1)


def _padded(where: np.ndarray, n_bins: int) -> np.ndarray:
    """(n_bins, P) sample indices per bin, padded with -1; P leaves at least one free slot."""
    srt = np.argsort(where, kind="stable")
    counts = np.bincount(where, minlength=n_bins)
    starts = np.cumsum(counts) - counts
    slot = np.arange(where.shape[0]) - np.repeat(starts, counts)
    members = np.full((n_bins, counts.max() + 1), -1, dtype=np.int64)
    members[where[srt], slot] = srt
    return members


def _sweep(wpad: np.ndarray, members: np.ndarray, loads: np.ndarray, key: np.ndarray, tpad: np.ndarray,
           bin_tok: np.ndarray, cap: float) -> int:
    """One round of pairwise exchanges, in place; returns how many pairs changed.

    Microbatches are paired heaviest with lightest on ``key``; in every pair the single swap (or
    move, a swap with an empty slot) that most lowers the pair's sum of squared loads is applied,
    provided no load ends above the current worst one and the token cap holds. All pairs are
    evaluated at once: the change of ``|La|^2 + |Lb|^2`` for giving ``x`` and taking ``y`` is
    ``2 (x - y) . (Lb - La) + 2 |x - y|^2``, one batched matrix product.

    Args:
        wpad, tpad: work (n, d) and tokens (n,) of every sample followed by a zero row, which
            index -1 (an empty slot) reads.
        members: (n_bins, P) sample indices per microbatch padded with -1 (`_padded`).
        loads, bin_tok: (n_bins, d) work and (n_bins,) tokens per microbatch.
    """
    n_bins, width = members.shape
    peak = loads.max()
    ranked = np.argsort(key, kind="stable")
    h = n_bins // 2
    heavy, light = ranked[::-1][:h], ranked[:h]
    ma, mb = members[heavy], members[light]  # (h, P)
    wa, wb = wpad[ma], wpad[mb]  # (h, P, d)
    gap = loads[light] - loads[heavy]  # (h, d)
    na, nb = (wa * wa).sum(-1), (wb * wb).sum(-1)  # (h, P)
    ga, gb = (wa * gap[:, None]).sum(-1), (wb * gap[:, None]).sum(-1)
    change = (ga + na)[:, :, None] + (nb - gb)[:, None, :] - 2 * (wa @ wb.transpose(0, 2, 1))  # (h, P, P)
    if np.isfinite(cap):
        dt = tpad[ma][:, :, None] - tpad[mb][:, None, :]
        bad = (bin_tok[heavy][:, None, None] - dt > cap) | (bin_tok[light][:, None, None] + dt > cap)
        change[bad] = np.inf
    flat = change.reshape(h, -1)
    best = flat.argmin(axis=1)
    rows = np.arange(h)
    gain = -flat[rows, best]
    ia, ib = np.divmod(best, width)
    xa, xb = ma[rows, ia], mb[rows, ib]
    delta = wpad[xa] - wpad[xb]  # (h, d)
    fits = np.maximum(loads[heavy] - delta, loads[light] + delta).max(axis=1) <= peak + 1e-12
    take = (gain > 1e-7) & fits  # gains below this change loads by ~1e-4 of a target
    hs, ls = heavy[take], light[take]
    members[hs, ia[take]] = xb[take]
    members[ls, ib[take]] = xa[take]
    loads[hs] -= delta[take]
    loads[ls] += delta[take]
    moved = tpad[xa[take]] - tpad[xb[take]]
    bin_tok[hs] -= moved
    bin_tok[ls] += moved
    return int(take.sum())


def _unpad(members: np.ndarray, where: np.ndarray) -> None:
    """Write each sample's microbatch from ``members`` into ``where``."""
    rows, cols = np.nonzero(members >= 0)
    where[members[rows, cols]] = rows


def _exchange(work: np.ndarray, where: np.ndarray, n_bins: int, t: np.ndarray, cap: float,
              max_sweeps: int, rng: np.random.Generator) -> None:
    """Pairwise-exchange sweeps in place, pairing on each module in turn, then on random keys;
    stops after two sweeps in a row that change nothing."""
    d = work.shape[1]
    wpad = np.vstack([work, np.zeros((1, d))])
    tpad = np.append(t, 0.0)
    members = _padded(where, n_bins)
    loads = bin_loads(where, work, n_bins)
    bin_tok = np.bincount(where, t, minlength=n_bins)
    quiet = 0
    for s in range(max_sweeps if n_bins > 1 else 0):
        if not (members < 0).any(axis=1).all():  # a microbatch has no free slot left: re-pad
            _unpad(members, where)
            members = _padded(where, n_bins)
        key = loads[:, s % d] if s % (d + 1) < d else rng.random(n_bins)
        quiet = 0 if _sweep(wpad, members, loads, key, tpad, bin_tok, cap) else quiet + 1
        if quiet > 1:
            break
    _unpad(members, where)


def _polish(work: np.ndarray, where: np.ndarray, n_bins: int, t: np.ndarray, cap: float,
            max_steps: int, n_partners: int = 8) -> None:
    """Minimax local search in place: moves and swaps out of the microbatch holding the worst
    (microbatch, module) load, into the microbatches lightest on that module; stops when the
    worst one cannot be lowered that way."""
    loads = bin_loads(where, work, n_bins)
    bin_tok = np.bincount(where, t, minlength=n_bins)
    capped = np.isfinite(cap)
    for _ in range(max_steps if n_bins > 1 else 0):
        a, j = np.unravel_index(int(loads.argmax()), loads.shape)
        current = loads[a, j]
        col = loads[:, j].copy()
        col[a] = np.inf
        k = min(n_bins - 1, n_partners)
        partners = np.argpartition(col, k - 1)[:k]
        mine = np.flatnonzero(where == a)
        inside = np.zeros(n_bins, dtype=bool)
        inside[partners] = True
        theirs = np.concatenate([np.flatnonzero(inside[where]), -1 - partners])  # -1-b: empty slot of b
        dest = np.where(theirs >= 0, where[np.maximum(theirs, 0)], -1 - theirs)
        wt = np.where((theirs >= 0)[:, None], work[np.maximum(theirs, 0)], 0.0)
        delta = work[mine][:, None, :] - wt[None, :, :]  # (A, T, d) given minus taken
        worst = np.maximum((loads[a] - delta).max(axis=2), (loads[dest][None] + delta).max(axis=2))
        if capped:
            tt = np.where(theirs >= 0, t[np.maximum(theirs, 0)], 0.0)
            dt = t[mine][:, None] - tt[None, :]
            worst[(bin_tok[a] - dt > cap) | (bin_tok[dest][None, :] + dt > cap)] = np.inf
        p, q = np.unravel_index(int(worst.argmin()), worst.shape)
        if not worst[p, q] < current - 1e-12:
            break
        i, b, other = int(mine[p]), int(dest[q]), int(theirs[q])
        moves = ((i, a, b), (other, b, a)) if other >= 0 else ((i, a, b),)
        for x, src, dst in moves:
            loads[src] -= work[x]
            loads[dst] += work[x]
            bin_tok[src] -= t[x]
            bin_tok[dst] += t[x]
            where[x] = dst


def balance_bins(costs: np.ndarray, n_bins: int, *, tokens: np.ndarray | None = None,
                 token_cap: float | None = None, seed: int = 0, max_sweeps: int = 24,
                 max_steps: int | None = None, slack: float = 0.02, unit: str = "bins") -> tuple[list[list[int]], np.ndarray]:
    """Partition samples into ``n_bins`` with balanced per-module work (no ordering).

    Args:
        costs: (n_samples, n_modules) per-module work.
        n_bins: bins to form.
        tokens: (n_samples,) tokens per sample, for the cap.
        token_cap: the most tokens one bin may hold.
        seed: tie-break seed among equal samples.
        max_sweeps: pairwise-exchange sweeps at most.
        max_steps: minimax local-search steps at most (default ``n_samples``).
        slack: relative room over each module's target before the greedy defers a sample.
        unit: what the bins are called in error messages (``microbatches``, ``DP replicas``).

    Returns:
        ``(bins, loads)``: sorted sample indices per bin, and the (n_bins, n_modules) work per bin.
    """
    costs, tok, cap = check_inputs(costs, n_bins, tokens, token_cap, unit)
    n = costs.shape[0]
    if n_bins == 1 and (tok is None or tok.sum() <= cap):  # one bin holds every sample: nothing to balance
        return [list(range(n))], bin_loads(np.zeros(n, dtype=int), costs, 1)
    if n_bins == 2 and n <= EXACT_TWO_BINS:
        where = _two_bins_exact(costs, tok, cap)
        if where is not None:
            return [np.flatnonzero(where == b).tolist() for b in range(2)], bin_loads(where, costs, 2)
    work, target = normalise(costs, n_bins)
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(n), -work.sum(axis=1)))  # largest first; seed orders equal ones
    where = _greedy(work, n_bins, order, tok, cap, target * (1 + slack))
    if where is None:  # the greedy cornered itself under the cap: start from a packing that fits
        where = pack_under_cap(tok, n_bins, cap, unit=unit)
    t = np.zeros(n) if tok is None else tok
    _exchange(work, where, n_bins, t, cap, max_sweeps, rng)
    _polish(work, where, n_bins, t, cap, n if max_steps is None else max_steps)
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in np.argsort(where, kind="stable"):
        bins[where[i]].append(int(i))
    return bins, bin_loads(where, costs, n_bins)


EXACT_TWO_BINS = 12
"""Up to this many samples, two bins are balanced exactly: every split is tried (``2^(n-1) - 1``
of them, one matrix product), where the heuristics' many small array operations would cost more."""


@functools.lru_cache(maxsize=EXACT_TWO_BINS)
def _second_bins(n: int) -> np.ndarray:
    """``(2^(n-1) - 1, n)`` float 0/1: every second bin of a split of ``n`` samples into two non-empty
    bins, sample 0 always in the first (a split and its mirror are the same split)."""
    codes = np.arange(1, 2 ** (n - 1), dtype=np.int64)[:, None]  # bit k - 1: sample k in the second bin
    return np.concatenate([np.zeros((codes.shape[0], 1)), (codes >> np.arange(n - 1)) & 1], axis=1).astype(float)


def _two_bins_exact(costs: np.ndarray, tok: np.ndarray | None, cap: float) -> np.ndarray | None:
    """The bin of every sample in the split of two non-empty bins with the smallest worst normalised
    (bin, module) load (`normalise`) under the token cap; ties to the smaller sum of squared loads,
    then the first split. None when no split fits the cap or there are fewer than two samples."""
    n = costs.shape[0]
    if n < 2:
        return None
    work, _ = normalise(costs, 2)
    second = _second_bins(n)  # (S, n)
    b = second @ work  # (S, d) the second bin's loads
    a = work.sum(axis=0) - b
    peak = np.maximum(a, b).max(axis=1)  # (S,)
    ok = np.ones(len(second), dtype=bool)
    if tok is not None and np.isfinite(cap):
        t = second @ tok.astype(float)
        ok = (t <= cap) & (tok.sum() - t <= cap)
    if not ok.any():
        return None
    squares = (a * a + b * b).sum(axis=1)
    best = np.flatnonzero(ok)[np.lexsort((squares[ok], peak[ok]))[0]]
    return second[best].astype(np.int64)


def light_ends(weights: np.ndarray) -> list[int]:
    """Indices ordered lightest-first at both ends, heaviest in the middle.

    Sorted ascending, the even ranks go left to right and the odd ranks right to left, so the
    pipeline's first and last microbatches (warm-up, cool-down) are the lightest.
    """
    ranked = np.argsort(np.asarray(weights, dtype=float), kind="stable")
    left, right = list(ranked[0::2]), list(ranked[1::2])
    return [int(x) for x in left + right[::-1]]


def order_microbatches(loads: np.ndarray) -> list[int]:
    """Pipeline order of microbatches from their (n_microbatches, n_modules) work: `light_ends` of
    each microbatch's work relative to the mean microbatch, summed over modules."""
    loads = np.asarray(loads, dtype=float)
    mean = loads.mean(axis=0)
    rel = np.divide(loads, mean, out=np.zeros_like(loads), where=mean > 0)
    return light_ends(rel.sum(axis=1))


def assign_microbatches(costs: np.ndarray, n_microbatches: int, *, tokens: np.ndarray | None = None,
                        token_cap: float | None = None, seed: int = 0) -> list[list[int]]:
    """Split samples into microbatches with balanced per-module work, in pipeline order.

    Args:
        costs: (n_samples, n_modules) per-module work (seconds, or any additive unit).
        n_microbatches: microbatches to form (sample counts may differ between them).
        tokens: (n_samples,) tokens of each sample, for the cap.
        token_cap: the most tokens one microbatch may hold (memory).
        seed: tie-break seed; the result is deterministic for a seed.

    Returns:
        Sample indices per microbatch (ascending within one), in pipeline order; every index
        exactly once.

    Raises:
        ScheduleError: too few samples, bad costs, or a sample over the token cap on its own.
    """
    bins, loads = balance_bins(costs, n_microbatches, tokens=tokens, token_cap=token_cap, seed=seed,
                               unit="microbatches")
    return [bins[k] for k in order_microbatches(loads)]
