"""Modality sub-microbatches: every item once, target respected, order restored."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmonia.errors import ScheduleError
from harmonia.schedule import plan_submicrobatches

item_costs = st.lists(st.floats(0.0, 10.0), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(costs=item_costs, n_sub=st.integers(1, 8), contiguous=st.booleans())
def test_every_item_once_and_order_restored(costs, n_sub, contiguous) -> None:
    costs = np.array(costs)
    split = plan_submicrobatches(costs, n_sub=n_sub, contiguous=contiguous)
    flat = [i for g in split.groups for i in g]
    assert sorted(flat) == list(range(costs.size))
    assert 1 <= split.n_sub <= min(n_sub, costs.size)
    outputs = np.array(flat)  # each item's "output" is its own index
    assert outputs[split.restore].tolist() == list(range(costs.size))
    assert np.isclose(split.costs.sum(), costs.sum())
    if contiguous:
        assert flat == list(range(costs.size))
    else:
        assert list(split.costs) == sorted(split.costs)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=40), target=st.floats(1.0, 30.0))
def test_target_sets_the_count_and_pieces_stay_near_it(costs, target) -> None:
    costs = np.array(costs)
    split = plan_submicrobatches(costs, target=target)
    assert split.n_sub == min(costs.size, int(np.ceil(costs.sum() / target - 1e-9)))
    # LPT: no piece exceeds the mean piece by more than the largest item
    assert split.costs.max() <= costs.sum() / split.n_sub + costs.max() + 1e-9


def test_contiguous_split_is_optimal_on_a_small_case() -> None:
    split = plan_submicrobatches(np.array([3.0, 1.0, 2.0, 5.0, 1.0]), n_sub=2, contiguous=True)
    assert split.groups == [[0, 1, 2], [3, 4]]


def test_errors() -> None:
    with pytest.raises(ScheduleError, match="exactly one of target"):
        plan_submicrobatches(np.ones(3))
    with pytest.raises(ScheduleError, match="positive"):
        plan_submicrobatches(np.ones(3), target=0.0)
    with pytest.raises(ScheduleError, match="non-negative"):
        plan_submicrobatches(-np.ones(3), n_sub=1)
    assert plan_submicrobatches(np.zeros(0), n_sub=2).n_sub == 0


def test_encoder_item_costs_add_up_to_the_sample_costs() -> None:
    from harmonia.model.presets import mllm_preset
    from harmonia.schedule import encoder_item_costs
    from harmonia.workload.cost import CostModel
    from harmonia.workload.devices import device_preset
    from harmonia.workload.traces import synthesize_trace

    cost = CostModel(mllm_preset("tiny-omni"), device_preset("h100"))
    samples = synthesize_trace(40, seed=1)
    per_sample = cost.sample_costs(samples)
    for module in ("vision", "audio"):
        items, costs = encoder_item_costs(samples, cost, module)
        assert np.isclose(costs.sum(), per_sample[:, cost.modules.index(module)].sum())
        split = plan_submicrobatches(costs, n_sub=3)
        assert sorted(i for g in split.groups for i in g) == list(range(len(items)))
    with pytest.raises(ScheduleError, match="not an encoder"):
        encoder_item_costs(samples, cost, "llm")


def test_item_runs_cut_by_cost_in_order() -> None:
    from harmonia.schedule.submicrobatch import item_runs

    assert item_runs([5.0, 1.0, 1.0, 1.0], 2) == [(0, 1), (1, 4)]  # the heavy item alone
    assert item_runs([1.0] * 4, 2) == [(0, 2), (2, 4)]
    assert item_runs([1.0], 3) == [(0, 1), (1, 1), (1, 1)]  # fewer items than pieces: empty runs
    assert item_runs([], 2) == [(0, 0), (0, 0)]
    runs = item_runs(np.arange(1.0, 11.0), 3)
    assert runs[0][0] == 0 and runs[-1][1] == 10 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    assert max(np.arange(1.0, 11.0)[a:b].sum() for a, b in runs) <= 21  # the best 3-way cut of 1..10
    with pytest.raises(ScheduleError):
        item_runs([1.0], 0)


def test_one_sub_microbatch_is_every_item_in_order() -> None:
    from harmonia.schedule.submicrobatch import item_runs

    assert item_runs([3.0, 0.0, 2.0], 1) == [(0, 3)]
    assert item_runs([], 1) == [(0, 0)]
    assert plan_submicrobatches(np.array([3.0, 1.0, 0.0]), n_sub=1, contiguous=True).groups == [[0, 1, 2]]
