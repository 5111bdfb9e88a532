"""Issues one rank's point-to-point messages of one iteration, in the order both ends derived.

`harmonia.schedule.message_order` gives the rank its program (every message it sends or receives,
in action order) and where each receive is posted. The executor and its boundary links call `send`
and `recv` in program order; the messenger checks that they do, posts each receive at its planned
point (before the step the plan names, or earlier where no operation of the rank lies between), and
issues sends at once. No tags: NCCL ignores them, and gloo runs the same calls with tag 0, so every
multi-process test proves the order matches on both ends (FIFO per pair).

Receive buffers come from the iteration's own data (`expect`: a stage message's shape from the
microbatch's token counts or media, a boundary message's rows from its plan), never from a header.
A message whose unit has no data on this replica is `skip`-ped here and on the other end alike.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harmonia.errors import HarmoniaError, ScheduleError
from harmonia.schedule.message_order import MessageOrder, Step


class MessageWaitError(HarmoniaError):
    """A rank's wait for a message ended without it (the process group timed out or the peer is gone)."""


def describe_key(key: Hashable) -> str:
    """A message key as a person reads it: ``llm.s1 -> llm.s2 F microbatch 3`` or ``vision rows of
    microbatch 2 (backward, hop 0)``."""
    if isinstance(key, tuple) and key and key[0] == "stage":
        _, direction, module, src, dst, m, sub, *_ = key
        at = f"{m}" if sub < 0 else f"{m}.{sub}"
        return f"{module}.s{src} -> {module}.s{dst} {'activation' if direction == 'F' else 'gradient'} of microbatch {at}"
    if isinstance(key, tuple) and key and key[0] == "boundary":
        _, encoder, m, backward, hop, *_ = key
        return f"{encoder} rows{' gradient' if backward else ''} of microbatch {m} (hop {hop})"
    return str(key)


@dataclass
class _Expected:
    group: dist.ProcessGroup | None
    make: Callable[[], torch.Tensor]  # the buffer the message lands in
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None


class Messenger:
    """One rank's messages of one iteration.

    Args:
        order: the rank's `MessageOrder`.
        rank: this process's global rank.
    """

    def __init__(self, order: MessageOrder, rank: int) -> None:
        self.order, self.rank = order, rank
        self._next = 0  # the program's next step
        self._posted_upto = -1  # posts[j] for j <= this are posted
        self._peer = {s.key: s.peer for s in order.steps}
        self._expected: dict[Hashable, _Expected] = {}
        self._skipped: set[Hashable] = set()
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.waiting: Step | None = None
        """The step this rank is waiting on (a receive), for a hang's report."""

    def expect(self, key: Hashable, group: dist.ProcessGroup | None, make: Callable[[], torch.Tensor]) -> None:
        """Say how a message this rank receives lands: its group and a buffer factory (called when
        the receive is posted)."""
        self._expected[key] = _Expected(group, make)

    def skip(self, key: Hashable) -> None:
        """A message neither end issues (its unit has no data on this replica)."""
        self._skipped.add(key)

    def post_ready(self) -> None:
        """Post every receive planned before the next step that issues something (call before compute)."""
        j = self._next
        steps = self.order.steps
        while j < len(steps) and steps[j].key in self._skipped:
            j += 1
        for i in range(self._posted_upto + 1, j + 1):
            for key in self.order.posts[i]:
                self._post(key)
        self._posted_upto = max(self._posted_upto, j)

    def _post(self, key: Hashable) -> None:
        if key in self._skipped:
            return
        exp = self._expected.get(key)
        if exp is None:
            raise ScheduleError(f"rank {self.rank}: message {key} is received but no buffer was expected for it")
        exp.buffer = exp.make()
        exp.work = dist.irecv(exp.buffer, self._peer[key], group=exp.group)

    def _advance(self, key: Hashable, send: bool) -> Step:
        """Move to the step issuing ``key``, posting what is planned before it."""
        steps = self.order.steps
        while self._next < len(steps) and steps[self._next].key in self._skipped:
            self._next += 1
        if self._next >= len(steps) or steps[self._next].key != key or steps[self._next].send != send:
            want = steps[self._next] if self._next < len(steps) else "nothing"
            raise ScheduleError(f"rank {self.rank} {'sends' if send else 'receives'} {key} but its message order "
                                f"has {want} next; the executor and the message program disagree")
        self.post_ready()
        step = steps[self._next]
        self._next += 1
        return step

    def send(self, key: Hashable, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """Send a message now (never blocks); its buffer lives until `finish`."""
        step = self._advance(key, True)
        buf = tensor.contiguous()
        self._sends.append((dist.isend(buf, step.peer, group=group), buf))

    def recv(self, key: Hashable) -> torch.Tensor:
        """Wait for a message (posted earlier by plan) and hand its buffer over."""
        step = self._advance(key, False)
        exp = self._expected.pop(key)
        if exp.work is None:
            raise ScheduleError(f"rank {self.rank}: message {key} was never posted; its plan has no post for it")
        self.waiting = step
        try:
            exp.work.wait()
        except RuntimeError as err:  # the process group's timeout, or a peer gone: say which message
            raise MessageWaitError(f"rank {self.rank} gave up waiting to receive {describe_key(key)} from rank "
                                   f"{step.peer} (message {self._next} of its {len(self.order.steps)} this step): "
                                   f"{err}") from err
        self.waiting = None
        return exp.buffer

    def waiting_on(self) -> str | None:
        """What this rank waits for now, for a hang's report (None: it is not waiting on a message)."""
        step = self.waiting
        return None if step is None else f"receive {describe_key(step.key)} from rank {step.peer}"

    def finish(self) -> None:
        """Wait for every send; check the whole program ran."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        left = [s for s in self.order.steps[self._next:] if s.key not in self._skipped]
        if left:
            raise ScheduleError(f"rank {self.rank}: {len(left)} messages of its program were never issued, "
                                f"first {left[0]}; every action must run")
