"""A CPU stand-in for tensors on a GPU, to show that code reads nothing back from the device.

`DeviceTensor` is a CPU tensor that plays one on a GPU: every value computed from it is one too, and
while `no_host_reads` is on, each operation that on a GPU would wait for the device to hand a value
to the host (``.tolist()``, ``.item()``, ``int()``, ``bool()``, ``torch.equal``, ``nonzero``, a
boolean-mask index, ``bincount``, ...) raises `HostRead` naming it, with its stack. `on_device` moves
a batch as `harmonia.train.rank.to_device` does, fields marked `harmonia.model.batch.HOST` staying
plain host tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

_GUARD = [False]


class HostRead(AssertionError):
    """A value was read from a (stand-in) device tensor on the host."""


_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.nonzero, torch.nonzero, torch.equal,
    torch.Tensor.equal, torch.bincount, torch.Tensor.bincount, torch.unique, torch.Tensor.unique,
    torch.masked_select, torch.Tensor.masked_select, torch.Tensor.any, torch.Tensor.all,
}
"""Host reads of a device value, or kernels whose output size waits for one on CUDA (``nonzero``,
``bincount``, ``unique``, ``masked_select``) — ``any``/``all`` count as they are only ever read."""


def _reads(func, args) -> bool:
    if func in _READS:
        return True
    if func is torch.Tensor.__getitem__:  # a boolean mask: nonzero on the device
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return func is torch.repeat_interleave and len(args) > 1 and isinstance(args[1], torch.Tensor)


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for one on a GPU (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _GUARD[0] and _reads(func, args):
            raise HostRead(f"{getattr(func, '__qualname__', func)} reads a device tensor on the host")
        return super().__torch_function__(func, types, args, kwargs or {})


@contextlib.contextmanager
def no_host_reads():
    """While on, a host read of a `DeviceTensor` raises `HostRead`."""
    _GUARD[0] = True
    try:
        yield
    finally:
        _GUARD[0] = False


def on_device(obj):
    """``obj`` with every tensor inside a `DeviceTensor` (dataclasses, lists, tuples, dicts), but for
    the dataclass fields marked to stay on the host (as `harmonia.train.rank.to_device` moves it)."""
    if isinstance(obj, torch.Tensor):
        return obj.as_subclass(DeviceTensor)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: getattr(obj, f.name) if f.metadata.get("host") else
                                           on_device(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_device(x) for x in obj)
    if isinstance(obj, dict):
        return {k: on_device(v) for k, v in obj.items()}
    return obj
