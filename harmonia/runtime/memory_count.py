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

    A storage is known by its C++ object, not its data pointer: FSDP2 frees a gathered weight by
    resizing its storage to 0 bytes and gathers it again into the same storage (a new pointer), so
    while the mode is on `UntypedStorage.resize_` is followed too and each resize changes the count.

    Attributes:
        live: bytes of the storages counted and not yet freed.
        peak: the largest ``live`` since `begin`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, tuple[int, weakref.finalize]] = {}  # storage -> (bytes counted, finalizer)
        self._resize = None

    def begin(self, held: Iterable[torch.Tensor]) -> None:
        """Start a count from the storages of ``held`` (what the rank holds between steps)."""
        for _, f in self._seen.values():
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
        self._follow(t.untyped_storage())

    def _follow(self, storage: torch.UntypedStorage) -> None:
        """Count a storage: a new one whole, a known one by how much it grew or shrank since."""
        key, nbytes = storage._cdata, storage.nbytes()
        known = self._seen.get(key)
        if known is None:
            self._seen[key] = (nbytes, weakref.finalize(storage, self._freed, key))
        elif known[0] != nbytes:
            self._seen[key] = (nbytes, known[1])
        else:
            return
        self.live += nbytes - (known[0] if known else 0)
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        known = self._seen.pop(key, None)
        if known is not None:
            self.live -= known[0]

    def __enter__(self):
        counter, resize = self, torch.UntypedStorage.resize_

        def resize_followed(storage, size):
            out = resize(storage, size)
            counter._follow(storage)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_followed
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for p in _plain(t):
                    self._count(p)
        return out
