"""Execute `BoundaryPlan`s inside a pipeline schedule: each transfer split into send and take.

A boundary moves an encoder's output rows to the LLM's layout (forward) and their gradients back
(backward), exactly as the plan says (`harmonia.runtime.boundary_plan`: which rows, which ranks, the
exact adjoint). Inside a pipeline schedule a blocking transfer can deadlock: an encoder rank blocked
sending microbatch 3's rows waits for the LLM's first stage, which is itself waiting for the encoder
to receive microbatch 0's gradient. So the link issues its messages through the iteration's
`Messenger`, in the one order both ends derive from the action lists and plans
(`harmonia.runtime.message_program`): receives are posted where that order puts them (sizes come
from the plan, so there is no header), sends leave as soon as the rows exist and never block, and a
rank waits only when a compute action needs the rows. No tags: the order alone matches a send with
its receive, as NCCL matches them.

Who calls what, for microbatch ``m`` of one encoder -> LLM edge:

- a source rank (the encoder's last stage) calls ``send(m, rows)`` once its rows exist;
- a destination rank (the LLM's first stage) calls ``take(m)`` for its ``(dst_rows, D)`` input rows,
  and later ``send(m, grads, backward=True)`` with their gradients;
- the source calls ``take(m, backward=True)`` for the summed gradients of its rows.

A plan that relays inside nodes (``gpus_per_node``) runs in two hops: forward, ``take`` forwards
the rows that arrived at hop 0 to the rank's TP peers on the node (hop 1) before waiting for the
rows they forward to it; backward with ``partial`` TP gradients, ``send`` first sends this rank's
part to each chunk's receiver and adds the parts its peers send it, then sends the node's sum to
the sources.

Rows move as slices of the plan's row runs, never through index tensors. One link per encoder and
iteration on every rank of the encoder's last stage or the LLM's first stage; messages travel on
the boundary's own group (`ModuleMeshes.boundary_group`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from harmonia.errors import LayoutError, ScheduleError
from harmonia.runtime.boundary_plan import BoundaryPlan, Message
from harmonia.runtime.message_program import boundary_key, lone_transfer_programs
from harmonia.runtime.messenger import Messenger
from harmonia.schedule.message_order import plan_message_order


def _payload(rows: torch.Tensor, msg: Message) -> torch.Tensor:
    """``(n_rows, D)`` rows a message carries, read from the sender's rows (a view for one run)."""
    if len(msg.runs) == 1:
        s, _, n = msg.runs[0]
        return rows[s:s + n]
    return torch.cat([rows[s:s + n] for s, _, n in msg.runs])


def _place(out: torch.Tensor, data: torch.Tensor, msg: Message, accumulate: bool) -> None:
    """Write a message's data (its runs' rows, concatenated) into the receiver's rows ``out``."""
    at = 0
    for _, d, n in msg.runs:
        if accumulate:
            out[d:d + n].add_(data[at:at + n])
        else:
            out[d:d + n].copy_(data[at:at + n])
        at += n


