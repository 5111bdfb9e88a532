"""One order of every rank's point-to-point messages that both ends of each pair share (NCCL's rules).

NCCL matches messages by order, not by tag: between two ranks of a communicator, the i-th send meets
the i-th receive, and each rank's operations on that pair run in issue order on one stream, so a
receive issued before a send holds that send back until the peer's matching send arrives. gloo matches
by tag and lets a receive posted early wait beside later sends; an iteration that posts every receive
first runs on gloo and hangs on NCCL.

`plan_message_order` takes every rank's *program*, the messages it sends and receives in the order its
action list reaches them (`Step`), and gives each rank the same global order of messages:

1. **Replay.** The programs run together as gloo would run them: a send never blocks, a receive
   waits for its send. Each step gets a global index when it runs; a message's *time* ``tau`` is the
   index of its send. A receive that waits for a send no program makes is a deadlock of the action
   lists themselves, refused here (`ScheduleError`, naming the ranks and messages).
2. **Issue order.** A rank issues its own sends at their steps and posts each receive just before its
   first step that ran after the message's send (``posts[j]``: the receives posted before step ``j``;
   ``posts[len(steps)]``: those posted after its last step). So every rank issues its messages, sends
   and receives together, in increasing ``tau``: the two ends of a pair issue their common messages in
   the same order (FIFO matching holds on every pair and every communicator), and each operation
   depends only on operations of smaller ``tau`` (a receive is posted after the waits of the steps
   before it, each for a message sent earlier), so nothing waits on a later one: no deadlock, whether
   the streams are per pair or per communicator. No batch is needed.

Pure data, no process group: the runtime builds the programs from the action lists and boundary plans
(`harmonia.runtime.message_program`), the suite replays what the runtime really issued under NCCL's
rules (`harmonia.sim.nccl_replay`).
"""

from __future__ import annotations

import bisect

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from harmonia.errors import ScheduleError


@dataclass(frozen=True)
class Step:
    """One message of a rank's program.

    Attributes:
        key: the message's identity, the same on both ends (hashable, e.g. a tuple).
        send: this rank sends it (else receives it).
        peer: the other end's global rank.
    """

    key: Hashable
    send: bool
    peer: int


@dataclass(frozen=True)
class MessageOrder:
    """One rank's messages in issue order.

    Attributes:
        steps: the rank's program.
        posts: ``len(steps) + 1`` lists: ``posts[j]`` the receives (keys) to post before step ``j``,
            each in increasing ``tau``; every receive of ``steps`` is posted exactly once, at or before
            its own step.
        tau: message key -> its time (the global index of its send in the replay).
    """

    steps: tuple[Step, ...]
    posts: tuple[tuple[Hashable, ...], ...]
    tau: Mapping[Hashable, int]


def plan_message_order(programs: Mapping[int, Sequence[Step]],
                       ranks: Sequence[int] | None = None) -> dict[int, MessageOrder]:
    """Every rank's issue order of its messages (see the module docstring).

    Args:
        programs: global rank -> its steps in the order its action list reaches them; every rank
            that sends to or receives from a rank of ``ranks`` must be present.
        ranks: the ranks whose orders are wanted (default: all).

    Returns:
        rank -> its `MessageOrder`.

    Raises:
        ScheduleError: a send without its receive (or the reverse), or programs that cannot run
            (a receive waits for a send that waits for it).
    """
    _check_pairs(programs)
    run_at = _replay(programs)
    tau = {}
    for rank, steps in programs.items():
        for j, s in enumerate(steps):
            if s.send:
                tau[s.key] = run_at[rank][j]
    return {rank: _order(programs[rank], run_at[rank], tau) for rank in (programs if ranks is None else ranks)}


def _check_pairs(programs: Mapping[int, Sequence[Step]]) -> None:
    """Each message is sent once and received once, by the ranks each end names."""
    ends: dict[Hashable, dict[bool, tuple[int, int]]] = {}
    for rank, steps in programs.items():
        for s in steps:
            side = ends.setdefault(s.key, {})
            if s.send in side:
                raise ScheduleError(f"message {s.key} is {'sent' if s.send else 'received'} twice "
                                    f"(ranks {side[s.send][0]} and {rank})")
            side[s.send] = (rank, s.peer)
    for key, side in ends.items():
        if len(side) != 2:
            (rank, peer), = side.values()
            what = "sent" if True in side else "received"
            raise ScheduleError(f"message {key} is {what} by rank {rank} but rank {peer} has no matching "
                                f"{'receive' if what == 'sent' else 'send'}; the action lists disagree")
        (src, dst), (dst2, src2) = side[True], side[False]
        if (src, dst) != (src2, dst2):
            raise ScheduleError(f"message {key}: rank {src} sends it to {dst} but rank {dst2} receives it "
                                f"from {src2}")


def _replay(programs: Mapping[int, Sequence[Step]]) -> dict[int, list[int]]:
    """Run the programs as gloo runs them (sends never block); each step's global index."""
    pos = {r: 0 for r in programs}
    run_at: dict[int, list[int]] = {r: [] for r in programs}
    sent: set[Hashable] = set()
    waiting: dict[Hashable, int] = {}  # message key -> the rank blocked receiving it
    ready = sorted(programs)
    clock = 0
    while ready:
        rank = ready.pop()
        steps = programs[rank]
        while pos[rank] < len(steps):
            s = steps[pos[rank]]
            if not s.send and s.key not in sent:
                waiting[s.key] = rank
                break
            run_at[rank].append(clock)
            clock += 1
            pos[rank] += 1
            if s.send:
                sent.add(s.key)
                woken = waiting.pop(s.key, None)
                if woken is not None:
                    ready.append(woken)
    stuck = {r: programs[r][p] for r, p in pos.items() if p < len(programs[r])}
    if stuck:
        lines = [f"rank {r} waits to receive {s.key} from rank {s.peer}" for r, s in sorted(stuck.items())[:8]]
        raise ScheduleError("the action lists cannot run: every rank left waits for a message sent after "
                            "what it waits for\n  " + "\n  ".join(lines))
    return run_at


def _order(steps: Sequence[Step], run_at: list[int], tau: Mapping[Hashable, int]) -> MessageOrder:
    """Post each receive before the rank's first step that ran after its send."""
    posts: list[list[tuple[int, Hashable]]] = [[] for _ in range(len(steps) + 1)]
    for s in steps:
        if not s.send:
            t = tau[s.key]
            j = bisect.bisect_right(run_at, t)  # the first step that ran after the send
            posts[j].append((t, s.key))
    return MessageOrder(tuple(steps), tuple(tuple(k for _, k in sorted(p, key=lambda x: x[0])) for p in posts),
                        {s.key: tau[s.key] for s in steps})

