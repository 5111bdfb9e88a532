"""Execute a `BoundaryPlan`: move encoder outputs to the LLM's layout and route gradients back exactly.

The transfer is an autograd Function. Forward, every rank posts all its sends and receives of the
plan at once (``batch_isend_irecv``; sizes come from the plan, so nothing is padded) and copies the
rows it both holds and needs locally. Backward runs the plan's backward messages the same way and
writes the arriving gradients into the source rows (a sum where several destination ranks own
partial gradients, exactly one copy per row otherwise). Rows move as slices of the plan's row runs,
never through index tensors.

Who calls what, for one transfer (one microbatch of one encoder -> LLM edge):

- every rank of ``plan.ranks`` calls `boundary_forward`, in the same order as its peers (the
  transfer is collective over those ranks);
- source ranks pass their rows ``x`` ``(src_rows, D)``, the graph of the encoder attached; other ranks
  pass ``None``;
- destination ranks get ``(dst_rows, D)`` and use it as the LLM input rows (``media.index`` order, CP
  shard when the plan was made with one); other ranks get an empty ``(0, D)`` tensor;
- backward: where the output feeds the loss, autograd runs the transfer's backward; a rank whose
  output feeds no loss (a source-only rank) calls `boundary_backward` on it when its schedule says.

Messages of one transfer use ``tag``; give concurrent transfers on the same group distinct tags.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harmonia.errors import LayoutError
from harmonia.runtime.boundary_plan import BoundaryPlan, Message


def _payload(data: torch.Tensor, m: Message) -> torch.Tensor:
    """``(n_rows, *F)`` rows a message carries, read from the sender's rows (a view for one run)."""
    if len(m.runs) == 1:
        s, _, n = m.runs[0]
        return data[s:s + n]
    return torch.cat([data[s:s + n] for s, _, n in m.runs])


def _place(out: torch.Tensor, rows: torch.Tensor, m: Message, sender_side: bool, accumulate: bool) -> None:
    """Write a message's rows into ``out`` run by run (slice copies; sums where ``accumulate``).

    ``rows`` is the sender's whole row tensor when ``sender_side`` (a local copy), else the message
    data (the runs' rows concatenated).
    """
    at = 0
    for s, d, n in m.runs:
        src = rows[s:s + n] if sender_side else rows[at:at + n]
        if accumulate:
            out[d:d + n].add_(src)
        else:
            out[d:d + n].copy_(src)
        at += n


def _phase(plan: BoundaryPlan, rank: int, hop: int, backward: bool, data: torch.Tensor, out: torch.Tensor,
           accumulate: bool, group: dist.ProcessGroup | None, tag: int) -> None:
    """Post one hop's sends (rows of ``data``) and receives (into ``out``), copy local rows, wait."""
    ops: list[dist.P2POp] = []
    inbox: list[tuple[Message, torch.Tensor]] = []
    for m in plan.recvs(rank, backward, hop):
        if len(m.runs) == 1 and not accumulate:  # straight into its rows
            _, d, n = m.runs[0]
            ops.append(dist.P2POp(dist.irecv, out[d:d + n], m.src, group, tag))
            continue
        buf = torch.empty(m.n_rows, *out.shape[1:], dtype=out.dtype, device=out.device)  # (rows, *F)
        ops.append(dist.P2POp(dist.irecv, buf, m.src, group, tag))
        inbox.append((m, buf))
    for m in plan.sends(rank, backward, hop):
        ops.append(dist.P2POp(dist.isend, _payload(data, m), m.dst, group, tag))
    works = dist.batch_isend_irecv(ops) if ops else []
    for m in plan.local(rank, backward, hop):  # overlaps the transfers
        _place(out, data, m, sender_side=True, accumulate=accumulate)
    for work in works:
        work.wait()
    for m, buf in inbox:
        _place(out, buf, m, sender_side=False, accumulate=accumulate)


