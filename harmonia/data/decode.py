"""Decode a rank's samples in worker processes.

`SampleDecoder(dataset, num_workers)` decodes lists of dataset indices: in this process with
``num_workers=0``, else split into ``num_workers`` contiguous runs decoded in parallel by a pool of
forked processes (started once, with the dataset inherited rather than pickled, as
``torch.utils.data.DataLoader``'s workers are). Results come back in order, decoded samples or
`harmonia.data.loader.Failed` values; nothing is counted here (the caller agrees on failures with
the other ranks first). Decoded samples are kept up to ``cache_bytes`` of their tensors, least
recently used dropped first (`DecodedCache`), so a sample trained again in a later epoch is not
decoded again. With workers, `SampleDecoder.prefetch` starts decoding indices a later call will
ask for (the next step's, as its balancer assigns them) without waiting: the workers decode while
the rank trains, and that call takes the results instead of decoding. Tensors travel as plain
pickles, so no shared-memory handle outlives a worker; a worker exits with its parent where the
caller passes how (``worker_init``: the trainer gives `harmonia.runtime.watchdog.exit_with_parent`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import signal
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from harmonia.data.loader import Failed, MultimodalDataset
from harmonia.data.samples import LoadedSample
from harmonia.errors import SampleError

_WORKER_DATASET: list[MultimodalDataset] = []  # the dataset of this worker process (set once, at fork)


def _init_worker(dataset: MultimodalDataset, parent: int, worker_init: Callable[[int], None] | None) -> None:
    """A worker: default signal handling (the rank stops it), one torch thread, ``worker_init(parent)``."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    if worker_init is not None:
        worker_init(parent)
    _WORKER_DATASET.append(dataset)


def _decode_run(indices: list[int]) -> bytes:
    return pickle.dumps(_WORKER_DATASET[0].decode(indices), protocol=pickle.HIGHEST_PROTOCOL)


def _runs(indices: list[int], n: int) -> list[list[int]]:
    """``indices`` cut into at most ``n`` contiguous runs of near-equal length."""
    n = max(1, min(n, len(indices)))
    size, extra = divmod(len(indices), n)
    out, start = [], 0
    for k in range(n):
        end = start + size + (k < extra)
        out.append(indices[start:end])
        start = end
    return out


def tensor_bytes(value) -> int:
    """Bytes of the tensors held by ``value`` (dataclasses, lists, tuples and dicts walked)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


class DecodedCache:
    """Decoded samples by dataset index, at most ``limit`` bytes of tensors, least recently used
    dropped first; a sample larger than the limit is not kept. The training path only reads a
    sample's tensors (packing copies them), so a kept sample is handed out again as it is."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._kept: OrderedDict[int, tuple[LoadedSample, int]] = OrderedDict()

    def __contains__(self, index: int) -> bool:
        return index in self._kept

    def get(self, index: int) -> LoadedSample | None:
        found = self._kept.get(index)
        if found is None:
            return None
        self._kept.move_to_end(index)
        return found[0]

    def put(self, sample: LoadedSample) -> None:
        size = tensor_bytes(sample)
        if size > self.limit or sample.index in self._kept:
            return
        self._kept[sample.index] = (sample, size)
        self.held += size
        while self.held > self.limit:
            _, (_, dropped) = self._kept.popitem(last=False)
            self.held -= dropped


class SampleDecoder:
    """Decodes dataset indices, in ``num_workers`` processes (0: in this process).

    Args:
        dataset: the dataset (its records and decoding settings are what the workers use).
        num_workers: worker processes.
        worker_init: called in each worker with this process's pid as it starts (forked, so not
            pickled), e.g. to end the worker with its parent.
        cache_bytes: decoded samples kept (`DecodedCache`; 0 = none).
    """

    def __init__(self, dataset: MultimodalDataset, num_workers: int = 0,
                 worker_init: Callable[[int], None] | None = None, cache_bytes: int = 0) -> None:
        self.dataset, self.num_workers = dataset, num_workers
        self.cache = DecodedCache(cache_bytes) if cache_bytes > 0 else None
        self._pool: ProcessPoolExecutor | None = None
        self._ahead: dict[int, tuple[Future, list[int]]] = {}  # index -> its run's decoding in flight, the run
        if num_workers > 0:
            self._pool = ProcessPoolExecutor(num_workers, mp_context=mp.get_context("fork"),
                                             initializer=_init_worker,
                                             initargs=(dataset, os.getpid(), worker_init))
            self._pool.submit(int).result()  # fork the workers now, from the constructing thread

    @property
    def has_workers(self) -> bool:
        """Whether decoding runs in worker processes (`prefetch` does something)."""
        return self._pool is not None

    def prefetch(self, indices: list[int]) -> None:
        """Start decoding ``indices`` in the workers without waiting, for a later `decode` to take;
        ones kept or in flight already are left out. Without workers, nothing."""
        if self._pool is None:
            return
        kept = self.cache if self.cache is not None else ()
        todo = [i for i in dict.fromkeys(indices) if i not in self._ahead and i not in kept]
        for run in _runs(todo, self.num_workers) if todo else []:
            future = self._pool.submit(_decode_run, run)
            self._ahead.update((i, (future, run)) for i in run)

    def decode(self, indices: list[int]) -> list[LoadedSample | Failed]:
        """Decoded samples (or `Failed`) of ``indices``, in order; kept ones from the cache, ones
        `prefetch` started from their workers."""
        found = {} if self.cache is None else {i: s for i in indices if (s := self.cache.get(i)) is not None}
        for i in indices:
            if i not in found and i in self._ahead:
                found.update(self._take(i, indices))
        todo = [i for i in indices if i not in found]
        for i, sample in zip(todo, self._decode(todo)):
            found[i] = sample
            self._keep(sample)
        return [found[i] for i in indices]

    def _take(self, index: int, wanted: list[int]) -> dict[int, LoadedSample | Failed]:
        """The results of the prefetched run holding ``index`` (waited for): every decoded sample
        of it kept, those of ``wanted`` returned (failures only there: a later call decodes again)."""
        future, run = self._ahead[index]
        for i in run:
            del self._ahead[i]
        results = self._results(future, run)
        for sample in results:
            self._keep(sample)
        asked = set(wanted)
        return {i: r for i, r in zip(run, results) if i in asked}

    def _keep(self, sample: LoadedSample | Failed) -> None:
        if self.cache is not None and isinstance(sample, LoadedSample):
            self.cache.put(sample)

    def _decode(self, indices: list[int]) -> list[LoadedSample | Failed]:
        if not indices:
            return []
        if self._pool is None:
            return self.dataset.decode(indices)
        runs = _runs(list(indices), self.num_workers)
        out: list[LoadedSample | Failed] = []
        for future, run in [(self._pool.submit(_decode_run, run), run) for run in runs]:
            out += self._results(future, run)
        return out

    @staticmethod
    def _results(future: Future, run: list[int]) -> list[LoadedSample | Failed]:
        try:
            return pickle.loads(future.result())
        except BrokenProcessPool as e:
            raise SampleError(f"a data worker process died while decoding samples {run} ({e}); it was "
                              "killed (out of memory?): lower data.num_workers or check those samples") from e

    def close(self) -> None:
        """Stop the workers."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead.clear()

    def __enter__(self) -> SampleDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
