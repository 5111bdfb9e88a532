"""DP balancing: every sample on one replica, microbatch counts, token caps, encoder replicas, errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmonia.errors import ScheduleError
from harmonia.schedule import balance_dp


def _costs(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vision = rng.lognormal(0, 1, n) * (rng.random(n) < 0.6)
    audio = rng.lognormal(0, 1, n) * (rng.random(n) < 0.3)
    return np.stack([vision, audio, vision * 0.1, rng.lognormal(0, 0.5, n)], axis=1)


@settings(max_examples=40, deadline=None)
@given(dp=st.integers(1, 4), n_mb=st.integers(1, 4), extra=st.integers(0, 40), seed=st.integers(0, 1000),
       enc=st.integers(1, 6))
def test_every_sample_on_exactly_one_replica_and_deterministic(dp, n_mb, extra, seed, enc) -> None:
    n = dp * n_mb + extra
    costs = _costs(n, seed)
    tokens = np.random.default_rng(seed).integers(1, 100, size=n)
    cap = max(int(tokens.max()), 2 * int(np.ceil(tokens.sum() / (dp * n_mb))))
    a = balance_dp(costs, dp, tokens=tokens, n_microbatches=n_mb, token_cap=cap, encoder_dp={0: enc}, seed=seed)
    assert len(a.shards) == dp and all(len(r) == n_mb for r in a.microbatches)
    assert sorted(i for s in a.shards for i in s) == list(range(n))
    for shard, mbs in zip(a.shards, a.microbatches):
        assert sorted(i for mb in mbs for i in mb) == shard
        assert all(tokens[mb].sum() <= cap for mb in mbs)
    assert len(a.encoder_shards[0]) == enc
    assert sorted(i for s in a.encoder_shards[0] for i in s) == list(range(n))
    np.testing.assert_allclose(a.loads.sum(axis=0), costs.sum(axis=0))
    b = balance_dp(costs, dp, tokens=tokens, n_microbatches=n_mb, token_cap=cap, encoder_dp={0: enc}, seed=seed)
    assert a.shards == b.shards and a.microbatches == b.microbatches and a.encoder_shards == b.encoder_shards


def test_replicas_balanced_on_every_module() -> None:
    costs = _costs(1024, 0)
    a = balance_dp(costs, 8, n_microbatches=4)
    bound = np.maximum(costs.sum(0) / 8, costs.max(0))
    assert (a.loads.max(axis=0) / bound).max() < 1.03
    seq = np.array([costs[i * 128:(i + 1) * 128].sum(0) for i in range(8)])
    assert (a.loads.max(axis=0) / bound).max() < (seq.max(axis=0) / bound).max()
    shards_only = balance_dp(costs, 8)
    assert shards_only.microbatches == [[] for _ in range(8)]
    assert sorted(i for s in shards_only.shards for i in s) == list(range(1024))


def test_encoder_replicas_by_name_balance_that_encoder() -> None:
    costs = _costs(512, 1)
    a = balance_dp(costs, 2, encoder_dp={"vision": 8}, modules=["vision", "audio", "vision_proj", "llm"])
    vision = np.array([costs[s, 0].sum() for s in a.encoder_shards["vision"]])
    assert vision.max() / max(vision.mean(), costs[:, 0].max()) < 1.02


def test_errors_say_what_to_do() -> None:
    with pytest.raises(ScheduleError, match="cannot form 8 microbatches"):
        balance_dp(np.ones((6, 2)), 4, n_microbatches=2)
    with pytest.raises(ScheduleError, match="sample 1 has 90 tokens"):
        balance_dp(np.ones((4, 1)), 2, n_microbatches=1, tokens=np.array([1, 90, 1, 1]), token_cap=50)
    with pytest.raises(ScheduleError, match="pass modules="):
        balance_dp(np.ones((4, 2)), 2, encoder_dp={"vision": 4})
    with pytest.raises(ScheduleError, match="pass n_microbatches="):
        balance_dp(np.ones((4, 1)), 2, tokens=np.ones(4), token_cap=3)


def test_kept_microbatches_serve_every_split_of_the_same_count() -> None:
    """``kept`` shares one balance of ``dp x n_microbatches`` microbatches between the splits of that
    count (a plan search asks for many); each split is what it is computed alone."""
    costs, tokens = _costs(64, 5), np.random.default_rng(5).integers(1, 100, size=64)
    kept: dict = {}
    for dp, n_mb in ((4, 2), (2, 4), (8, 1), (1, 8), (2, 4)):
        alone = balance_dp(costs, dp, tokens=tokens, n_microbatches=n_mb, seed=3)
        shared = balance_dp(costs, dp, tokens=tokens, n_microbatches=n_mb, seed=3, kept=kept)
        assert shared.microbatches == alone.microbatches and shared.shards == alone.shards
        np.testing.assert_array_equal(shared.loads, alone.loads)
    assert len(kept) == 1  # one balance of 8 microbatches


def test_one_replica_of_one_microbatch_holds_every_sample_as_the_balancer_would() -> None:
    """Nothing to balance: every sample in the one microbatch, the loads the balancer's one bin has;
    an encoder with more replicas is still balanced; a sample over the cap is still refused."""
    from harmonia.schedule.microbatching import balance_bins

    costs = _costs(13, 2)
    a = balance_dp(costs, 1, n_microbatches=1, encoder_dp={"vision": 3}, modules=["vision", "audio", "vision_proj",
                                                                                     "llm"])
    bins, loads = balance_bins(costs, 1)
    assert a.microbatches == [bins] and a.shards == bins == [list(range(13))]
    np.testing.assert_array_equal(a.loads, loads)
    assert sorted(i for s in a.encoder_shards["vision"] for i in s) == list(range(13))
    assert len(a.encoder_shards["vision"]) == 3 and all(a.encoder_shards["vision"])
    with pytest.raises(ScheduleError, match="sample 1 has 90 tokens"):
        balance_dp(np.ones((3, 1)), 1, n_microbatches=1, tokens=np.array([1, 90, 1]), token_cap=50)
