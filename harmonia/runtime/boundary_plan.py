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

Relay across nodes (``gpus_per_node`` given): where a row is needed by several destination TP ranks of
a node and no source rank of that node holds it, it enters the node once. The destination rows of
each ``(dp, cp)`` position are cut into as many contiguous chunks as the node has receivers; each
receiver takes one chunk from a source (hop 0) and forwards it to its TP peers on the node (hop 1,
same row numbers: TP peers hold the same rows), like Megatron-LM's bridge broadcasting inside the
node, but with the crossing rows spread over the node's ranks. Every rank still receives exactly its
rows, and the rows entering each node are the lower bound (rows some rank of the node needs that no
rank of it holds). Backward, ``replicated`` gradients need no relay (each source replica takes one copy
from one destination rank, on its own node where there is one); ``partial`` gradients run the relay
in reverse: the peers send their parts to the chunk's receiver (hop 1), which adds them to its own and
sends the node's sum to every source replica (hop 0).

Messages carry row runs ``(sender_row, receiver_row, n)`` in each side's local row numbering. Every
rank computes the same plan from the same inputs, so sizes are known on both ends and nothing is
padded (gloo's all_gather takes no uneven sizes: the plan is executed with point-to-point transfers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from harmonia.errors import LayoutError, SampleError
from harmonia.schedule.layout import Layout

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
        hop: 0 = from the rows the sender holds (forward: source rows; backward: its gradient rows
            plus the hop 1 parts it received). 1 = a relay inside a node between destination TP peers
            (forward: rows the sender received at hop 0; backward: a partial gradient sent to the
            chunk's receiver). Forward runs hop 0 then hop 1; backward hop 1 then hop 0.
    """

    src: int
    dst: int
    runs: tuple[Run, ...]
    hop: int = 0

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
        gpus_per_node: ranks per node the plan relays for (``rank // gpus_per_node`` is the node);
            None = no relay.
    """

    forward: tuple[Message, ...]
    backward: tuple[Message, ...]
    src_rows: dict[int, int]
    dst_rows: dict[int, int]
    dst_tp_grads: str = "replicated"
    ranks: tuple[int, ...] = field(default=())
    gpus_per_node: int | None = None

    def _of(self, backward: bool, hop: int | None) -> list[Message]:
        return [m for m in (self.backward if backward else self.forward) if hop is None or m.hop == hop]

    @property
    def relays(self) -> bool:
        """Some rows travel in two hops (a relay inside a destination node)."""
        return any(m.hop for m in (*self.forward, *self.backward))

    def sends(self, rank: int, backward: bool = False, hop: int | None = None) -> list[Message]:
        """Messages ``rank`` sends to other ranks (of one hop, or all)."""
        return [m for m in self._of(backward, hop) if m.src == rank != m.dst]

    def recvs(self, rank: int, backward: bool = False, hop: int | None = None) -> list[Message]:
        """Messages ``rank`` receives from other ranks (of one hop, or all)."""
        return [m for m in self._of(backward, hop) if m.dst == rank != m.src]

    def local(self, rank: int, backward: bool = False, hop: int | None = None) -> list[Message]:
        """Copies within ``rank`` (colocated source and destination)."""
        return [m for m in self._of(backward, hop) if m.dst == rank == m.src]

    def bytes_per_rank(self, row_bytes: int, backward: bool = False) -> dict[int, tuple[int, int]]:
        """``rank -> (bytes sent, bytes received)`` over the network (local copies excluded)."""
        out = {r: [0, 0] for r in self.ranks}
        for m in self.backward if backward else self.forward:
            if m.src != m.dst:
                out[m.src][0] += m.n_rows * row_bytes
                out[m.dst][1] += m.n_rows * row_bytes
        return {r: (s, v) for r, (s, v) in out.items()}

    def node_bytes(self, row_bytes: int, backward: bool = False,
                   gpus_per_node: int | None = None) -> dict[int, tuple[int, int]]:
        """``node -> (bytes leaving, bytes entering)`` across nodes, for nodes with traffic.

        Args:
            row_bytes: bytes of one row.
            backward: count the backward messages.
            gpus_per_node: ranks per node (default: the plan's).

        Raises:
            LayoutError: neither the plan nor the call gives ``gpus_per_node``.
        """
        per = gpus_per_node or self.gpus_per_node
        if not per:
            raise LayoutError("node_bytes needs the ranks per node: plan with gpus_per_node or pass it here")
        out: dict[int, list[int]] = {}
        for m in self.backward if backward else self.forward:
            a, b = m.src // per, m.dst // per
            if a != b:
                out.setdefault(a, [0, 0])[0] += m.n_rows * row_bytes
                out.setdefault(b, [0, 0])[1] += m.n_rows * row_bytes
        return {k: (x, y) for k, (x, y) in sorted(out.items())}


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
    spans: list[_Span] = []
    if layout.cp == 1 and assign is None:  # one piece per sample with rows, in replica order (no numpy: a
        for d, replica in enumerate(samples):  # step's few samples cost less in plain Python)
            at = 0
            for s in replica:
                if rows[s]:
                    spans.append(_Span(starts[s], rows[s], d, 0, at))
                    at += rows[s]
        return sorted(spans, key=lambda s: s.start)
    rows_np, starts_np = np.asarray(rows, dtype=np.int64), np.asarray(starts, dtype=np.int64)
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


Box = dict[tuple[int, int, int], list[Run]]  # (hop, src, dst) -> runs


def _add(box: Box, src: int, dst: int, run: Run, hop: int = 0) -> None:
    """Append a run to the (src, dst) message of a hop, merging it with the previous run when contiguous."""
    if run[2] == 0:
        return
    runs = box.setdefault((hop, src, dst), [])
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
                  dst_tp_grads: str = "replicated", gpus_per_node: int | None = None) -> BoundaryPlan:
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
        gpus_per_node: ranks per node (``rank // gpus_per_node`` is the node): relay rows that several
            destination TP ranks of a node need through that node (see the module docstring). None:
            every destination rank receives straight from a source.

    Returns:
        The plan: forward and backward messages of every rank.

    Raises:
        SampleError: a token count is negative or a sample is not held exactly once on each side.
        LayoutError: sample lists or cp assignments do not match the layouts.
    """
    if dst_tp_grads not in TP_GRADS:
        raise LayoutError(f"dst_tp_grads={dst_tp_grads!r} unknown; expected one of {TP_GRADS}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise LayoutError(f"gpus_per_node={gpus_per_node} must be >= 1 (or None for no relay)")
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

    def node(rank: int) -> int:
        return rank // gpus_per_node if gpus_per_node else 0

    position_rows: dict[tuple[int, int], int] = {}  # destination (dp, cp) -> its rows
    for sp in b:
        position_rows[sp.dp, sp.cp] = position_rows.get((sp.dp, sp.cp), 0) + sp.n
    fwd: Box = {}
    bwd: Box = {}
    partial = dst_tp_grads == "partial"
    src_stage, i, j = src.pp - 1, 0, 0
    while i < len(a) and j < len(b):  # merge the two span lists over the global row space
        sa, sb = a[i], b[j]
        lo, hi = max(sa.start, sb.start), min(sa.start + sa.n, sb.start + sb.n)
        if lo < hi:
            n, a_row, b_row = hi - lo, sa.local + lo - sa.start, sb.local + lo - sb.start
            senders = [src.rank_at(src_stage, sa.dp, sa.cp, t) for t in range(src.tp)]
            receivers = [dst.rank_at(0, sb.dp, sb.cp, t) for t in range(dst.tp)]
            pos = sb.dp * dst.cp + sb.cp
            producers: list[tuple[int, Run]] = []  # partial backward: (rank, run) sent to every sender
            for g in dict.fromkeys(node(r) for r in receivers):
                members = [(t, r) for t, r in enumerate(receivers) if node(r) == g]
                near = [s for s in senders if node(s) == g]
                if near or len(members) == 1:  # straight from a source (on this node where one is)
                    pool = near or senders
                    for t, rank in members:
                        pick = rank if rank in senders else pool[(pos * dst.tp + t) % len(pool)]
                        _add(fwd, pick, rank, (a_row, b_row, n))
                        producers.append((rank, (b_row, a_row, n)))
                    continue
                total, k = position_rows[sb.dp, sb.cp], len(members)
                for c, (t, head) in enumerate(members):  # chunk c of the position's rows enters via head
                    c_lo = max(b_row, -(-c * total // k))
                    c_hi = min(b_row + n, -(-(c + 1) * total // k))
                    if c_lo >= c_hi:
                        continue
                    run = (a_row + c_lo - b_row, c_lo, c_hi - c_lo)
                    _add(fwd, senders[(pos * dst.tp + t) % src.tp], head, run)
                    producers.append((head, (c_lo, run[0], run[2])))
                    for _, peer in members:
                        if peer != head:
                            _add(fwd, head, peer, (c_lo, c_lo, run[2]), hop=1)
                            if partial:
                                _add(bwd, peer, head, (c_lo, c_lo, run[2]), hop=1)
            for t, rank in enumerate(senders):
                if partial:
                    for producer, run in producers:
                        _add(bwd, producer, rank, run)
                else:
                    pool = [r for r in receivers if node(r) == node(rank)] or receivers
                    pick = rank if rank in receivers else pool[((sa.dp * src.cp + sa.cp) * src.tp + t) % len(pool)]
                    _add(bwd, pick, rank, (b_row, a_row, n))
        if sa.start + sa.n <= sb.start + sb.n:
            i += 1
        else:
            j += 1

    src_rows = _rows_per_rank(src, src_stage, a)
    dst_rows = _rows_per_rank(dst, 0, b)
    ranks = tuple(sorted(set(src_rows) | set(dst_rows)))
    return BoundaryPlan(
        forward=tuple(Message(s, d, tuple(r), h) for (h, s, d), r in sorted(fwd.items())),
        backward=tuple(Message(s, d, tuple(r), h) for (h, s, d), r in sorted(bwd.items())),
        src_rows=src_rows, dst_rows=dst_rows, dst_tp_grads=dst_tp_grads, ranks=ranks,
        gpus_per_node=gpus_per_node)


def _rows_per_rank(layout: Layout, stage: int, spans: list[_Span]) -> dict[int, int]:
    """Rows held by every rank of one stage (0 for ranks that hold none)."""
    count: dict[tuple[int, int], int] = {}
    for s in spans:
        count[s.dp, s.cp] = count.get((s.dp, s.cp), 0) + s.n
    return {layout.rank_at(stage, d, c, t): count.get((d, c), 0)
            for d in range(layout.dp) for c in range(layout.cp) for t in range(layout.tp)}
