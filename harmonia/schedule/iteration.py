"""One iteration's placement for the executor: global microbatches, LLM replicas, encoder replicas.

The executor runs one schedule for every LLM DP replica, so microbatch ``m`` of every replica runs
at the same schedule position: the *global* microbatch ``m`` is the union of the replicas' ``m``-th
microbatches. `assign_iteration` builds it from the balancer:

1. `balance_dp` splits the batch over the LLM's DP replicas and, inside each, into
   ``n_microbatches`` microbatches balanced on every module's work at once (pipeline order: light
   microbatches at both ends).
2. Replicas' ``m``-th microbatches were dealt to balance the replicas, so they have similar loads;
   the global order is the order of their summed loads (`order_microbatches`), the same for all.
3. Inside each global microbatch, each encoder deals every LLM replica's samples to the encoder
   replicas that feed that LLM replica (``feeds``; by default all of them), longest first onto the
   replica with the least work so far this iteration (on that encoder's cost column). The loads
   carry over between microbatches: restarting from zero would hand the heaviest sample of every
   microbatch to the same replica. With the simulator's ``feeds``
   (`harmonia.schedule.stagework.feeding_replicas`: colocated encoder replicas feed the LLM replica on
   their own ranks) the runtime places encoder work where the simulated step priced it.
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


def deal_longest_first(weights: np.ndarray, n_bins: int, loads: np.ndarray | None = None) -> list[list[int]]:
    """Positions dealt longest first onto the lightest bin (ascending within a bin; bins may be empty).
    ``loads``: (n_bins,) work the bins already hold, updated in place."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = np.zeros(n_bins) if loads is None else loads
    for i in np.argsort(-np.asarray(weights, dtype=float), kind="stable"):
        b = int(np.argmin(loads))
        bins[b].append(int(i))
        loads[b] += weights[i]
    return [sorted(b) for b in bins]


def _deal_encoder(weights: np.ndarray, replicas_of: Sequence[Sequence[int]], llm_split: list[list[int]],
                  loads: np.ndarray) -> list[list[int]]:
    """One encoder's split of one global microbatch: each LLM replica's positions dealt onto the
    encoder replicas that feed it, against the iteration's running ``loads``."""
    split: list[list[int]] = [[] for _ in loads]
    for d, positions in enumerate(llm_split):
        replicas = list(replicas_of[d])
        sub = loads[replicas]
        for k, picks in enumerate(deal_longest_first(weights[positions], len(replicas), sub)):
            split[replicas[k]].extend(positions[i] for i in picks)
        loads[replicas] = sub
    return [sorted(b) for b in split]


def assign_iteration(costs: np.ndarray, modules: Sequence[str], llm_dp: int, encoder_dp: Mapping[str, int],
                     n_microbatches: int, *, tokens: np.ndarray | None = None, token_cap: float | None = None,
                     seed: int = 0, feeds: Mapping[str, Sequence[Sequence[int]]] | None = None) -> IterationAssignment:
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
        feeds: encoder -> per LLM replica, the encoder replicas that feed it (every encoder
            replica must feed some LLM replica); default: every replica feeds every LLM replica.

    Raises:
        ScheduleError: fewer samples than ``llm_dp x n_microbatches``, a sample over the cap, an
            encoder missing from ``modules``, or ``feeds`` that do not cover an encoder's replicas.
    """
    costs = np.asarray(costs, dtype=float)
    missing = [e for e in encoder_dp if e not in modules]
    if missing:
        raise ScheduleError(f"encoders {missing} have no cost column; columns are {list(modules)}")
    feeds = dict(feeds or {})
    for e, degree in encoder_dp.items():
        feeds.setdefault(e, [list(range(degree))])
        covered = sorted({r for rs in feeds[e] for r in rs})
        if covered != list(range(degree)) or len(feeds[e]) not in (1, llm_dp):
            raise ScheduleError(f"feeds[{e!r}] = {feeds[e]} must list, per LLM replica (llm_dp={llm_dp}), "
                                f"encoder replicas covering 0..{degree - 1}")
    enc_loads = {e: np.zeros(degree) for e, degree in encoder_dp.items()}
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
        for e in encoder_dp:
            weights = costs[samples, list(modules).index(e)]
            groups = split if len(feeds[e]) == llm_dp else [list(range(len(samples)))]
            encoder_split[e].append(_deal_encoder(weights, feeds[e], groups, enc_loads[e]))
    return IterationAssignment(micro, llm_split, encoder_split, loads[order])