def exchange(plan: BoundaryPlan, rank: int, data: torch.Tensor, n_out: int, backward: bool,
             group: dist.ProcessGroup | None = None, tag: int = 0) -> torch.Tensor:
    """Run one direction of a plan on this rank (no autograd).

    Rows move as slices of the plan's runs: a one-run message is sent from a view of ``data`` and
    received straight into its rows of the output. Forward every output row is written exactly once,
    so the output starts uninitialised; backward sums only with ``partial`` TP gradients (several
    destination TP ranks each own part of a row's gradient), else each row arrives exactly once.
    A plan that relays inside nodes runs in two hops: forward, hop 1 forwards rows received at hop 0;
    backward, hop 1 first gathers the peers' partial gradients, which hop 0 then sends on, summed.

    Args:
        plan: the boundary plan.
        rank: this process's global rank.
        data: ``(n_in, *F)`` rows this rank holds (source rows forward, gradient rows backward).
        n_out: rows this rank ends up with (``dst_rows`` forward, ``src_rows`` backward).
        backward: run the backward messages instead of the forward ones.
        group: process group holding every rank of the plan (None = default group); ranks are global.
        tag: tag of every message of this call.

    Returns:
        ``(n_out, *F)`` rows: received and local rows (forward), or gradients (backward).
    """
    data = data.contiguous()
    accumulate = backward and plan.dst_tp_grads == "partial"
    make = torch.zeros if accumulate else torch.empty
    out = make(n_out, *data.shape[1:], dtype=data.dtype, device=data.device)  # (n_out, *F)
    if not backward:
        _phase(plan, rank, 0, False, data, out, False, group, tag)
        if plan.sends(rank, False, 1) or plan.recvs(rank, False, 1):
            _phase(plan, rank, 1, False, out, out, False, group, tag)
        return out
    if plan.recvs(rank, True, 1):  # relay: this rank's gradient plus its peers' parts
        summed = data.clone()
        _phase(plan, rank, 1, True, data, summed, True, group, tag)
        data = summed
    elif plan.sends(rank, True, 1):
        _phase(plan, rank, 1, True, data, data, True, group, tag)
    _phase(plan, rank, 0, True, data, out, accumulate, group, tag)
    return out


class _Boundary(torch.autograd.Function):
    """Autograd node of one transfer: forward = plan forward, backward = plan backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: BoundaryPlan, rank: int,
                group: dist.ProcessGroup | None, tag: int) -> torch.Tensor:
        ctx.plan, ctx.rank, ctx.group, ctx.tag, ctx.n_in = plan, rank, group, tag, x.shape[0]
        return exchange(plan, rank, x.detach(), plan.dst_rows.get(rank, 0), False, group, tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dx = exchange(ctx.plan, ctx.rank, grad.contiguous(), ctx.n_in, True, ctx.group, ctx.tag)
        return dx, None, None, None, None


def boundary_forward(plan: BoundaryPlan, rank: int, x: torch.Tensor | None, hidden: int,
                     group: dist.ProcessGroup | None = None, tag: int = 0,
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     requires_grad: bool = True) -> torch.Tensor:
    """Move one transfer's rows to the destination layout; differentiable (see the module docstring).

    Args:
        plan: the transfer's plan (`plan_boundary`), the same on every rank.
        rank: this process's global rank.
        x: ``(src_rows, hidden)`` this rank's source rows, or None on ranks that are not sources.
        hidden: row width ``D`` (the LLM hidden size).
        group: process group over ``plan.ranks`` or a superset (`ModuleMeshes.boundary_group`).
        tag: message tag of this transfer.
        dtype: dtype of the rows (used where ``x`` is None).
        device: device of the rows (used where ``x`` is None).
        requires_grad: the transfer has a backward. Give the same value on every rank: False when
            nothing upstream of the boundary trains (frozen encoder and projector), so no rank waits
            for gradients.

    Returns:
        ``(dst_rows, hidden)`` on destination ranks, ``(0, hidden)`` elsewhere; its gradient flows back
        to ``x`` on every source rank (every source TP replica gets the whole gradient of its rows).

    Raises:
        LayoutError: ``x`` does not have the rows the plan gives this rank.
    """
    n_src = plan.src_rows.get(rank)
    if n_src is None and x is not None and x.shape[0] > 0:
        raise LayoutError(f"rank {rank} is not a source of this boundary but passed {x.shape[0]} rows; "
                          "pass None on ranks outside the source module's last stage")
    if n_src is not None and (x is None or tuple(x.shape) != (n_src, hidden)):
        got = None if x is None else tuple(x.shape)
        raise LayoutError(f"rank {rank} is a boundary source holding {n_src} rows of width {hidden}, but "
                          f"passed {got}; pass the encoder output rows of its samples, in plan order")
    if x is None or n_src is None:
        x = torch.zeros(0, hidden, dtype=dtype, device=device)
    if not requires_grad:
        return exchange(plan, rank, x.detach(), plan.dst_rows.get(rank, 0), False, group, tag)
    if not x.requires_grad:
        # Every rank joins the graph (an empty leaf on non-sources), so the backward runs on all of them.
        x = x.detach().requires_grad_()
    return _Boundary.apply(x, plan, rank, group, tag)


def boundary_backward(out: torch.Tensor) -> None:
    """Run the transfer's backward on a rank whose output feeds no loss (e.g. a source-only rank)."""
    torch.autograd.backward(out, torch.zeros_like(out))
