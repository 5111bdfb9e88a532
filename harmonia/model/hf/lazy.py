"""Tensors that are read or computed only when asked for, a batch at a time.

Export writes a model of any size with one output shard's tensors in memory: every stage between
the training checkpoint and the safetensors files (`harmonia.train.export`: the checkpoint's
tensors, the frozen ones from the source; `harmonia.model.hf.export`: LoRA merged, renamed to the
source's names) is a `LazyTensors`, and the writer asks each for one shard's keys at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch


class LazyTensors(Mapping):
    """A read-only mapping name -> tensor whose values come from ``load`` when asked for.

    Args:
        keys: every name, in order.
        load: names -> their tensors (called with a batch; returns exactly those).
        dtypes: name -> dtype where known without loading (None: unknown).
        shapes: name -> shape where known without loading (None: unknown).
    """

    def __init__(self, keys: Iterable[str], load: Callable[[list[str]], dict[str, torch.Tensor]],
                 dtypes: dict[str, torch.dtype] | None = None, shapes: dict[str, torch.Size] | None = None) -> None:
        self._keys = list(keys)
        self._known = set(self._keys)
        self._load = load
        self.dtypes = dtypes
        self.shapes = shapes

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._known:
            raise KeyError(key)
        return self._load([key])[key]

    def __contains__(self, key: object) -> bool:
        return key in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def load(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, loaded together."""
        missing = [k for k in keys if k not in self._known]
        if missing:
            raise KeyError(missing[0])
        return self._load(list(keys)) if keys else {}


def load_many(tensors: Mapping[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """``{k: tensors[k]}`` for ``keys``, in one batch where ``tensors`` is lazy."""
    if isinstance(tensors, LazyTensors):
        return tensors.load(keys)
    return {k: tensors[k] for k in keys}


def dtypes_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype] | None:
    """Each tensor's dtype without loading any (None where a lazy mapping does not know them)."""
    if isinstance(tensors, LazyTensors):
        return tensors.dtypes
    return {k: t.dtype for k, t in tensors.items()}
