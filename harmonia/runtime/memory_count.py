"""Count the bytes of tensor storage a rank holds during a step, and their peak (any device).

On CUDA the caching allocator counts (``torch.cuda.max_memory_allocated``). On the CPU nothing
does, and the process's resident size mixes tensors with the interpreter, libraries, the data
pipeline and freed-but-kept heap pages; `TensorBytes` counts what the planner prices instead: the
storages alive at the step's start (weights, gradients, optimizer states: `TensorBytes.begin`) plus
every storage an operator creates while it runs, less those freed, through a dispatch mode (so only
while asked for: every operator pays a Python call). A DTensor counts its local shard, other wrapper
tensors (functional collectives' results) the tensors inside.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: a DTensor's local shard, the inner tensors of other
    wrapper subclasses (a functional collective's result), or ``t`` itself."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for name in names for p in _plain(getattr(t, name))]


class TensorBytes(TorchDispatchMode):
    """Live tensor storage bytes and their peak while the mode is on.

    Attributes:
        live: bytes of the storages counted and not yet freed.
        peak: the largest ``live`` since `begin`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, weakref.finalize] = {}

    def begin(self, held: Iterable[torch.Tensor]) -> None:
        """Start a count from the storages of ``held`` (what the rank holds between steps)."""
        for f in self._seen.values():
            f.detach()
        self._seen.clear()
        self.live = 0
        for t in held:
            for p in _plain(t):
                self._count(p)
        self.peak = self.live

    def _count(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._seen:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._seen[key] = weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        if self._seen.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for p in _plain(t):
                    self._count(p)
        return out
