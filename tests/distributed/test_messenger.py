"""The messenger on real processes: a wait that times out names the rank pair and the message; a
call out of the derived order is refused before anything is issued."""

from __future__ import annotations

import time

import pytest
import torch

from harmonia.errors import ScheduleError
from harmonia.runtime.messenger import Messenger
from harmonia.schedule.message_order import Step, plan_message_order
from tests.distributed._spawn import run_workers

pytestmark = pytest.mark.distributed

KEY = ("stage", "F", "llm", 0, 1, 3, -1, 1, 0)


def _orders():
    return plan_message_order({0: [Step(KEY, False, 1)], 1: [Step(KEY, True, 0)]})


def _silent_peer(rank: int, world: int) -> str:
    """Rank 0 waits for a message rank 1 never sends (it only outlives rank 0's timeout)."""
    if rank == 1:
        time.sleep(6)
        return ""
    messenger = Messenger(_orders()[0], 0)
    messenger.expect(KEY, None, lambda: torch.empty(4))
    messenger.post_ready()
    try:
        messenger.recv(KEY)
    except Exception as err:  # noqa: BLE001 -- the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "received"


def test_a_wait_that_times_out_names_the_pair_and_the_message() -> None:
    said, _ = run_workers(_silent_peer, 2, pg_timeout=2, replay=False)
    assert said.startswith("MessageWaitError: rank 0 gave up waiting to receive "
                           "llm.s0 -> llm.s1 activation of microbatch 3 from rank 1"), said


def test_out_of_order_calls_are_refused_before_issuing() -> None:
    messenger = Messenger(_orders()[1], 1)
    with pytest.raises(ScheduleError, match="receives .* but its message order has"):
        messenger.recv(KEY)
