"""Modality sub-microbatches: split one microbatch's encoder work into pieces of a target cost.

An encoder that receives a whole microbatch at once keeps the LLM waiting for all of it; split
into sub-microbatches (the DIP idea), the encoder starts on the first piece early, the boundary
forwards pieces as they finish, and the encoder's stages stay busy. The split is recorded so the
boundary can put the encoder's outputs back in the microbatch's item order (`restore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.workload.cost import CostModel
from harmonia.workload.shapes import SampleShape, encoder_sequences


@dataclass(frozen=True)
class SubMicrobatches:
    """One encoder's split of one microbatch.

    Attributes:
        groups: item indices (positions in the microbatch's item list for this encoder) per
            sub-microbatch, in run order; each ascending.
        costs: (n_sub,) work of each sub-microbatch.
    """

    groups: list[list[int]]
    costs: np.ndarray

    @property
    def n_sub(self) -> int:
        return len(self.groups)

    @property
    def restore(self) -> np.ndarray:
        """Permutation ``p`` with ``concat(outputs of groups in run order)[p]`` in item order."""
        flat = np.array([i for g in self.groups for i in g], dtype=np.int64)
        return np.argsort(flat, kind="stable")


def _contiguous(costs: np.ndarray, n_sub: int) -> list[list[int]]:
    """Contiguous runs minimising the largest run (binary search on the largest run's cost)."""
    if n_sub == 1:  # one run of every item (what the search ends with)
        return [list(range(costs.size))]
    lo, hi = float(costs.max(initial=0.0)), float(costs.sum()) * (1 + 1e-9) + 1e-12  # hi: one run

    def runs(limit: float) -> list[list[int]]:
        out, cur, acc = [], [], 0.0
        for i, c in enumerate(costs):
            if cur and acc + c > limit:
                out.append(cur)
                cur, acc = [], 0.0
            cur.append(i)
            acc += c
        return out + [cur] if cur else out

    for _ in range(50):
        mid = (lo + hi) / 2
        if len(runs(mid)) <= n_sub:
            hi = mid
        else:
            lo = mid
    return runs(hi)


def _packed(costs: np.ndarray, n_sub: int) -> list[list[int]]:
    """Largest item first onto the lightest sub-microbatch (LPT); items ascending in each."""
    loads = np.zeros(n_sub)
    groups: list[list[int]] = [[] for _ in range(n_sub)]
    for i in np.argsort(-costs, kind="stable"):
        g = int(loads.argmin())
        groups[g].append(int(i))
        loads[g] += costs[i]
    return [sorted(g) for g in groups if g]


def item_runs(item_costs: Sequence[float] | np.ndarray, n_sub: int) -> list[tuple[int, int]]:
    """One encoder replica's items of a microbatch cut into ``n_sub`` sub-microbatches: contiguous
    runs ``[a, b)`` in item order whose largest cost is as small as it can be (DIP's split by cost),
    padded with empty runs where there are fewer items than sub-microbatches (with equal costs the
    largest run holds ``ceil(n_items / n_sub)`` items). The schedule's stage work is priced with these runs and the executor runs
    them (`harmonia.runtime.mllm_inputs`), so the two never disagree."""
    costs = np.asarray(item_costs, dtype=float).reshape(-1)
    if n_sub < 1:
        raise ScheduleError(f"n_sub must be at least 1, got {n_sub}")
    runs, start = [], 0
    for group in (_contiguous(costs, min(n_sub, costs.size)) if costs.size else []):
        runs.append((start, start + len(group)))
        start += len(group)
    return runs + [(start, start)] * (n_sub - len(runs))


def plan_submicrobatches(item_costs: np.ndarray, *, target: float | None = None, n_sub: int | None = None,
                         contiguous: bool = False) -> SubMicrobatches:
    """Split one encoder's items of a microbatch into sub-microbatches.

    Args:
        item_costs: (n_items,) encoder work of each item, in the microbatch's item order.
        target: work per sub-microbatch; the count is ``ceil(total / target)`` (at most one per
            item). Give this or ``n_sub``.
        n_sub: the number of sub-microbatches.
        contiguous: keep items in order (consecutive runs, no reordering at the boundary);
            otherwise pack any items together for the most even pieces.

    Returns:
        The split, lightest sub-microbatch first (the LLM waits least for the first piece).

    Raises:
        ScheduleError: neither or both of ``target`` and ``n_sub``, or bad values.
    """
    costs = np.asarray(item_costs, dtype=float).reshape(-1)
    if (target is None) == (n_sub is None):
        raise ScheduleError("plan_submicrobatches: give exactly one of target= (work per piece) or n_sub=")
    if (costs < 0).any() or not np.isfinite(costs).all():
        raise ScheduleError("item costs must be finite and non-negative")
    if costs.size == 0:
        return SubMicrobatches([], np.zeros(0))
    if target is not None:
        if not target > 0:
            raise ScheduleError(f"sub-microbatch target must be positive, got {target}")
        n_sub = int(np.ceil(costs.sum() / target - 1e-9))
    if n_sub < 1:
        raise ScheduleError(f"n_sub must be at least 1, got {n_sub}")
    n_sub = min(max(n_sub, 1), costs.size)
    groups = _contiguous(costs, n_sub) if contiguous else _packed(costs, n_sub)
    sub_costs = np.array([costs[g].sum() for g in groups])
    if not contiguous:
        order = np.argsort(sub_costs, kind="stable")
        groups, sub_costs = [groups[k] for k in order], sub_costs[order]
    return SubMicrobatches(groups, sub_costs)


def encoder_item_costs(samples: Sequence[SampleShape], cost: CostModel,
                       module: str) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The items one encoder processes for a microbatch, in order, and the work of each.

    Args:
        samples: the microbatch's samples, in microbatch order.
        cost: the cost model (its ``mllm`` names the encoders).
        module: the encoder, e.g. ``vision``.

    Returns:
        ``(items, costs)``: ``(sample position, item position)`` of every item of ``module``, and
        its F+B+W seconds (compute term, additive), ready for `plan_submicrobatches`.
    """
    mllm = cost.mllm
    if module not in mllm.encoders:
        raise ScheduleError(f"{module!r} is not an encoder of this model; encoders: {sorted(mllm.encoders)}")
    j = cost.modules.index(module)
    items, tokens, pairs = [], [], []
    for s, sample in enumerate(samples):
        for k, item in enumerate(sample.items):
            if mllm.encoder_for(item.modality) != module:
                continue
            seqs = encoder_sequences(item, mllm.encoders[module])
            items.append((s, k))
            tokens.append(sum(seqs))
            pairs.append(sum(n * n for n in seqs))
    t = np.zeros((len(items), len(cost.modules)))
    p = np.zeros_like(t)
    t[:, j], p[:, j] = tokens, pairs
    return items, cost.costs_from_loads(t, p)[:, j]
