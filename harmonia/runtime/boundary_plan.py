"""Who sends which rows to whom at a module boundary (encoder -> LLM); pure data, no process group.

A boundary moves the encoder outputs of a set of samples — a ragged set of per-item token blocks,
``sum(item_tokens[s])`` rows of width ``D`` for sample ``s`` — from the source layout (the encoder's
last pipeline stage) to the destination layout (the LLM's first pipeline stage).

Rows on each side:

- source DP replica ``d`` holds its samples ``src_samples[d]`` concatenated in that order (items in
  order inside a sample). With source ``cp > 1`` row ``r`` of the replica lives on cp rank
  ``src_cp_assign[d][r]``; each cp rank holds its rows in replica order. Every source TP rank of a
  ``(dp, cp)`` position holds the same rows (replicated output).
- destination DP replica ``d`` receives ``dst_samples[d]`` concatenated in that order; with
  destination ``cp > 1`` row ``r`` goes to cp rank ``dst_cp_assign[d][r]`` (any assignment, e.g. the
  CP token shard of ``media.index``). Every destination TP rank receives its ``(dp, cp)`` rows.

Forward: each destination rank reads each row from one source TP replica (itself when colocated,
else spread over the replicas). Backward, the exact adjoint under the usual TP conventions:

- every source TP replica receives the whole gradient of its rows (their outputs came out of a TP
  all-reduce, whose adjoint copies the gradient to every replica);
- ``dst_tp_grads="replicated"``: destination TP ranks hold identical, already reduced gradients, so
  one copy is taken per source replica (never a sum of replicas);
  ``dst_tp_grads="partial"``: each destination TP rank holds a partial gradient; they are summed.

Messages carry row runs ``(sender_row, receiver_row, n)`` in each side's local row numbering. Every
rank computes the same plan from the same inputs, so sizes are known on both ends and nothing is
padded (gloo's all_gather takes no uneven sizes: the plan is executed with point-to-point transfers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from harmonia.errors import LayoutError, SampleError
from harmonia.plan.layout import Layout

Run = tuple[int, int, int]  # (sender_row, receiver_row, n_rows)
TP_GRADS = ("replicated", "partial")


@dataclass(frozen=True)
class Message:
    """Rows one rank sends to another (``src == dst``: a local copy).

    Attributes:
        src: sending global rank.
        dst: receiving global rank.
        runs: ``(sender_row, receiver_row, n)``: sender rows ``sender_row .. +n`` land on receiver rows
            ``receiver_row .. +n``; the message data is the runs' rows concatenated in this order.
    """

    src: int
    dst: int
    runs: tuple[Run, ...]

    @property
    def n_rows(self) -> int:
        return sum(n for _, _, n in self.runs)

    def sender_rows(self) -> list[int]:
        """Sender-local row indices, in message order."""
        return [r for s, _, n in self.runs for r in range(s, s + n)]

    def receiver_rows(self) -> list[int]:
        """Receiver-local row indices, in message order."""
        return [r for _, d, n in self.runs for r in range(d, d + n)]


@dataclass(frozen=True)
class BoundaryPlan:
    """Every rank's part in one boundary transfer, forward and backward.

    Attributes:
        forward: messages source rank -> destination rank (rows of encoder outputs).
        backward: messages destination rank -> source rank (rows of gradients).
        src_rows: source rank -> rows it holds (every TP rank of the source's last stage).
        dst_rows: destination rank -> rows it receives (every rank of the destination's first stage).
        dst_tp_grads: ``replicated`` (one copy) or ``partial`` (sum) over destination TP ranks.
        ranks: every rank taking part (source last stage and destination first stage), sorted; each
            of them calls the transfer, in the same order as its peers.
    """

    forward: tuple[Message, ...]
    backward: tuple[Message, ...]
    src_rows: dict[int, int]
    dst_rows: dict[int, int]
    dst_tp_grads: str = "replicated"
    ranks: tuple[int, ...] = field(default=())

    def sends(self, rank: int, backward: bool = False) -> list[Message]:
        """Messages ``rank`` sends to other ranks."""
        return [m for m in (self.backward if backward else self.forward) if m.src == rank != m.dst]

    def recvs(self, rank: int, backward: bool = False) -> list[Message]:
        """Messages ``rank`` receives from other ranks."""
        return [m for m in (self.backward if backward else self.forward) if m.dst == rank != m.src]

    def local(self, rank: int, backward: bool = False) -> list[Message]:
        """Copies within ``rank`` (colocated source and destination)."""
        return [m for m in (self.backward if backward else self.forward) if m.dst == rank == m.src]

    def bytes_per_rank(self, row_bytes: int, backward: bool = False) -> dict[int, tuple[int, int]]:
        """``rank -> (bytes sent, bytes received)`` over the network (local copies excluded)."""
        out = {r: [0, 0] for r in self.ranks}
        for m in self.backward if backward else self.forward:
            if m.src != m.dst:
                out[m.src][0] += m.n_rows * row_bytes
                out[m.dst][1] += m.n_rows * row_bytes
        return {r: (s, v) for r, (s, v) in out.items()}


@dataclass(frozen=True)
class _Span:
    """Global rows ``start .. start + n`` held at ``(dp, cp)``, local rows from ``local``."""

    start: int
    n: int
    dp: int
    cp: int
    local: int


def _cp_runs(side: str, d: int, n_rows: int, cp: int, assign: Sequence[int] | np.ndarray | None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of one cp rank over a replica's rows: ``(first_row, n, cp_rank)``, each (n_runs,).

    ``assign`` None is the contiguous front-heavy split of ``n_rows`` over ``cp`` ranks.
    """
    if assign is None:
        base, extra = divmod(n_rows, cp)
        lens = np.array([base + (c < extra) for c in range(cp)], dtype=np.int64)  # (cp,)
        vals = np.flatnonzero(lens)
        lens = lens[vals]
        return np.cumsum(lens) - lens, lens, vals
    a = np.asarray(assign)
    if a.ndim != 1 or a.shape[0] != n_rows or (a.size and (not np.issubdtype(a.dtype, np.integer)
                                                          or a.min() < 0 or a.max() >= cp)):
        raise LayoutError(f"{side}: cp assignment of DP replica {d} must give an integer cp rank in "
                          f"0..{cp - 1} for each of its {n_rows} rows (got shape {a.shape}, dtype {a.dtype})")
    a = a.astype(np.int64, copy=False)  # (n_rows,)
    firsts = np.flatnonzero(np.r_[True, a[1:] != a[:-1]]) if n_rows else np.zeros(0, dtype=np.int64)
    lens = np.diff(np.r_[firsts, n_rows])
    return firsts, lens, a[firsts]


def _spans(side: str, layout: Layout, samples: Sequence[Sequence[int]], rows: list[int],
           starts: list[int], assign: Sequence[Sequence[int] | np.ndarray | None] | None) -> list[_Span]:
    """Where each global row lives on one side, as spans sorted by global row.

    Vectorised over rows: a span is one piece of a cp run inside one sample, so the cost grows with
    the number of samples and cp runs, not with the number of rows.
    """
    if len(samples) != layout.dp:
        raise LayoutError(f"{side}: {len(samples)} sample lists for dp={layout.dp}; give one (possibly "
                          "empty) list of sample indices per DP replica")
    if assign is not None and len(assign) != layout.dp:
        raise LayoutError(f"{side}: cp assignment has {len(assign)} entries for dp={layout.dp}; give one "
                          "per DP replica")
    rows_np, starts_np = np.asarray(rows, dtype=np.int64), np.asarray(starts, dtype=np.int64)
    spans: list[_Span] = []
    for d, replica in enumerate(samples):
        rep = np.asarray(replica, dtype=np.int64)
        seg_n = rows_np[rep]  # (n_samples,) rows of each sample, in replica order
        n_rows = int(seg_n.sum())
        firsts, lens, vals = _cp_runs(side, d, n_rows, layout.cp, None if assign is None else assign[d])
        if n_rows == 0:
            continue
        run_local = np.empty_like(lens)  # (n_runs,) cp-local row of each run's first row
        for c in range(layout.cp):
            mine = vals == c
            run_local[mine] = np.cumsum(lens[mine]) - lens[mine]
        keep = seg_n > 0
        seg_first = (np.cumsum(seg_n) - seg_n)[keep]  # replica row of each sample's first row
        seg_global = starts_np[rep][keep]
        lo = np.union1d(firsts, seg_first)  # (n_pieces,) each piece: one cp run inside one sample
        n = np.diff(np.r_[lo, n_rows])
        ri = np.searchsorted(firsts, lo, side="right") - 1
        si = np.searchsorted(seg_first, lo, side="right") - 1
        g, local, cps = seg_global[si] + lo - seg_first[si], run_local[ri] + lo - firsts[ri], vals[ri]
        spans += [_Span(*v) for v in zip(g.tolist(), n.tolist(), [d] * len(lo), cps.tolist(), local.tolist())]
    return sorted(spans, key=lambda s: s.start)


def _add(box: dict[tuple[int, int], list[Run]], src: int, dst: int, run: Run) -> None:
    """Append a run to the (src, dst) message, merging it with the previous run when contiguous."""
    runs = box.setdefault((src, dst), [])
    if runs:
        s, d, n = runs[-1]
        if s + n == run[0] and d + n == run[1]:
            runs[-1] = (s, d, n + run[2])
            return
    runs.append(run)


def plan_boundary(src: Layout, dst: Layout, item_tokens: Sequence[Sequence[int]],
                  src_samples: Sequence[Sequence[int]], dst_samples: Sequence[Sequence[int]],
                  dst_cp_assign: Sequence[Sequence[int] | None] | None = None,
                  src_cp_assign: Sequence[Sequence[int] | None] | None = None,
                  dst_tp_grads: str = "replicated") -> BoundaryPlan:
    """Plan one boundary transfer (see the module docstring for the row conventions).

    Args:
        src: source module layout; its last pipeline stage holds the rows.
        dst: destination module layout; its first pipeline stage receives them.
        item_tokens: ``item_tokens[s]`` = token count of each item of sample ``s`` (for this encoder).
        src_samples: per source DP replica, the sample indices it holds, in row order.
        dst_samples: per destination DP replica, the sample indices it receives, in row order.
        dst_cp_assign: per destination DP replica, the cp rank of each of its rows (None: contiguous).
        src_cp_assign: per source DP replica, the cp rank of each of its rows (None: contiguous).
        dst_tp_grads: ``replicated`` or ``partial`` (see the module docstring).

    Returns:
        The plan: forward and backward messages of every rank.

    Raises:
        SampleError: a token count is negative or a sample is not held exactly once on each side.
        LayoutError: sample lists or cp assignments do not match the layouts.
    """
    if dst_tp_grads not in TP_GRADS:
        raise LayoutError(f"dst_tp_grads={dst_tp_grads!r} unknown; expected one of {TP_GRADS}")
    rows = []
    for s, items in enumerate(item_tokens):
        if any(int(n) < 0 for n in items):
            raise SampleError(f"sample {s} has a negative item token count {list(items)}; counts are >= 0")
        rows.append(sum(int(n) for n in items))
    for side, samples in (("source", src_samples), ("destination", dst_samples)):
        held = sorted(s for replica in samples for s in replica)
        if held != list(range(len(rows))):
            raise SampleError(f"{side} DP replicas hold samples {held}, but the boundary carries samples "
                              f"0..{len(rows) - 1}: every sample must be held by exactly one replica")
    starts = [0] * len(rows)
    for s in range(1, len(rows)):
        starts[s] = starts[s - 1] + rows[s - 1]
    a = _spans("source", src, src_samples, rows, starts, src_cp_assign)
    b = _spans("destination", dst, dst_samples, rows, starts, dst_cp_assign)

    fwd: dict[tuple[int, int], list[Run]] = {}
    bwd: dict[tuple[int, int], list[Run]] = {}
    src_stage, i, j = src.pp - 1, 0, 0
    while i < len(a) and j < len(b):  # merge the two span lists over the global row space
        sa, sb = a[i], b[j]
        lo, hi = max(sa.start, sb.start), min(sa.start + sa.n, sb.start + sb.n)
        if lo < hi:
            n, a_row, b_row = hi - lo, sa.local + lo - sa.start, sb.local + lo - sb.start
            senders = [src.rank_at(src_stage, sa.dp, sa.cp, t) for t in range(src.tp)]
            receivers = [dst.rank_at(0, sb.dp, sb.cp, t) for t in range(dst.tp)]
            for t, rank in enumerate(receivers):
                pick = rank if rank in senders else senders[((sb.dp * dst.cp + sb.cp) * dst.tp + t) % src.tp]
                _add(fwd, pick, rank, (a_row, b_row, n))
            for t, rank in enumerate(senders):
                if dst_tp_grads == "partial":
                    for producer in receivers:
                        _add(bwd, producer, rank, (b_row, a_row, n))
                else:
                    pick = rank if rank in receivers else receivers[
                        ((sa.dp * src.cp + sa.cp) * src.tp + t) % dst.tp]
                    _add(bwd, pick, rank, (b_row, a_row, n))
        if sa.start + sa.n <= sb.start + sb.n:
            i += 1
        else:
            j += 1

    src_rows = _rows_per_rank(src, src_stage, a)
    dst_rows = _rows_per_rank(dst, 0, b)
    ranks = tuple(sorted(set(src_rows) | set(dst_rows)))
    return BoundaryPlan(
        forward=tuple(Message(s, d, tuple(r)) for (s, d), r in sorted(fwd.items())),
        backward=tuple(Message(s, d, tuple(r)) for (s, d), r in sorted(bwd.items())),
        src_rows=src_rows, dst_rows=dst_rows, dst_tp_grads=dst_tp_grads, ranks=ranks)


def _rows_per_rank(layout: Layout, stage: int, spans: list[_Span]) -> dict[int, int]:
    """Rows held by every rank of one stage (0 for ranks that hold none)."""
    count: dict[tuple[int, int], int] = {}
    for s in spans:
        count[s.dp, s.cp] = count.get((s.dp, s.cp), 0) + s.n
    return {layout.rank_at(stage, d, c, t): count.get((d, c), 0)
            for d in range(layout.dp) for c in range(layout.cp) for t in range(layout.tp)}