class BoundaryLink:
    """One encoder -> LLM boundary of one iteration on one rank.

    Args:
        plans: one plan per microbatch (the same on every rank).
        rank: this process's global rank.
        group: the boundary's process group (over both modules' ranks).
        hidden: row width ``D`` (the LLM hidden size).
        backward: gradients flow back across the boundary (something upstream of it trains);
            the same on every rank.
        messenger: the iteration's messages of this rank (its order holds this link's messages).
        encoder: the encoder's name (part of every message key).
        dtype: dtype of the rows.
        device: device of the rows.
    """

    def __init__(self, plans: Sequence[BoundaryPlan], rank: int, group: dist.ProcessGroup | None,
                 hidden: int, backward: bool, messenger: Messenger, encoder: str,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.plans, self.rank, self.group, self.hidden = list(plans), rank, group, hidden
        self.backward, self.dtype, self.device = backward, dtype, device
        self.messenger, self.encoder = messenger, encoder
        self.owns_messenger = False  # a lone link finishes its own messenger
        self._rows: dict[int, torch.Tensor] = {}  # microbatch -> this rank's forward rows, filled in place
        self._local: dict[tuple[int, bool], list[tuple[Message, torch.Tensor]]] = {}
        for m, plan in enumerate(self.plans):
            for bwd in (False, True) if backward else (False,):
                for msg in plan.recvs(rank, bwd):
                    messenger.expect(boundary_key(encoder, m, bwd, msg), group, self._buffer_maker(m, bwd, msg))

    @classmethod
    def lone(cls, plans: Sequence[BoundaryPlan], rank: int, group: dist.ProcessGroup | None, hidden: int,
             backward: bool, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             encoder: str = "enc") -> BoundaryLink:
        """A link running its transfers on their own (no pipeline around them), microbatch after
        microbatch in `lone_transfer_programs`' order, with a messenger of its own."""
        order = plan_message_order(lone_transfer_programs(plans, encoder, backward), [rank])
        messenger = Messenger(order[rank], rank) if rank in order else None
        link = cls(plans, rank, group, hidden, backward, messenger, encoder, dtype, device)
        link.owns_messenger = True
        return link

    def _out(self, m: int) -> torch.Tensor:
        """``(dst_rows, D)``: this rank's forward rows of microbatch ``m``."""
        if m not in self._rows:
            self._rows[m] = torch.empty(self.plans[m].dst_rows.get(self.rank, 0), self.hidden, dtype=self.dtype,
                                        device=self.device)
        return self._rows[m]

    def _buffer_maker(self, m: int, backward: bool, msg: Message):
        """A forward message of one row run lands straight in its rows of the microbatch's output."""
        if not backward and len(msg.runs) == 1:
            _, d, n = msg.runs[0]
            return lambda: self._out(m)[d:d + n]
        return lambda: torch.empty(msg.n_rows, self.hidden, dtype=self.dtype, device=self.device)

    def _send_hop(self, m: int, rows: torch.Tensor, backward: bool, hop: int) -> None:
        for msg in self.plans[m].sends(self.rank, backward, hop):
            self.messenger.send(boundary_key(self.encoder, m, backward, msg), _payload(rows, msg), self.group)

    def _wait(self, out: torch.Tensor, m: int, backward: bool, hop: int, accumulate: bool) -> None:
        for msg in self.plans[m].recvs(self.rank, backward, hop):
            data = self.messenger.recv(boundary_key(self.encoder, m, backward, msg))
            if backward or len(msg.runs) > 1:  # else it arrived in place
                _place(out, data, msg, accumulate)

    def send(self, microbatch: int, rows: torch.Tensor, backward: bool = False) -> None:
        """Send this rank's rows of a microbatch (encoder output rows, or their gradients) at once.

        Args:
            microbatch: microbatch index.
            rows: ``(src_rows, D)`` forward on a source rank, ``(dst_rows, D)`` backward on a
                destination rank, in the plan's row order.
            backward: send gradients (the plan's backward messages).
        """
        plan = self.plans[microbatch]
        want = (plan.dst_rows if backward else plan.src_rows).get(self.rank, 0)
        if rows.shape != (want, self.hidden):
            side = "destination" if backward else "source"
            raise LayoutError(f"boundary microbatch {microbatch}: rank {self.rank} is a {side} of {want} "
                              f"rows of width {self.hidden} but has {tuple(rows.shape)}; its samples' "
                              "items must match the boundary plan")
        rows = rows.detach().to(self.dtype).contiguous()
        if backward:  # relay: partial gradients to each chunk's receiver first
            self._send_hop(microbatch, rows, True, 1)
            if plan.recvs(self.rank, True, 1):
                rows = rows.clone()
                self._wait(rows, microbatch, True, 1, accumulate=True)  # plus the peers' parts
        self._send_hop(microbatch, rows, backward, 0)
        local = [(msg, _payload(rows, msg)) for msg in plan.local(self.rank, backward, 0)]
        if local:
            self._local[(microbatch, backward)] = local

    def take(self, microbatch: int, backward: bool = False) -> torch.Tensor:
        """Wait for a microbatch's rows and assemble them.

        Returns:
            ``(dst_rows, D)`` forward (this rank's LLM input rows, ``media.index`` order), or
            ``(src_rows, D)`` backward (the summed gradients of this rank's encoder output rows).
        """
        plan = self.plans[microbatch]
        if backward:  # gradients sum over the messages
            out = torch.zeros(plan.src_rows.get(self.rank, 0), self.hidden, dtype=self.dtype, device=self.device)
        else:  # every row written once: in place at arrival, or copied from a buffer or a local run
            out = self._out(microbatch)  # (dst_rows, D)
        self._wait(out, microbatch, backward, 0, accumulate=backward)
        for msg, data in self._local.pop((microbatch, backward), []):
            _place(out, data, msg, accumulate=backward)
        if not backward:  # relay: pass on what arrived, then take what the peers pass on
            self._send_hop(microbatch, out, False, 1)
            self._wait(out, microbatch, False, 1, accumulate=False)
            self._rows.pop(microbatch)
        return out

    def finish(self) -> None:
        """Check every row this rank was sent was used (and, for a lone link, that its messages ran)."""
        if self.owns_messenger and self.messenger is not None:
            self.messenger.finish()
        left = sorted(self._local) + [(m, False) for m in self._rows]
        self._local.clear()
        self._rows.clear()
        if left:
            raise ScheduleError(f"boundary rows of (microbatch, backward) {left} on rank {self.rank} were never "
                                "taken; the schedule and the plans disagree")
