"""One iteration's placement: global microbatches, LLM replicas, encoder replicas.

The executor runs one schedule for every LLM DP replica, so microbatch ``m`` of every replica runs
at the same schedule position: the *global* microbatch ``m`` is the union of the replicas' ``m``-th
microbatches. `assign_iteration` builds it from the balancer:

1. `balance_dp` splits the batch over the LLM's DP replicas and, inside each, into
   ``n_microbatches`` microbatches balanced on every module's work at once (pipeline order: light
   microbatches at both ends).
2. Replicas' ``m``-th microbatches were dealt to balance the replicas, so they have similar loads;
   the global order is the order of their summed loads (`order_microbatches`), the same for all.
3. `assemble_iteration`: inside each global microbatch, each encoder deals every LLM replica's
   samples to the encoder replicas that feed that LLM replica (`feeding_replicas`), longest first
   onto the replica with the least work so far this iteration (on that encoder's cost column). The
   loads carry over between microbatches: restarting from zero would hand the heaviest sample of
   every microbatch to the same replica.

Encoder work is split **by sample**, never by item, and this one split serves every consumer: the
stage work the schedule is ordered and simulated with (`harmonia.schedule.stagework`) and the
tensors each encoder replica runs (`harmonia.runtime.mllm_inputs`). A sample's items go to one
encoder replica because its rows then reach the LLM replica that packs the sample in one run (the
boundary plan moves whole samples), frames and tiles of one item stay together for the encoder's
grouped output, and the baselines' assignments (sequential, reordered) are sample lists too;
items of one sample vary less than samples do, so dealing samples longest first balances nearly as
well as dealing items.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from harmonia.errors import ScheduleError
from harmonia.schedule.dp_balance import balance_dp
from harmonia.schedule.microbatching import order_microbatches
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.workload.cost import CostModel
from harmonia.workload.shapes import SampleShape
from harmonia.workload.work import load_arrays


@dataclass(frozen=True)
class IterationAssignment:
    """Where every sample of an iteration goes.

    Attributes:
        microbatches: per global microbatch, batch positions of its samples (replica 0's first).
        llm_split: per global microbatch, per LLM DP replica, positions into ``microbatches[m]``.
        encoder_split: encoder -> per global microbatch, per encoder DP replica, positions into
            ``microbatches[m]``; a sample cut over several replicas is listed by each of them.
        loads: (n_microbatches, n_modules) summed work of each global microbatch.
        encoder_cuts: encoder -> per global microbatch, ``(encoder replica, position)`` -> the
            replica's share of a sample it encodes only in part (`harmonia.schedule.item_cuts.Cut`);
            a sample without an entry is encoded whole by the one replica listing it.
    """

    microbatches: list[list[int]]
    llm_split: list[list[list[int]]]
    encoder_split: dict[str, list[list[list[int]]]]
    loads: np.ndarray
    encoder_cuts: dict[str, list[dict[tuple[int, int], tuple]]] = field(default_factory=dict)
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """What the stage work derives from the assignment alone, kept for the next plan priced on it
    (`harmonia.schedule.stagework`: per encoder, each replica's cut items and their loads, and its
    units per encoder layout; the training step's whole stage work, `harmonia.train.iteration`);
    under ``batch loads``, a dict shared by every assignment of one batch (`harmonia.plan.recipes.assign`)."""

    def cut(self, encoder: str, m: int, replica: int, position: int) -> tuple | None:
        """The share of sample ``position`` encoder replica ``replica`` encodes (None: whole)."""
        cuts = self.encoder_cuts.get(encoder)
        return cuts[m].get((replica, position)) if cuts else None

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
    held = [0.0] * n_bins if loads is None else loads.tolist()  # Python floats: the same sums, a fraction of the time
    w = np.asarray(weights, dtype=float).tolist()
    for i in sorted(range(len(w)), key=lambda i: -w[i]):  # longest first, ties in position order
        b = min(range(n_bins), key=held.__getitem__)  # the first lightest, as argmin
        bins[b].append(i)
        held[b] += w[i]
    if loads is not None:
        loads[:] = held
    return [sorted(b) for b in bins]


def _deal_encoder(weights: np.ndarray, replicas_of: Sequence[Sequence[int]], llm_split: list[list[int]],
                  loads: np.ndarray) -> list[list[int]]:
    """One encoder's split of one global microbatch: each LLM replica's positions dealt onto the
    encoder replicas that feed it, against the iteration's running ``loads``."""
    split: list[list[int]] = [[] for _ in loads]
    for d, positions in enumerate(llm_split):
        replicas = list(replicas_of[d])
        if len(replicas) == 1:  # one feeder takes them all: the same sum, longest first, as dealing
            (r,) = replicas
            held = float(loads[r])
            for w in sorted(weights[positions].tolist(), reverse=True):
                held += w
            split[r].extend(positions)
            loads[r] = held
            continue
        sub = loads[replicas]
        for k, picks in enumerate(deal_longest_first(weights[positions], len(replicas), sub)):
            split[replicas[k]].extend(positions[i] for i in picks)
        loads[replicas] = sub
    return [sorted(b) for b in split]


def module_columns(per_module: np.ndarray, modules: Sequence[str], encoders: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """The balancer's cost columns from the cost model's per-module work: the LLM's, then each
    encoder's with its projector's (they run on the same ranks).

    Args:
        per_module: (n, len(modules)) seconds per sample and cost-model module.
        modules: the cost model's module names (``llm``, encoders, ``<encoder>_proj``).
        encoders: the plan's encoders.

    Returns:
        ``(costs, columns)``: (n, 1 + encoders) seconds and the column names (``llm`` first).
    """
    col = {m: j for j, m in enumerate(modules)}
    columns = ["llm", *encoders]
    out = np.zeros((per_module.shape[0], len(columns)))
    out[:, 0] = per_module[:, col["llm"]]
    for k, e in enumerate(encoders, start=1):
        out[:, k] = per_module[:, col[e]] + (per_module[:, col[f"{e}_proj"]] if f"{e}_proj" in col else 0.0)
    return out, columns


def balancer_costs(cost: CostModel, shapes: Sequence[SampleShape],
                   encoders: Sequence[str]) -> tuple[np.ndarray, list[str], np.ndarray]:
    """The balancer's inputs for a batch: per-sample seconds in `module_columns`, the column names,
    and (n,) LLM tokens."""
    tokens, pairs = load_arrays(list(shapes), cost.mllm)
    costs, columns = module_columns(cost.costs_from_loads(tokens, pairs), cost.modules, encoders)
    return costs, columns, tokens[:, cost.modules.index("llm")]


def feeding_replicas(plan: Plan, encoder: str) -> list[list[int]]:
    """Per LLM replica, the encoder replicas that feed it: those on its own ranks when every encoder
    replica lies inside one LLM replica's ranks (colocated: boundary rows stay on the replica's
    ranks, and its pipeline never waits for encoder work queued behind another replica's LLM work),
    else round-robin (``enc_dp >= llm_dp``: replicas ``{e : e % llm_dp == d}``; fewer: replica
    ``d % enc_dp``, which then serves several LLM replicas)."""
    return [list(replicas) for replicas in _feeding(plan.layouts[encoder], plan.layouts["llm"])]


@functools.lru_cache(maxsize=4096)
def _feeding(enc_layout: Layout, llm: Layout) -> tuple[tuple[int, ...], ...]:
    """`feeding_replicas` of an encoder's and the LLM's layouts (kept: every plan of a search asks again)."""
    return tuple(map(tuple, _feeding_lists(enc_layout, llm)))


def _feeding_lists(enc_layout: Layout, llm: Layout) -> list[list[int]]:
    enc_dp, llm_dp = enc_layout.dp, llm.dp
    owner = {r: llm.coords(r)["dp"] for r in llm.rank_list()}
    inside: list[list[int]] = [[] for _ in range(llm_dp)]
    for e in range(enc_dp):
        ranks = [enc_layout.rank_at(pp=p, dp=e, cp=c, tp=t) for p in range(enc_layout.pp)
                 for c in range(enc_layout.cp) for t in range(enc_layout.tp)]
        replicas = {owner.get(r) for r in ranks}
        if len(replicas) != 1 or None in replicas:
            break
        inside[replicas.pop()].append(e)
    else:
        if all(inside):
            return inside
    if enc_dp >= llm_dp:
        return [[e for e in range(enc_dp) if e % llm_dp == d] for d in range(llm_dp)]
    return [[d % enc_dp] for d in range(llm_dp)]


def assemble_iteration(per_replica: Sequence[Sequence[Sequence[int]]], costs: np.ndarray, modules: Sequence[str],
                       encoder_dp: Mapping[str, int], *, feeds: Mapping[str, Sequence[Sequence[int]]] | None = None,
                       order: Sequence[int] | None = None) -> IterationAssignment:
    """Global microbatches from each LLM replica's microbatches, and every encoder's split of them.

    Args:
        per_replica: per LLM DP replica, its microbatches as batch positions (every replica the
            same number, each microbatch non-empty).
        costs: (n_samples, n_modules) per-module work of the batch's samples (columns ``modules``).
        modules: column names; ``llm`` and every encoder of ``encoder_dp``.
        encoder_dp: encoder -> its DP degree.
        feeds: encoder -> per LLM replica, the encoder replicas that feed it (every encoder
            replica must feed some LLM replica); default: every replica feeds every LLM replica.
        order: the global microbatches' order (default: as numbered).

    Raises:
        ScheduleError: replicas with different microbatch counts, an encoder missing from
            ``modules``, or ``feeds`` that do not cover an encoder's replicas.
    """
    costs = np.asarray(costs, dtype=float)
    llm_dp = len(per_replica)
    counts = {len(mbs) for mbs in per_replica}
    if len(counts) != 1:
        raise ScheduleError(f"LLM replicas have {sorted(counts)} microbatches; give every replica as many")
    n = counts.pop()
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
    micro, llm_split, loads = [], [], []
    encoder_split: dict[str, list[list[list[int]]]] = {e: [] for e in encoder_dp}
    for m in (range(n) if order is None else order):
        samples = [int(i) for rep in per_replica for i in rep[m]]
        micro.append(samples)
        loads.append(costs[samples].sum(axis=0))
        split, start = [], 0
        for rep in per_replica:
            split.append(list(range(start, start + len(rep[m]))))
            start += len(rep[m])
        llm_split.append(split)
        for e in encoder_dp:
            weights = costs[samples, list(modules).index(e)]
            groups = split if len(feeds[e]) == llm_dp else [list(range(len(samples)))]
            encoder_split[e].append(_deal_encoder(weights, feeds[e], groups, enc_loads[e]))
    return IterationAssignment(micro, llm_split, encoder_split, np.asarray(loads).reshape(len(micro), -1))


def assign_iteration(costs: np.ndarray, modules: Sequence[str], llm_dp: int, encoder_dp: Mapping[str, int],
                     n_microbatches: int, *, tokens: np.ndarray | None = None, token_cap: float | None = None,
                     seed: int = 0, feeds: Mapping[str, Sequence[Sequence[int]]] | None = None,
                     kept: dict | None = None) -> IterationAssignment:
    """Balanced global microbatches of one iteration (steps 1-3 of the module docstring).

    Args:
        costs: (n_samples, n_modules) per-module work of the batch's samples (columns ``modules``).
        modules: column names; ``llm`` and every encoder of ``encoder_dp``.
        llm_dp: the LLM's DP degree.
        encoder_dp: encoder -> its DP degree.
        n_microbatches: microbatches per LLM replica.
        tokens: (n_samples,) LLM tokens, for ``token_cap``.
        token_cap: the most LLM tokens one replica's microbatch may hold.
        seed: tie-break seed (the result is deterministic for a seed).
        feeds: encoder -> per LLM replica, the encoder replicas that feed it (`feeding_replicas`);
            default: every replica feeds every LLM replica.
        kept: the LLM's DP balances of earlier calls with the same ``costs``, ``tokens``, cap and
            seed, by replicas and microbatches (a plan search assigns one batch for many encoder
            layouts, which the balance does not depend on); updated with this call's.

    Raises:
        ScheduleError: fewer samples than ``llm_dp x n_microbatches``, a sample over the cap, an
            encoder missing from ``modules``, or ``feeds`` that do not cover an encoder's replicas.
    """
    costs = np.asarray(costs, dtype=float)
    key = ("dp balance", llm_dp, n_microbatches, tuple(modules))
    dpa = None if kept is None else kept.get(key)
    if dpa is None:
        dpa = balance_dp(costs, llm_dp, tokens=tokens, n_microbatches=n_microbatches, token_cap=token_cap,
                         modules=list(modules), seed=seed, kept=kept)
        if kept is not None:
            kept[key] = dpa
    per_m = [[dpa.microbatches[d][m] for d in range(llm_dp)] for m in range(n_microbatches)]
    summed = np.stack([costs[[i for rep in reps for i in rep]].sum(axis=0) for reps in per_m])
    return assemble_iteration(dpa.microbatches, costs, modules, encoder_dp, feeds=feeds,
                              order=order_microbatches(summed))
