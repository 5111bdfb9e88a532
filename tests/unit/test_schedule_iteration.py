"""`assign_iteration`: global microbatches, LLM replicas and encoder replicas of one iteration."""

import numpy as np
import pytest

from harmonia.errors import ScheduleError
from harmonia.schedule.iteration import assign_iteration

MODULES = ["vision", "llm"]


def _costs(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.gamma(1.5, 2.0, n), rng.uniform(1.0, 3.0, n)], axis=1)  # (n, [vision, llm])


def test_every_sample_on_one_replica_of_each_module() -> None:
    a = assign_iteration(_costs(48), MODULES, 2, {"vision": 3}, 4)
    assert sorted(i for mb in a.microbatches for i in mb) == list(range(48))
    for m, mb in enumerate(a.microbatches):
        for split in (a.llm_split[m], a.encoder_split["vision"][m]):
            assert sorted(p for rep in split for p in rep) == list(range(len(mb)))


def test_feeds_keep_each_llm_replicas_samples_on_its_encoder_replicas() -> None:
    feeds = {"vision": [[0, 2], [1, 3]]}  # encoder replicas 0, 2 on LLM replica 0's ranks; 1, 3 on 1's
    a = assign_iteration(_costs(64), MODULES, 2, {"vision": 4}, 4, feeds=feeds)
    for m in range(a.n_microbatches):
        for d, positions in enumerate(a.llm_split[m]):
            for e in (0, 1, 2, 3):
                mine = set(a.encoder_split["vision"][m][e]) & set(positions)
                assert not mine or e in feeds["vision"][d]


def test_encoder_loads_carry_over_between_microbatches() -> None:
    """One heavy image per microbatch: carried-over loads send them to alternating replicas."""
    costs = np.ones((16, 2))
    costs[::4, 0] = 10.0  # samples 0, 4, 8, 12: heavy vision work
    a = assign_iteration(costs, MODULES, 1, {"vision": 2}, 4)
    totals = np.zeros(2)
    for m, mb in enumerate(a.microbatches):
        for e, positions in enumerate(a.encoder_split["vision"][m]):
            totals[e] += costs[[mb[p] for p in positions], 0].sum()
    assert totals.max() - totals.min() <= 10.0 - 1e-9, totals  # never two heavy images more on one replica


def test_feeds_that_miss_a_replica_are_refused() -> None:
    with pytest.raises(ScheduleError, match=r"feeds\['vision'\]"):
        assign_iteration(_costs(32), MODULES, 2, {"vision": 4}, 2, feeds={"vision": [[0], [1]]})


def test_an_llm_replica_fed_by_one_encoder_replica_gets_what_dealing_gives():
    """The one-feeder shortcut of `_deal_encoder`: the same split and, bit for bit, the same running
    loads as dealing longest first onto one bin."""
    from harmonia.schedule.iteration import _deal_encoder, deal_longest_first

    rng = np.random.default_rng(3)
    weights = rng.random(40) * rng.integers(1, 1000, 40)
    llm_split = [sorted(rng.choice(40, 13, replace=False).tolist()), list(range(0, 40, 3))]
    loads = rng.random(2) * 7
    fast = loads.copy()
    split = _deal_encoder(weights, [[1], [0]], llm_split, fast)
    for d, r in ((0, 1), (1, 0)):
        held = loads[[r]].copy()
        (picks,) = deal_longest_first(weights[llm_split[d]], 1, held)
        assert split[r] == sorted(llm_split[d][i] for i in picks)
        assert fast[r] == held[0]
