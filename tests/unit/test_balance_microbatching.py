"""Multi-module microbatch balancing: placement, caps, errors, quality against simple baselines."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmonia.errors import ScheduleError
from harmonia.schedule import assign_microbatches


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 60), k=st.integers(1, 8), m=st.integers(1, 4), seed=st.integers(0, 1000),
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
    assert mbs == assign_microbatches(costs, k, tokens=tokens, seed=seed)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 40), k=st.integers(2, 6), seed=st.integers(0, 1000))
def test_token_cap_is_respected(n, k, seed) -> None:
    k = min(k, n)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 50, size=n)
    cap = max(tokens.max(), 2 * int(np.ceil(tokens.sum() / k)))
    mbs = assign_microbatches(rng.random((n, 2)), k, tokens=tokens, token_cap=cap)
    assert all(tokens[mb].sum() <= cap for mb in mbs)


def test_errors_name_the_sample() -> None:
    with pytest.raises(ScheduleError, match="sample 2 has 90 tokens"):
        assign_microbatches(np.ones((3, 1)), 2, tokens=np.array([1, 1, 90]), token_cap=50)
    with pytest.raises(ScheduleError, match="cannot form 5 microbatches from 3"):
        assign_microbatches(np.ones((3, 1)), 5)
    with pytest.raises(ScheduleError, match="non-negative"):
        assign_microbatches(-np.ones((3, 1)), 2)


def test_balances_every_module_better_than_sequential_on_entangled_work() -> None:
    rng = np.random.default_rng(0)
    n, k = 512, 16
    vision = rng.lognormal(0, 1, n) * (rng.random(n) < 0.6)
    audio = rng.lognormal(0, 1, n) * (rng.random(n) < 0.3)
    llm = rng.lognormal(0, 0.5, n)
    costs = np.stack([vision, audio, llm], axis=1)
    bound = np.maximum(costs.sum(0) / k, costs.max(0))

    def worst(mbs):
        return max((np.array([costs[mb].sum(0) for mb in mbs]).max(0) / bound))

    ours = worst(assign_microbatches(costs, k))
    sequential = worst([list(range(i * n // k, (i + 1) * n // k)) for i in range(k)])
    assert ours < 1.1 and ours < sequential / 1.5
