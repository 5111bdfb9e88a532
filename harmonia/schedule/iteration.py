"""One iteration's placement for the executor: global microbatches, LLM replicas, encoder replicas.

The executor runs one schedule for every LLM DP replica, so microbatch ``m`` of every replica runs
at the same schedule position: the *global* microbatch ``m`` is the union of the replicas' ``m``-th
microbatches. `assign_iteration` builds it from the balancer:

1. `balance_dp` splits the batch over the LLM's DP replicas and, inside each, into
   ``n_microbatches`` microbatches balanced on every module's work at once (pipeline order: light
   microbatches at both ends).
2. Replicas' ``m``-th microbatches were dealt to balance the replicas, so they have similar loads;
   the global order is the order of their summed loads (`order_microbatches`), the same for all.
3. Inside each global microbatch, each encoder deals its samples to its own DP replicas, longest
   first onto the lightest replica (on that encoder's cost column), independently of the LLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.schedule.dp_balance import balance_dp
from harmonia.schedule.microbatching import order_microbatches


@dataclass(frozen=True)
class IterationAssignment:
    """Where every sample of an iteration goes.

    Attributes:
        microbatches: per global microbatch, batch positions of its samples (replica 0's first).
        llm_split: per global microbatch, per LLM DP replica, positions into ``microbatches[m]``.
        encoder_split: encoder -> per global microbatch, per encoder DP replica, positions into
            ``microbatches[m]``.
        loads: (n_microbatches, n_modules) summed work of each global microbatch.
    """

    microbatches: list[list[int]]
    llm_split: list[list[list[int]]]
    encoder_split: dict[str, list[list[list[int]]]]
    loads: np.ndarray

    @property
    def n_microbatches(self) -> int:
        return len(self.microbatches)

    def imbalance(self) -> float:
        """Largest over mean summed microbatch work (1.0 = perfectly even)."""
        total = self.loads.sum(axis=1)
        return float(total.max() / total.mean()) if total.mean() > 0 else 1.0


def deal_longest_first(weights: np.ndarray, n_bins: int) -> list[list[int]]:
    """Positions dealt longest first onto the lightest bin (ascending within a bin; bins may be empty)."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = np.zeros(n_bins)
    for i in np.argsort(-np.asarray(weights, dtype=float), kind="stable"):
        b = int(np.argmin(loads))
        bins[b].append(int(i))
        loads[b] += weights[i]
    return [sorted(b) for b in bins]


def assign_iteration(costs: np.ndarray, modules: Sequence[str], llm_dp: int, encoder_dp: Mapping[str, int],
                     n_microbatches: int, *, tokens: np.ndarray | None = None, token_cap: float | None = None,
                     seed: int = 0) -> IterationAssignment:
    """Balanced global microbatches of one iteration.

    Args:
        costs: (n_samples, n_modules) per-module work of the batch's samples (columns ``modules``).
        modules: column names; ``llm`` and every encoder of ``encoder_dp``.
        llm_dp: the LLM's DP degree.
        encoder_dp: encoder -> its DP degree.
        n_microbatches: microbatches per LLM replica.
        tokens: (n_samples,) LLM tokens, for ``token_cap``.
        token_cap: the most LLM tokens one replica's microbatch may hold.
        seed: tie-break seed (the result is deterministic for a seed).

    Raises:
        ScheduleError: fewer samples than ``llm_dp x n_microbatches``, a sample over the cap, or an
            encoder missing from ``modules``.
    """
    costs = np.asarray(costs, dtype=float)
    missing = [e for e in encoder_dp if e not in modules]
    if missing:
        raise ScheduleError(f"encoders {missing} have no cost column; columns are {list(modules)}")
    dpa = balance_dp(costs, llm_dp, tokens=tokens, n_microbatches=n_microbatches, token_cap=token_cap,
                     modules=list(modules), seed=seed)
    per_m = [[dpa.microbatches[d][m] for d in range(llm_dp)] for m in range(n_microbatches)]
    loads = np.stack([costs[[i for rep in reps for i in rep]].sum(axis=0) for reps in per_m])
    order = order_microbatches(loads)
    micro, llm_split = [], []
    encoder_split: dict[str, list[list[list[int]]]] = {e: [] for e in encoder_dp}
    for m in order:
        samples = [i for rep in per_m[m] for i in rep]
        micro.append(samples)
        split, start = [], 0
        for rep in per_m[m]:
            split.append(list(range(start, start + len(rep))))
            start += len(rep)
        llm_split.append(split)
        for e, degree in encoder_dp.items():
            encoder_split[e].append(deal_longest_first(costs[samples, list(modules).index(e)], degree))
    return IterationAssignment(micro, llm_split, encoder_split, loads[order])
