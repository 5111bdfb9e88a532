"""Batch-level profiling: the per-module work of whole global batches, not single samples.

A layout must fit the work of a global batch. Per-sample module-cost ratios vary wildly (a
text-only sample has no vision work, a 13-tile document has a lot), but a global batch sums
hundreds of samples, so its ratios concentrate: the coefficient of variation of a mean of ``B``
i.i.d. samples falls as ``1/sqrt(B)``. That is why one static layout, chosen from a few profiled
batches, serves the whole run while per-iteration balancing absorbs the rest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from harmonia.errors import ConfigError
from harmonia.workload.cost import CostModel
from harmonia.workload.shapes import SampleShape
from harmonia.workload.work import ModuleLoad, load_arrays


@dataclass(frozen=True)
class BatchProfile:
    """Per-module work of K sampled global batches.

    Attributes:
        modules: module names (columns).
        batch_costs: (K, n_modules) F+B+W seconds of each batch on one device.
        batch_tokens: (K, n_modules) tokens of each batch per module.
        batch_pairs: (K, n_modules) attended pairs of each batch per module.
        global_batch: samples per batch.
        batches: sample indices of each batch, (K, global_batch).
        drawn: the first batches, drawn as training draws them, that the means are taken over
            (None: all); those after are chosen for their weight (`heaviest`).
    """

    modules: list[str]
    batch_costs: np.ndarray
    batch_tokens: np.ndarray
    batch_pairs: np.ndarray
    global_batch: int
    batches: np.ndarray
    drawn: int | None = None

    def take(self, rows, drawn: int | None = None) -> BatchProfile:
        """The profile of the batches at ``rows``, the first ``drawn`` of them drawn (None: all)."""
        rows = np.asarray(list(rows), dtype=int)
        return BatchProfile(self.modules, self.batch_costs[rows], self.batch_tokens[rows], self.batch_pairs[rows],
                            self.global_batch, self.batches[rows], drawn)

    def ratios(self) -> np.ndarray:
        """(K, n_modules) share of each module in its batch's total work."""
        return self.batch_costs / self.batch_costs.sum(axis=1, keepdims=True)

    def ratio_cv(self) -> np.ndarray:
        """(n_modules,) coefficient of variation across batches of each module's share."""
        r = self.ratios()[: self.drawn]
        mean = r.mean(axis=0)
        return np.where(mean > 0, r.std(axis=0) / np.where(mean > 0, mean, 1), 0.0)

    def mean_costs(self) -> dict[str, float]:
        """Mean seconds per global batch of each module."""
        return dict(zip(self.modules, self.batch_costs[: self.drawn].mean(axis=0).tolist()))

    def sample_load(self, module: str) -> ModuleLoad:
        """Mean per-sample load of a module (a reference for stage splits and memory)."""
        return self._sample_loads[module]

    @functools.cached_property
    def _sample_loads(self) -> dict[str, ModuleLoad]:
        """`sample_load` of every module, computed once (the planner asks for it per candidate)."""
        tokens, pairs = self.batch_tokens[: self.drawn], self.batch_pairs[: self.drawn]
        return {m: ModuleLoad(int(tokens[:, j].mean() / self.global_batch),
                              int(pairs[:, j].mean() / self.global_batch), 1)
                for j, m in enumerate(self.modules)}


def profile_batches(samples: list[SampleShape], cost: CostModel, global_batch: int, n_batches: int = 16,
                    seed: int = 0) -> BatchProfile:
    """Draw ``n_batches`` global batches as a shuffling sampler would and measure their work.

    Batches are consecutive slices of random permutations of the trace (a new permutation each
    epoch), so no sample repeats within a batch.
    """
    if global_batch < 1 or n_batches < 1:
        raise ConfigError(f"global_batch={global_batch} and n_batches={n_batches} must be >= 1")
    if global_batch > len(samples):
        raise ConfigError(
            f"global_batch={global_batch} exceeds the trace's {len(samples)} samples; use a smaller "
            "global batch or a longer trace"
        )
    rng = np.random.default_rng(seed)
    per_epoch = len(samples) // global_batch
    batches = []
    while len(batches) < n_batches:
        perm = rng.permutation(len(samples))
        batches.extend(perm[i * global_batch:(i + 1) * global_batch] for i in range(per_epoch))
    idx = np.stack(batches[:n_batches])
    tokens, pairs = load_arrays(samples, cost.mllm)
    costs = cost.costs_from_loads(tokens, pairs)

    def sums(per_sample: np.ndarray) -> np.ndarray:  # (n_batches, n_modules), one batch at a time
        return np.stack([per_sample[row].sum(axis=0) for row in idx])  # not (n_batches, global_batch, n_modules)

    return BatchProfile(cost.modules, sums(costs), sums(tokens), sums(pairs), global_batch, idx)


MEMORY_POOL = 64
"""How many times more batches than it keeps the scenario draws to pick them from (`heaviest`): with
8 memory batches, the heaviest of 512 (a batch training draws later has more LLM tokens than all
of them about once in 500; only a cap on each microbatch's tokens at run time would bound them all)."""


def heaviest(profile: BatchProfile, keep: int) -> list[int]:
    """The rows of the ``keep`` heaviest batches of ``profile``: by each module's tokens in turn (the
    most LLM tokens, then the most of the next module's, ...), skipping one taken. A plan checked
    only on batches drawn as training draws them meets heavier ones as it trains: a batch's
    activation peak follows its tokens (balanced microbatches each hold about a share of them), so
    these are the batches most likely to exceed the device."""
    order = [np.argsort(-profile.batch_tokens[:, m], kind="stable") for m in range(len(profile.modules))]
    llm = profile.modules.index("llm") if "llm" in profile.modules else 0
    order.insert(0, order.pop(llm))
    keep = min(keep, len(profile.batches))
    taken: list[int] = []
    heads = [0] * len(order)
    while len(taken) < keep:
        for m, ranked in enumerate(order):
            while heads[m] < len(ranked) and int(ranked[heads[m]]) in taken:
                heads[m] += 1
            if heads[m] < len(ranked) and len(taken) < keep:
                taken.append(int(ranked[heads[m]]))
    return taken
