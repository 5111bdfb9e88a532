"""`replay_nccl` on hand-written event lists: what NCCL hangs on, mismatches, and what passes."""

from __future__ import annotations

import time

import pytest

from harmonia.errors import ScheduleError, TraceError
from harmonia.sim.nccl_replay import (Collective, Issue, P2POp, Wait, from_json, read_record_dir,
                                      replay_dir, replay_nccl, to_json)

G2 = (0, 1)
G3 = (0, 1, 2)


def send(peer: int, numel: int = 4, dtype: str = "float32", group: tuple[int, ...] = G2) -> P2POp:
    return P2POp(group, peer, True, numel, dtype)


def recv(peer: int, numel: int = 4, dtype: str = "float32", group: tuple[int, ...] = G2) -> P2POp:
    return P2POp(group, peer, False, numel, dtype)


def one(op: P2POp) -> Issue:
    return Issue((op,), batched=False)


def batch(*ops: P2POp) -> Issue:
    return Issue(ops, batched=True)


def test_both_send_first_unbatched_deadlocks() -> None:
    events = {0: [one(send(1)), one(recv(1))], 1: [one(send(0)), one(recv(0))]}
    with pytest.raises(ScheduleError, match=r"(?s)deadlock under NCCL's rules.*rank 0: send #0 to rank 1"
                       r".*posted; rank 1's matching recv #0 is not posted: queued behind its send #0"):
        replay_nccl(events)


def test_both_send_first_in_one_batch_passes() -> None:
    events = {0: [batch(send(1), recv(1)), Wait(0), Wait(1)],
              1: [batch(send(0), recv(0)), Wait(0), Wait(1)]}
    report = replay_nccl(events)
    assert (report.p2p_ops, report.batched_ops, report.batches) == (4, 4, 2)
    assert str(report) == "2 ranks, 4 p2p ops (4 batched), 0 collectives: no deadlock, sizes match"


def test_both_receive_first_deadlocks() -> None:
    events = {0: [one(recv(1)), one(send(1))], 1: [one(recv(0)), one(send(0))]}
    with pytest.raises(ScheduleError, match=r"(?s)deadlock.*rank 0: recv #0 from rank 1.*rank 1: recv #0"):
        replay_nccl(events)


def test_send_meeting_receive_passes() -> None:
    events = {0: [one(send(1)), one(recv(1)), Wait(1)], 1: [one(recv(0)), Wait(0), one(send(0))]}
    report = replay_nccl(events)
    assert (report.ranks, report.p2p_ops, report.batched_ops, report.max_in_flight) == (2, 4, 0, 1)


@pytest.mark.parametrize("field, first, second, shown", [
    ("numel", 8, 4, "8 x float32.*4 x float32"),
    ("dtype", "float32", "bfloat16", "4 x float32.*4 x bfloat16"),
])
def test_fifo_order_pairs_a_size_or_dtype_mismatch(field, first, second, shown) -> None:
    """Rank 0 sends A then B; rank 1 receives B's buffer first. Tags would pair them; NCCL does not."""
    a, b = {field: first}, {field: second}
    events = {0: [batch(send(1, **a), send(1, **b))], 1: [batch(recv(0, **b), recv(0, **a))]}
    with pytest.raises(ScheduleError, match=rf"(?s)p2p size mismatch on group \(0, 1\), message #0 from "
                       rf"rank 0 to rank 1.*rank 0's send #0 is {shown}"):
        replay_nccl(events)


def test_count_mismatch() -> None:
    events = {0: [one(send(1)), one(send(1))], 1: [one(recv(0))]}
    with pytest.raises(ScheduleError, match="rank 0 sends 2 messages to rank 1, rank 1 receives 1"):
        replay_nccl(events)


def test_a_peer_without_record_is_named() -> None:
    with pytest.raises(ScheduleError, match="rank 1 has no record"):
        replay_nccl({0: [one(send(1))]})


def ring_through_waits(first_sender: int | None) -> dict[int, list]:
    """Rank r receives from r-1 and sends to r+1 (mod 3); each waits for its receive before sending,
    but ``first_sender`` sends first."""
    events = {}
    for r in range(3):
        nxt, prev = (r + 1) % 3, (r - 1) % 3
        to, frm = one(send(nxt, group=G3)), one(recv(prev, group=G3))
        events[r] = [to, frm, Wait(1)] if r == first_sender else [frm, Wait(0), to]
    return events


def test_a_cycle_through_waits_deadlocks() -> None:
    with pytest.raises(ScheduleError, match=r"(?s)deadlock.*rank 0: recv #0 from rank 2.*posted; rank 2's "
                       r"matching send #0 is not posted: rank 2 first waits for its recv #0 from rank 1"):
        replay_nccl(ring_through_waits(None))


def test_a_cycle_with_one_rank_sending_first_passes() -> None:
    assert replay_nccl(ring_through_waits(0)).p2p_ops == 6


