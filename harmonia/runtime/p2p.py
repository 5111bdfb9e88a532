"""Point-to-point transfers of variable-shape tensors between pipeline stages.

Every message travels as two asynchronous transfers with their own tags: a fixed-size header
(``ndim`` then the sizes) and the data. Microbatch shapes change every iteration, so nothing is
padded and nothing is inferred once: the receiver learns the shape from the header, then posts the
data receive. Tags come from the message (direction, source stage, microbatch, sub-microbatch),
so transfers between the same two ranks may complete in any order.

A receive is posted as a header receive as early as possible (`P2P.expect`); `P2P.poll` turns
every header that has arrived into a data receive, so data flows while the rank computes; `P2P.take`
waits for the data only when a compute action needs it. When both sides can derive a message's
shape from the iteration's data (the executor knows every microbatch's token count), the header is
skipped: the sender passes ``announce=False`` and the receiver the shape, which posts the data
receive at once. Sends return at once; their buffers stay alive until `P2P.wait_sends`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from harmonia.errors import ScheduleError
from harmonia.schedule.actions import Action
from harmonia.schedule.validator import message

MAX_DIMS = 7
_MAX_MB = 1 << 14


def message_tag(action: Action) -> int:
    """The tag shared by a send and its matching receive (header ``2t``, data ``2t + 1``)."""
    direction, src, _dst, mb, sub = message(action)
    sub1 = 0 if sub is None else sub + 1
    if mb >= _MAX_MB or sub1 >= 64 or src.stage >= 256:
        raise ScheduleError(f"{action}: microbatch < {_MAX_MB}, sub-microbatch < 63 and stage < 256 "
                            "are supported by the P2P tags; use fewer microbatches per iteration")
    return (((mb * 64 + sub1) * 2 + (direction == "B")) * 256 + src.stage) * 2


@dataclass
class _Pending:
    src: int
    tag: int
    header: torch.Tensor | None
    header_work: dist.Work | None
    data: torch.Tensor | None = None
    data_work: dist.Work | None = None


@dataclass
class P2P:
    """Asynchronous shape-carrying sends and receives on one process group.

    Attributes:
        group: process group the peer ranks belong to (None = default group); ranks are global.
        dtype: dtype of every activation and gradient sent.
        device: device receive buffers live on.
    """

    group: dist.ProcessGroup | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    _pending: dict[int, _Pending] = field(default_factory=dict)
    _sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)

    def send(self, action: Action, tensor: torch.Tensor, announce: bool = True) -> None:
        """Send ``tensor`` (any shape, up to 7 dims) to the action's peer rank without blocking.

        ``announce=False`` sends no shape header: the receiver must pass the shape to `expect`.
        """
        if tensor.dim() > MAX_DIMS:
            raise ScheduleError(f"{action}: tensors of more than {MAX_DIMS} dims cannot be sent")
        tag = message_tag(action)
        bufs = [(tensor.detach().to(self.dtype).contiguous(), tag + 1)]
        if announce:
            header = torch.zeros(MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            header[0] = tensor.dim()
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            bufs.insert(0, (header, tag))
        for buf, t in bufs:
            self._sends.append((dist.isend(buf, action.peer_rank, group=self.group, tag=t), buf))

    def expect(self, action: Action, shape: tuple[int, ...] | None = None) -> None:
        """Post the receive of a receive action (call early): its header receive, whose data
        receive follows in `poll`, or with a known ``shape`` (the sender sends no header) the data
        receive itself."""
        tag = message_tag(action)
        if tag in self._pending:
            raise ScheduleError(f"{action} is received twice in one iteration")
        if shape is not None:
            p = _Pending(action.peer_rank, tag, None, None)
            self._post_data(p, shape)
        else:
            header = torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device)
            work = dist.irecv(header, action.peer_rank, group=self.group, tag=tag)
            p = _Pending(action.peer_rank, tag, header, work)
        self._pending[tag] = p

    def _post_data(self, p: _Pending, shape: tuple[int, ...] | None = None) -> None:
        if shape is None:
            p.header_work.wait()
            ndim = int(p.header[0])
            shape = tuple(int(s) for s in p.header[1:1 + ndim])
        p.data = torch.empty(shape, dtype=self.dtype, device=self.device)
        p.data_work = dist.irecv(p.data, p.src, group=self.group, tag=p.tag + 1)

    def poll(self) -> None:
        """Post the data receive of every message whose header has arrived."""
        for p in self._pending.values():
            if p.data_work is None and p.header_work.is_completed():
                self._post_data(p)

    def take(self, action: Action) -> torch.Tensor:
        """Wait for a received tensor and hand it over."""
        tag = message_tag(action)
        p = self._pending.pop(tag, None)
        if p is None:
            raise ScheduleError(f"{action}: no receive was posted; call expect() first")
        if p.data_work is None:
            self._post_data(p)
        p.data_work.wait()
        return p.data

    def wait_sends(self) -> None:
        """Block until every send of the iteration has completed, then free the buffers."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._pending:
            raise ScheduleError(f"{len(self._pending)} received messages were never consumed; "
                                "every RECV must be followed by the compute that uses it")
