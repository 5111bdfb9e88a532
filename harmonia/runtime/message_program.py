"""Every rank's messages of one iteration, in the order its action list reaches them (its *program*).

The executor issues point-to-point messages in one order both ends of each pair derive
(`harmonia.schedule.message_order`); this module lists them from the same data every rank holds:
every rank's action list (`harmonia.schedule.rank_actions.plan_rank_actions`) and every encoder's
boundary plans (one per microbatch, `harmonia.runtime.boundary_plan`). An action expands to its
messages exactly as the executor runs it:

- a stage message (``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` to a peer rank): one message;
- the encoder's boundary send (``SEND_F>llm.s0``): its rows to each destination (hop 0);
- the LLM's boundary receive (``RECV_F<vision.s1``): the rows of hop 0, then the relay inside the node
  (hop 1: its sends, then its receives);
- the LLM's boundary gradient send (``SEND_B>vision.s1``): the relay's partial gradients (hop 1 sends,
  then receives), then the node's sums to the sources (hop 0);
- the encoder's boundary gradient receive (``RECV_B<llm.s0``): hop 0.

Message keys are the same on both ends: ``("stage", direction, module, src chunk, dst chunk,
microbatch, sub, src rank, dst rank)`` and ``("boundary", encoder, microbatch, backward, hop, src
rank, dst rank)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from harmonia.errors import LayoutError, ScheduleError
from harmonia.runtime.boundary_plan import BoundaryPlan, Message, plan_boundary
from harmonia.schedule.actions import Action, Kind
from harmonia.schedule.graph import LLM, IterationSchedule
from harmonia.schedule.layout import Layout
from harmonia.schedule.message_order import MessageOrder, Step, plan_message_order
from harmonia.schedule.rank_actions import plan_rank_actions
from harmonia.schedule.validator import message


def stage_key(a: Action, rank: int) -> tuple:
    """The key of a stage message action on ``rank`` (the same for its send and its receive)."""
    direction, src, dst, m, sub = message(a)
    s, d = (rank, a.peer_rank) if a.kind.is_send else (a.peer_rank, rank)
    return "stage", direction, src.module, src.stage, dst.stage, m, -1 if sub is None else sub, s, d


def boundary_key(encoder: str, microbatch: int, backward: bool, msg: Message) -> tuple:
    """The key of one boundary message (one row run set between two ranks)."""
    return "boundary", encoder, microbatch, backward, msg.hop, msg.src, msg.dst


def boundary_encoder(a: Action) -> str | None:
    """The encoder of a boundary action (None: a stage message or compute)."""
    if a.peer is None or not (a.kind.is_send or a.kind.is_recv):
        return None
    return a.module if a.module != LLM else a.peer.module


def _sends(plan: BoundaryPlan, e: str, m: int, rank: int, backward: bool, hop: int) -> list[Step]:
    return [Step(boundary_key(e, m, backward, msg), True, msg.dst) for msg in plan.sends(rank, backward, hop)]


def _recvs(plan: BoundaryPlan, e: str, m: int, rank: int, backward: bool, hop: int) -> list[Step]:
    return [Step(boundary_key(e, m, backward, msg), False, msg.src) for msg in plan.recvs(rank, backward, hop)]


def boundary_steps(plan: BoundaryPlan, encoder: str, microbatch: int, rank: int, kind: Kind) -> list[Step]:
    """The messages one boundary action of ``rank`` issues, in the order `BoundaryLink` issues them."""
    e, m, r = encoder, microbatch, rank
    if kind is Kind.SEND_F:
        return _sends(plan, e, m, r, False, 0)
    if kind is Kind.RECV_F:
        return _recvs(plan, e, m, r, False, 0) + _sends(plan, e, m, r, False, 1) + _recvs(plan, e, m, r, False, 1)
    if kind is Kind.SEND_B:
        return _sends(plan, e, m, r, True, 1) + _recvs(plan, e, m, r, True, 1) + _sends(plan, e, m, r, True, 0)
    return _recvs(plan, e, m, r, True, 0)


def action_steps(a: Action, rank: int, plans: Mapping[str, Sequence[BoundaryPlan]]) -> list[Step]:
    """The messages one action of ``rank`` issues (none for compute and reductions)."""
    if not (a.kind.is_send or a.kind.is_recv):
        return []
    e = boundary_encoder(a)
    if e is None:
        return [Step(stage_key(a, rank), a.kind.is_send, a.peer_rank)]
    return boundary_steps(plans[e][a.microbatch], e, a.microbatch, rank, a.kind)


def rank_programs(layouts: Mapping[str, Layout], schedule: IterationSchedule,
                  plans: Mapping[str, Sequence[BoundaryPlan]]) -> dict[int, list[Step]]:
    """Every rank's program for one iteration (from every rank's action list and the boundary plans)."""
    out: dict[int, list[Step]] = {}
    for rank, actions in plan_rank_actions(layouts, schedule).items():
        out[rank] = [s for a in actions for s in action_steps(a, rank, plans)]
    return out


def plan_iteration_messages(layouts: Mapping[str, Layout], schedule: IterationSchedule,
                            plans: Mapping[str, Sequence[BoundaryPlan]], rank: int) -> MessageOrder:
    """This rank's message order for one iteration (`harmonia.schedule.message_order`)."""
    return plan_message_order(rank_programs(layouts, schedule, plans), [rank])[rank]