def test_group_streams_catch_what_pair_streams_allow() -> None:
    """Rank 0 receives from 1 then sends to 2 on one group; 2 waits for 0's message before sending
    to 1, and 1 waits for 2's before sending to 0. Per-pair streams let 0's send pass its receive;
    one stream per group queues it behind that receive, which needs it."""
    events = {0: [one(recv(1, group=G3)), one(send(2, group=G3)), Wait(0)],
              1: [one(recv(2, group=G3)), Wait(0), one(send(0, group=G3))],
              2: [one(recv(0, group=G3)), Wait(0), one(send(1, group=G3))]}
    assert replay_nccl(events, streams="pair").p2p_ops == 6
    with pytest.raises(ScheduleError, match=r"(?s)streams='group'.*rank 2: recv #0 from rank 0.*posted; "
                       r"rank 0's matching send #0 is not posted: queued behind its recv #0 from rank 1"):
        replay_nccl(events, streams="group")


def test_collective_order_mismatch() -> None:
    events = {0: [Collective(G2, "all_reduce", 8, "float32"), Collective(G2, "barrier", 0, "")],
              1: [Collective(G2, "barrier", 0, ""), Collective(G2, "all_reduce", 8, "float32")]}
    with pytest.raises(ScheduleError, match=r"(?s)collective mismatch on group \(0, 1\) at call #0:\n"
                       r"  rank 0: all_reduce\(8 x float32\)\n  rank 1: barrier\(\)"):
        replay_nccl(events)


def test_a_missing_collective_is_named() -> None:
    call = Collective(G2, "all_reduce", 8, "float32")
    with pytest.raises(ScheduleError, match=r"(?s)at call #1:.*\n  rank 1: nothing \(it calls only 1\)"):
        replay_nccl({0: [call, call], 1: [call]})


def test_unrecorded_members_of_a_collective_are_not_checked() -> None:
    call = Collective((0, 1, 2, 3), "all_reduce", 8, "float32")
    assert replay_nccl({0: [call], 1: [call]}).collectives == 2


def test_a_blocking_collective_orders_later_sends() -> None:
    """Rank 0 reduces then sends; rank 1 waits for the message before it reduces."""
    events = {0: [Collective(G2, "all_reduce", 8, "float32"), one(send(1))],
              1: [one(recv(0)), Wait(0), Collective(G2, "all_reduce", 8, "float32")]}
    with pytest.raises(ScheduleError, match=r"(?s)deadlock.*rank 0: all_reduce #0 on group \(0, 1\) "
                       r"posted; not yet reached by ranks \[1\]"):
        replay_nccl(events)
    async_events = {0: [Collective(G2, "all_reduce", 8, "float32", blocking=False), one(send(1))],
                    1: events[1]}
    assert replay_nccl(async_events).collectives == 2


def test_waiting_for_an_op_not_yet_issued() -> None:
    with pytest.raises(ScheduleError, match="waits for its p2p op 1, but it has issued only 1"):
        replay_nccl({0: [one(send(1)), Wait(1)], 1: [one(recv(0))]})


def test_json_round_trip(tmp_path) -> None:
    events = {0: [batch(send(1), recv(1, 2, "bfloat16")), Wait(1),
                  Collective(G2, "all_reduce", 8, "float32", blocking=False)],
              1: [batch(recv(0), send(0, 2, "bfloat16")), Wait(0), Wait(1),
                  Collective(G2, "all_reduce", 8, "float32", blocking=False)]}
    assert from_json(to_json(events[0])) == events[0]
    for rank, evs in events.items():
        (tmp_path / f"rank{rank}.jsonl").write_text(to_json(evs))
    assert read_record_dir(tmp_path) == events
    assert replay_dir(tmp_path).p2p_ops == 4
    with pytest.raises(TraceError, match="unknown kind 'nope'"):
        from_json('{"kind": "nope"}\n')
    with pytest.raises(TraceError, match="no rank<N>.jsonl"):
        (tmp_path / "empty").mkdir()
        read_record_dir(tmp_path / "empty")


def pipeline(ranks: int, microbatches: int) -> dict[int, list]:
    """A 1F1B-like chain: each rank receives a microbatch, then sends it on, batched with the next
    receive, over ``microbatches`` forward and backward messages."""
    events: dict[int, list] = {r: [] for r in range(ranks)}
    group = tuple(range(ranks))
    for r in range(ranks):
        ids = 0
        for _ in range(2 * microbatches):
            ops = []
            if r > 0:
                ops.append(P2POp(group, r - 1, False, 1024, "bfloat16"))
            if r < ranks - 1:
                ops.append(P2POp(group, r + 1, True, 1024, "bfloat16"))
            events[r].append(Issue(tuple(ops), batched=True))
            events[r].extend(Wait(ids + i) for i in range(len(ops)))
            ids += len(ops)
        events[r].append(Collective(group, "all_reduce", 4096, "float32"))
    return events


def test_tens_of_thousands_of_ops_replay_fast() -> None:
    events = pipeline(16, 500)
    start = time.perf_counter()
    report = replay_nccl(events)
    assert report.p2p_ops == 2 * 15 * 1000
    assert time.perf_counter() - start < 1.0
