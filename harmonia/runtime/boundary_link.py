"""Execute `BoundaryPlan`s inside a pipeline schedule: each transfer split into post, send and take.

A boundary moves an encoder's output rows to the LLM's layout (forward) and their gradients back
(backward), exactly as the plan says (`harmonia.runtime.boundary_plan`: which rows, which ranks, the
exact adjoint). Inside a pipeline schedule a blocking transfer can deadlock: an encoder rank blocked
sending microbatch 3's rows waits for the LLM's first stage, which is itself waiting for the encoder
to receive microbatch 0's gradient. So the link runs plans the way the executor's P2P runs stage
messages: receives are posted at the start of the iteration (sizes come from the plan, so there is
no header), sends leave as soon as the rows exist and never block, and a rank waits only when a
compute action needs the rows.

Who calls what, for microbatch ``m`` of one encoder -> LLM edge:

- a source rank (the encoder's last stage) calls ``send(m, rows)`` once its rows exist;
- a destination rank (the LLM's first stage) calls ``take(m)`` for its ``(dst_rows, D)`` input rows,
  and later ``send(m, grads, backward=True)`` with their gradients;
- the source calls ``take(m, backward=True)`` for the summed gradients of its rows.

A plan that relays inside nodes (``gpus_per_node``) runs in two hops: forward, ``take`` forwards
the rows that arrived at hop 0 to the rank's TP peers on the node (hop 1) before waiting for the
rows they forward to it; backward with ``partial`` TP gradients, ``send`` first sends this rank's
part to each chunk's receiver and adds the parts its peers send it, then sends the node's sum to
the sources. Every rank posts its sends before it waits, so the hops cannot deadlock.

Rows move as slices of the plan's row runs, never through index tensors. One link per encoder and
iteration on every rank of the encoder's last stage or the LLM's first stage; messages travel on
the boundary's own group (`ModuleMeshes.boundary_group`), tagged by microbatch, direction and hop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from harmonia.errors import LayoutError, ScheduleError
from harmonia.runtime.boundary_plan import BoundaryPlan, Message

_Inbox = list[tuple[Message, "torch.Tensor | None", "dist.Work | None"]]  # (message, buffer or None: in place, work)


def _tag(microbatch: int, backward: bool, hop: int) -> int:
    return 4 * microbatch + 2 * hop + int(backward)


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
        dtype: dtype of the rows.
        device: device of the rows.
    """

    def __init__(self, plans: Sequence[BoundaryPlan], rank: int, group: dist.ProcessGroup | None,
                 hidden: int, backward: bool, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.plans, self.rank, self.group, self.hidden = list(plans), rank, group, hidden
        self.backward, self.dtype, self.device = backward, dtype, device
        self._inbox: dict[tuple[int, bool, int], _Inbox] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._rows: dict[int, torch.Tensor] = {}  # microbatch -> this rank's forward rows, filled in place

    def post_receives(self) -> None:
        """Post every receive of the iteration (forward rows; gradients when ``backward``). A forward
        message of one row run lands straight in its rows of the microbatch's output."""
        for m, plan in enumerate(self.plans):
            out = self._rows[m] = torch.empty(plan.dst_rows.get(self.rank, 0), self.hidden, dtype=self.dtype,
                                              device=self.device)  # (dst_rows, D)
            for bwd in (False, True) if self.backward else (False,):
                for msg in plan.recvs(self.rank, bwd):
                    direct = not bwd and len(msg.runs) == 1
                    _, d, n = msg.runs[0]
                    buf = out[d:d + n] if direct else torch.empty(msg.n_rows, self.hidden, dtype=self.dtype,
                                                                  device=self.device)
                    work = dist.irecv(buf, msg.src, group=self.group, tag=_tag(m, bwd, msg.hop))
                    self._inbox.setdefault((m, bwd, msg.hop), []).append((msg, None if direct else buf, work))

    def _post(self, plan: BoundaryPlan, m: int, rows: torch.Tensor, backward: bool, hop: int) -> None:
        for msg in plan.sends(self.rank, backward, hop):
            buf = _payload(rows, msg).contiguous()
            self._sends.append((dist.isend(buf, msg.dst, group=self.group, tag=_tag(m, backward, hop)), buf))

    def _wait(self, out: torch.Tensor, m: int, backward: bool, hop: int, accumulate: bool) -> None:
        for msg, buf, work in self._inbox.pop((m, backward, hop), []):
            if work is not None:
                work.wait()
            if buf is not None:  # None: it arrived in place
                _place(out, buf, msg, accumulate)

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
            self._post(plan, microbatch, rows, True, 1)
            if (microbatch, True, 1) in self._inbox:
                rows = rows.clone()
                self._wait(rows, microbatch, True, 1, accumulate=True)  # plus the peers' parts
        self._post(plan, microbatch, rows, backward, 0)
        box = self._inbox.setdefault((microbatch, backward, 0), [])
        for msg in plan.local(self.rank, backward, 0):
            box.append((msg, _payload(rows, msg), None))

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
            out = self._rows.pop(microbatch)  # (dst_rows, D)
        self._wait(out, microbatch, backward, 0, accumulate=backward)
        if not backward:  # relay: pass on what arrived, then take what the peers pass on
            self._post(plan, microbatch, out, False, 1)
            self._wait(out, microbatch, False, 1, accumulate=False)
        return out

    def finish(self) -> None:
        """Wait for every send of the iteration; check every received message was used."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        left = [key for key, box in self._inbox.items() if box]
        self._inbox.clear()
        self._rows.clear()
        if left:
            raise ScheduleError(f"boundary rows of (microbatch, backward, hop) {sorted(left)} arrived on rank "
                                f"{self.rank} but no action used them; the schedule and the plans disagree")
