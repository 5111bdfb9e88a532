"""Which restart attempt of a job this process belongs to, agreed by every rank through the store.

Under torchrun with several agents (`--nnodes=2`), the agents' worker store outlives a restart of
the worker group, and the keys of the dead attempt stay in it: a process group set up on the same
keys dials the dead ranks' addresses ("connection refused"). The keys must be prefixed by the
attempt, and every rank must use the same prefix. ``TORCHELASTIC_RESTART_COUNT`` is not it: only the
agent whose worker failed counts a restart; the others restart for the membership change and keep
their count, so the ranks of one attempt see different counts.

`agree_attempt` numbers attempts in the store itself. Rank 0 (there is exactly one per attempt, and
every process of an earlier attempt is gone before a new one starts) takes the next number (the
first attempt is 0, as torchrun counts); each other rank posts a fresh random nonce under its rank
and waits for rank 0's answer under that nonce, so an answer to a dead attempt's rank is never
read; rank 0 answers until every rank has acknowledged the number.
"""

from __future__ import annotations

import os
import time
import uuid

from harmonia.errors import HarmoniaError

PREFIX = "harmonia/attempts"
ATTEMPT_ENV = "HARMONIA_ATTEMPT"
"""Set in each rank once the attempt is agreed (`agree_attempt`): its number."""


class AttemptError(HarmoniaError):
    """A rank did not join its attempt in time; the message names it."""


def _hello(rank: int) -> str:
    return f"{PREFIX}/hello/{rank}"


def _answer(rank: int, nonce: str) -> str:
    return f"{PREFIX}/answer/{rank}/{nonce}"


def _ack(attempt: int, rank: int) -> str:
    return f"{PREFIX}/ack/{attempt}/{rank}"


def current_attempt() -> int:
    """This process's restart attempt: the agreed one (``HARMONIA_ATTEMPT``) once set, else torchrun's count."""
    return int(os.environ.get(ATTEMPT_ENV, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def agree_attempt(store, rank: int, world: int, timeout_s: float, poll_s: float = 0.02) -> int:
    """The number of this restart attempt (0 for a job's first), the same on every rank.

    Collective over the ``world`` ranks of the attempt; only ``store`` is used (no process group).

    Args:
        store: the job's rendezvous store, unprefixed (shared by every attempt).
        rank, world: this rank and the attempt's size.
        timeout_s: how long rank 0 waits for every rank (a rank, for rank 0's answer: the store's timeout).

    Raises:
        AttemptError: on rank 0, when some rank did not join within ``timeout_s``.
    """
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(_hello(rank), nonce)
        attempt = int(store.get(_answer(rank, nonce)))  # waits for rank 0 (up to the store's timeout)
        store.set(_ack(attempt, rank), "1")
        return attempt
    attempt = int(store.add(f"{PREFIX}/count", 1)) - 1
    answered: dict[int, str] = {}
    pending = set(range(1, world))
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in sorted(pending):
            if store.check([_ack(attempt, r)]):
                pending.discard(r)
            elif store.check([_hello(r)]):
                nonce = store.get(_hello(r)).decode()
                if answered.get(r) != nonce:  # a dead attempt's nonce gets an answer nobody reads
                    store.set(_answer(r, nonce), str(attempt))
                    answered[r] = nonce
        if pending and time.monotonic() > deadline:
            raise AttemptError(f"ranks {sorted(pending)} did not join restart attempt {attempt} within {timeout_s:g} s "
                               "(parallel.collective_timeout_s); their processes did not start or died starting")
        if pending:
            time.sleep(poll_s)
    return attempt
