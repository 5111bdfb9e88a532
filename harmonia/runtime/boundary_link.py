"""Asynchronous boundary transfers inside a pipeline schedule: a `BoundaryPlan` split into post and wait.

`harmonia.runtime.boundary.boundary_forward` runs a whole transfer at once: every rank of the plan
blocks until its rows have moved. Inside a pipeline schedule that can deadlock: an encoder rank
blocked sending microbatch 3's rows waits for the LLM's first stage, which is itself waiting for
the encoder to receive microbatch 0's gradient. `BoundaryLink` runs the same plans (same messages,
same exact adjoint, see `harmonia.runtime.boundary_plan`) the way the executor's P2P runs stage
messages: receives are posted at the start of the iteration (sizes come from the plan, so there is
no header), sends leave as soon as the rows exist and never block, and a rank waits only when a
compute action needs the rows.

One link per encoder and iteration on every rank of the encoder's last stage or the LLM's first
stage; messages travel on the boundary's own group (`ModuleMeshes.boundary_group`) with tag
``2 * microbatch + backward``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from harmonia.errors import LayoutError, ScheduleError
from harmonia.runtime.boundary_plan import BoundaryPlan, Message

_Inbox = list[tuple[Message, torch.Tensor, "dist.Work | None"]]


def _rows(index: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(index, dtype=torch.long, device=device)


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
        self._inbox: dict[tuple[int, bool], _Inbox] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def post_receives(self) -> None:
        """Post every receive of the iteration (forward rows; gradients when ``backward``)."""
        for m, plan in enumerate(self.plans):
            for bwd in (False, True) if self.backward else (False,):
                box = self._inbox.setdefault((m, bwd), [])
                for msg in plan.recvs(self.rank, bwd):
                    buf = torch.empty(msg.n_rows, self.hidden, dtype=self.dtype, device=self.device)
                    box.append((msg, buf, dist.irecv(buf, msg.src, group=self.group, tag=2 * m + bwd)))

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
        rows = rows.detach().to(self.dtype)
        for msg in plan.sends(self.rank, backward):
            buf = rows.index_select(0, _rows(msg.sender_rows(), rows.device)).contiguous()  # (n, D)
            self._sends.append((dist.isend(buf, msg.dst, group=self.group, tag=2 * microbatch + backward), buf))
        box = self._inbox.setdefault((microbatch, backward), [])
        for msg in plan.local(self.rank, backward):
            box.append((msg, rows.index_select(0, _rows(msg.sender_rows(), rows.device)), None))

    def take(self, microbatch: int, backward: bool = False) -> torch.Tensor:
        """Wait for a microbatch's rows and assemble them.

        Returns:
            ``(dst_rows, D)`` forward (this rank's LLM input rows, ``media.index`` order), or
            ``(src_rows, D)`` backward (the summed gradients of this rank's encoder output rows).
        """
        plan = self.plans[microbatch]
        n = (plan.src_rows if backward else plan.dst_rows).get(self.rank, 0)
        out = torch.zeros(n, self.hidden, dtype=self.dtype, device=self.device)
        for msg, buf, work in self._inbox.pop((microbatch, backward), []):
            if work is not None:
                work.wait()
            out.index_add_(0, _rows(msg.receiver_rows(), out.device), buf)
        return out

    def finish(self) -> None:
        """Wait for every send of the iteration; check every received message was used."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        left = [key for key, box in self._inbox.items() if box]
        self._inbox.clear()
        if left:
            raise ScheduleError(f"boundary rows of (microbatch, backward) {sorted(left)} arrived on rank "
                                f"{self.rank} but no action used them; the schedule and the plans disagree")
