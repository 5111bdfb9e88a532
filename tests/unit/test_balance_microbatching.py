"""Multi-module microbatch balancing: placement, caps, errors, determinism, quality vs baselines."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmonia.errors import HarmoniaError, ScheduleError
from harmonia.schedule import assign_microbatches, balance_bins, light_ends, order_microbatches


def _entangled(n: int, seed: int) -> np.ndarray:
    """vision, audio, vision projector (proportional to vision), llm: modalities vary independently."""
    rng = np.random.default_rng(seed)
    vision = rng.lognormal(0, 1, n) * (rng.random(n) < 0.6)
    audio = rng.lognormal(0, 1, n) * (rng.random(n) < 0.3)
    llm = rng.lognormal(0, 0.5, n) + 0.3 * vision + 0.2 * audio
    return np.stack([vision, audio, 0.05 * vision, llm], axis=1)


def _worst_ratio(costs: np.ndarray, mbs: list[list[int]]) -> float:
    keep = costs.sum(0) > 0
    bound = np.maximum(costs.sum(0) / len(mbs), costs.max(0))[keep]
    loads = np.array([costs[mb].sum(0) for mb in mbs])[:, keep]
    return float((loads.max(0) / bound).max())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 8), m=st.integers(1, 4), seed=st.integers(0, 1000),
       sparse=st.booleans())
def test_every_sample_placed_once_and_deterministic(n, k, m, seed, sparse) -> None:
    k = min(k, n)
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(size=(n, m))
    if sparse:
        costs *= rng.random((n, m)) < 0.4
    tokens = rng.integers(1, 100, size=n)
    mbs = assign_microbatches(costs, k, tokens=tokens, seed=seed)
    assert len(mbs) == k
    assert sorted(i for mb in mbs for i in mb) == list(range(n))
    assert all(mb == sorted(mb) for mb in mbs)
    assert mbs == assign_microbatches(costs, k, tokens=tokens, seed=seed)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 50), k=st.integers(2, 6), seed=st.integers(0, 1000), slack=st.floats(1.0, 2.0))
def test_token_cap_is_respected(n, k, seed, slack) -> None:
    k = min(k, n)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 50, size=n)
    cap = max(tokens.max(), int(slack * np.ceil(tokens.sum() / k)) + int(tokens.max()))
    mbs = assign_microbatches(_entangled(n, seed), k, tokens=tokens, token_cap=cap, seed=seed)
    assert sorted(i for mb in mbs for i in mb) == list(range(n))
    assert all(tokens[mb].sum() <= cap for mb in mbs)


def test_all_zero_and_single_column_costs() -> None:
    mbs = assign_microbatches(np.zeros((10, 3)), 3)
    assert sorted(i for mb in mbs for i in mb) == list(range(10))
    mbs = assign_microbatches(np.arange(1.0, 9.0), 2)  # 1-D: one module
    assert sorted(np.arange(1.0, 9.0)[mb].sum() for mb in mbs) == [18.0, 18.0]


def test_errors_name_the_sample_and_say_what_to_do() -> None:
    with pytest.raises(ScheduleError, match="sample 2 has 90 tokens.*raise token_cap"):
        assign_microbatches(np.ones((3, 1)), 2, tokens=np.array([1, 1, 90]), token_cap=50)
    with pytest.raises(ScheduleError, match="cannot form 5 microbatches from 3"):
        assign_microbatches(np.ones((3, 1)), 5)
    with pytest.raises(ScheduleError, match="non-negative"):
        assign_microbatches(-np.ones((3, 1)), 2)
    with pytest.raises(ScheduleError, match="token_cap needs tokens"):
        assign_microbatches(np.ones((3, 1)), 2, token_cap=10)
    with pytest.raises(ScheduleError, match="cannot fit 2 microbatches"):
        assign_microbatches(np.ones((4, 1)), 2, tokens=np.full(4, 10), token_cap=15)
    with pytest.raises(HarmoniaError, match="4 entries for 3 samples"):
        assign_microbatches(np.ones((3, 1)), 2, tokens=np.ones(4))


def test_one_bin_holds_every_sample_or_says_the_cap_is_too_small() -> None:
    costs = _entangled(12, 3)
    bins, loads = balance_bins(costs, 1, tokens=np.arange(1, 13), token_cap=78)
    assert bins == [list(range(12))]
    np.testing.assert_allclose(loads, costs.sum(0, keepdims=True))
    with pytest.raises(ScheduleError, match="cannot fit 1 microbatches"):
        balance_bins(costs, 1, tokens=np.arange(1, 13), token_cap=77, unit="microbatches")


@pytest.mark.parametrize("n,k", [(256, 32), (512, 16), (1024, 32)])
def test_every_module_balanced_better_than_one_dimensional_baselines(n, k) -> None:
    costs = _entangled(n, 0)
    ours = _worst_ratio(costs, assign_microbatches(costs, k))
    sequential = _worst_ratio(costs, [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)])
    # LPT on the total work (what a one-dimensional balancer does)
    loads, lpt = np.zeros(k), [[] for _ in range(k)]
    for i in np.argsort(-costs.sum(1), kind="stable"):
        b = int(loads.argmin())
        lpt[b].append(int(i))
        loads[b] += costs[i].sum()
    assert ours < 1.1
    assert ours < sequential / 1.5
    assert ours < _worst_ratio(costs, lpt)


def test_proportional_modules_do_not_change_the_result() -> None:
    costs = _entangled(300, 3)
    with_proj = balance_bins(costs, 12)[0]
    without = balance_bins(costs[:, [0, 1, 3]], 12)[0]
    assert with_proj == without


def test_light_ends_order() -> None:
    assert light_ends(np.array([5.0, 1.0, 3.0, 2.0, 4.0])) == [1, 2, 0, 4, 3]
    order = order_microbatches(np.array([[3.0, 1.0], [1.0, 1.0], [2.0, 2.0], [5.0, 4.0]]))
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 1 and order[len(order) // 2] == 3


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 12), m=st.integers(1, 3), seed=st.integers(0, 1000), capped=st.booleans())
def test_two_bins_of_few_samples_are_the_best_split(n, m, seed, capped) -> None:
    """Against every split enumerated one by one: the smallest worst normalised (bin, module) load
    under the token cap, both bins non-empty, every sample once."""
    import itertools

    from harmonia.schedule.microbatching import normalise

    rng = np.random.default_rng(seed)
    costs = rng.lognormal(size=(n, m)) * (rng.random((n, m)) < 0.8)
    tokens = rng.integers(1, 60, size=n)
    cap = float(max(tokens.max(), int(np.ceil(tokens.sum() * 0.6)))) if capped else None
    work, _ = normalise(costs, 2)
    best = np.inf
    for split in itertools.product([0, 1], repeat=n):
        side = np.array(split)
        if side.all() or not side.any() or (cap is not None and max(tokens[side == 0].sum(),
                                                                    tokens[side == 1].sum()) > cap):
            continue
        best = min(best, max(work[side == 0].sum(0).max(), work[side == 1].sum(0).max()))
    if best == np.inf:  # no split fits the cap: said so
        with pytest.raises(ScheduleError, match="raise token_cap"):
            balance_bins(costs, 2, tokens=tokens, token_cap=cap)
        return
    bins, loads = balance_bins(costs, 2, tokens=tokens, token_cap=cap)
    assert sorted(bins[0] + bins[1]) == list(range(n)) and bins[0] and bins[1]
    np.testing.assert_allclose(loads, [costs[b].sum(0) for b in bins])
    got = max(work[bins[0]].sum(0).max(), work[bins[1]].sum(0).max())
    assert got <= best + 1e-12
    assert cap is None or all(tokens[b].sum() <= cap for b in bins)