def lone_transfer_programs(plans: Sequence[BoundaryPlan], encoder: str, backward: bool) -> dict[int, list[Step]]:
    """Every rank's program for boundary transfers run on their own, microbatch after microbatch: a
    source sends its rows, a destination takes them, then (``backward``) sends their gradients, and
    the source takes its rows' gradients (what a rank both sends and receives, it does in that order)."""
    out: dict[int, list[Step]] = {}
    for m, plan in enumerate(plans):
        for rank in plan.ranks:
            steps = out.setdefault(rank, [])
            src, dst = rank in plan.src_rows, rank in plan.dst_rows
            kinds = ([Kind.SEND_F] if src else []) + ([Kind.RECV_F] if dst else [])
            if backward:
                kinds += ([Kind.SEND_B] if dst else []) + ([Kind.RECV_B] if src else [])
            for kind in kinds:
                steps += boundary_steps(plan, encoder, m, rank, kind)
    return out


def nominal_boundary_plan(src: Layout, dst: Layout, tokens: int = 2) -> BoundaryPlan:
    """A boundary plan in which every source replica sends rows to every destination rank (one sample
    per pair of DP replicas, its rows dealt over the destination's CP ranks): every pair of ranks that
    some batch's plan could join, for checking a layout's messages before any batch exists."""
    pairs = [(i, j) for i in range(src.dp) for j in range(dst.dp)]
    per_sample = tokens * dst.cp * src.tp  # rows reach every CP rank, from every source TP replica
    item_tokens = [[per_sample] for _ in pairs]
    src_samples = [[s for s, (i, _) in enumerate(pairs) if i == d] for d in range(src.dp)]
    dst_samples = [[s for s, (_, j) in enumerate(pairs) if j == d] for d in range(dst.dp)]
    dst_cp = [[r % dst.cp for r in range(per_sample * len(held))] for held in dst_samples]  # rows dealt over cp
    return plan_boundary(src, dst, item_tokens, src_samples, dst_samples, dst_cp_assign=dst_cp)


def check_layout_messages(layouts: Mapping[str, Layout], schedule: IterationSchedule) -> None:
    """Refuse layouts whose messages cannot be put in one order under ``schedule`` (its action lists
    cannot run), naming the modules and ranks, before any step: every rank's program with nominal
    boundary plans (`nominal_boundary_plan`) goes through `plan_message_order`.

    Raises:
        LayoutError: the layouts' messages cannot be ordered.
    """
    plans = {e: [nominal_boundary_plan(layouts[e], layouts[LLM])] * schedule.n_microbatches
             for e in schedule.graph.encoders}
    try:
        plan_message_order(rank_programs(layouts, schedule, plans))
    except ScheduleError as err:
        where = ", ".join(f"{m} on ranks {list(lay.rank_list())}" for m, lay in sorted(layouts.items()))
        raise LayoutError(f"the plan's messages cannot be put in one order both ends share ({where}): {err}; "
                          "choose another schedule or layout") from err
