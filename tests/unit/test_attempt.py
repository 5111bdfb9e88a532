"""Restart attempts agreed through the store: the same number on every rank, whatever a dead attempt left."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from harmonia.runtime.attempt import AttemptError, agree_attempt


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _client(store):
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))


def _attempt(store, world: int, delays: dict[int, float] | None = None) -> dict[int, int]:
    """Every rank of one attempt in its own thread (rank r starts ``delays[r]`` seconds late)."""
    seen: dict[int, int] = {}

    def rank(r: int) -> None:
        time.sleep((delays or {}).get(r, 0.0))
        seen[r] = agree_attempt(_client(store), r, world, timeout_s=10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return seen


def test_every_rank_gets_the_same_number_and_restarts_count_up(store) -> None:
    assert _attempt(store, 3) == {0: 0, 1: 0, 2: 0}
    assert _attempt(store, 3, delays={0: 0.3}) == {0: 1, 1: 1, 2: 1}  # rank 0 last: the others wait for it


def test_what_a_dead_attempt_left_is_never_read(store) -> None:
    assert _attempt(store, 3) == {0: 0, 1: 0, 2: 0}
    # a dead attempt: its rank 0 took number 1 and died; its rank 2 posted a nonce nobody answered
    store.add("harmonia/attempts/count", 1)
    store.set("harmonia/attempts/hello/2", "dead-attempt-nonce")
    # the new attempt's rank 2 starts after rank 0 answered the stale nonce
    assert _attempt(store, 3, delays={2: 0.5}) == {0: 2, 1: 2, 2: 2}


def test_a_rank_that_never_joins_is_named(store) -> None:
    seen = {}
    rank1 = threading.Thread(target=lambda: seen.setdefault(1, agree_attempt(_client(store), 1, 3, timeout_s=10)))
    rank1.start()
    t0 = time.monotonic()
    with pytest.raises(AttemptError, match=r"ranks \[2\] did not join restart attempt 0 within 0.5 s"):
        agree_attempt(_client(store), 0, 3, timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    rank1.join(timeout=10)
    assert seen == {1: 0}


def test_the_agreed_attempt_wins_over_torchruns_count(monkeypatch) -> None:
    from harmonia.runtime.attempt import ATTEMPT_ENV, current_attempt

    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert current_attempt() == 0
    monkeypatch.setenv(ATTEMPT_ENV, "1")  # an agent that restarted only for the membership change still says 0
    assert current_attempt() == 1
