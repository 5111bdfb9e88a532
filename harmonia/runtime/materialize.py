"""Give a module built and sharded on the ``meta`` device its memory: only this rank's shards.

A rank builds each stage chunk on ``meta`` (no memory), applies training modes, tensor parallelism
and FSDP there (`harmonia.runtime.parallelize.parallelize_stage`), and only then allocates: every
parameter's local shard on the rank's device (`torch.nn.Module.to_empty`), filled from the
parameter's whole value, which is made (from the seed) or read (from a checkpoint) one tensor at a
time: where the shard is one box of the whole tensor (``Shard`` and ``Replicate`` placements, what
FSDP and TP give one dimension each) only that box is asked for (`shard_box`: a checkpoint reads
only those bytes), otherwise the whole value is cut to this rank's shard (`local_part`). Peak memory
while building: the rank's shards plus the largest single tensor, never the whole stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[slice, ...]


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole value ``full`` under the sharding of ``like`` (a DTensor or a plain
    tensor), on its device and in ``full``'s dtype (the copy into the shard converts); no
    communication (every rank holds ``full``)."""
    full = full.to(device=like.device)
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def shard_box(like: torch.Tensor) -> Box | None:
    """The box (one slice per dim) of the whole tensor that this rank's shard of ``like`` is, or None
    where it is not one box (a plain tensor: the whole; FSDP's strided shards over TP)."""
    if not isinstance(like, DTensor) or not all(type(p) is Shard or isinstance(p, Replicate) for p in like.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device,
                value_of: Callable[[str, Box | None], torch.Tensor]) -> None:
    """Allocate ``module``'s parameters and buffers on ``device`` and fill them, one tensor at a time.

    Args:
        module: built (and possibly sharded) on ``meta``.
        device: the rank's device.
        value_of: ``(module-local name, box)`` -> that box of the tensor's whole value, or the whole
            value for None (any dtype, on the CPU).
    """
    module.to_empty(device=device)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        box = shard_box(t)
        part = local_part(value_of(name, None), t) if box is None else value_of(name, box)
        target = t.to_local() if isinstance(t, DTensor) else t
        if target.shape != part.shape:
            raise RuntimeError(f"{name}: local shard {tuple(target.shape)} but the layout gives {tuple(part.shape)}")
        target.copy_(part)  # converts to the held dtype and device in one pass, no converted copy
