"""Packing under a token cap: found whenever one exists, refused only with a reason."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmonia.errors import ScheduleError
from harmonia.schedule.microbatching import assign_microbatches
from harmonia.schedule.packing import pack_under_cap


def _feasible(tokens: list[int], n_bins: int, cap: int) -> bool:
    """Brute force over every assignment."""
    for where in itertools.product(range(n_bins), repeat=len(tokens)):
        if all(sum(t for t, w in zip(tokens, where) if w == b) <= cap for b in range(n_bins)):
            return True
    return False


def test_greedy_corner_case_is_packed() -> None:
    tokens = np.array([83, 2, 25, 25, 23])
    costs = np.stack([tokens, tokens[::-1]], axis=1).astype(float)
    mbs = assign_microbatches(costs, 3, tokens=tokens, token_cap=106)
    assert sorted(i for mb in mbs for i in mb) == list(range(5))
    assert all(mb and tokens[mb].sum() <= 106 for mb in mbs)


def test_balance_dp_finds_the_packing_the_greedy_missed() -> None:
    from harmonia.schedule import balance_dp

    tokens = np.array([83, 2, 25, 25, 23])
    rng = np.random.default_rng(239)
    costs = rng.lognormal(0, 1, (5, 4))
    a = balance_dp(costs, 1, tokens=tokens, n_microbatches=3, token_cap=106, seed=239)
    assert all(tokens[mb].sum() <= 106 for mb in a.microbatches[0])


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(1, 60), min_size=1, max_size=7), n_bins=st.integers(1, 3),
       cap=st.integers(10, 120))
def test_packed_exactly_when_a_packing_exists(tokens, n_bins, cap) -> None:
    feasible = max(tokens) <= cap and _feasible(tokens, n_bins, cap)
    if not feasible:
        with pytest.raises(ScheduleError, match="no packing"):
            pack_under_cap(np.array(tokens), n_bins, cap)
        return
    where = pack_under_cap(np.array(tokens), n_bins, cap)
    load = np.bincount(where, np.array(tokens, dtype=float), minlength=n_bins)
    assert load.max() <= cap
    if len(tokens) >= n_bins:
        assert (np.bincount(where, minlength=n_bins) > 0).all()


def test_refusals_say_why() -> None:
    with pytest.raises(ScheduleError, match="more than half the cap"):
        pack_under_cap(np.array([60, 60, 60]), 2, 100)
    with pytest.raises(ScheduleError, match="exhaustive search"):
        pack_under_cap(np.array([40, 40, 35, 35, 30]), 2, 90)  # 180 = 2 x 90, but no exact split


def test_large_inputs_pack_by_heuristic() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 500, size=2000)
    cap = int(np.ceil(tokens.sum() / 64 * 1.02))
    where = pack_under_cap(tokens, 64, cap)
    assert np.bincount(where, tokens.astype(float), minlength=64).max() <= cap
