"""Batch-level profiling: batch sums, and ratios that concentrate as the batch grows."""

import numpy as np
import pytest

from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from harmonia.plan.profiling import profile_batches
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset
from harmonia.workload.traces import read_trace, synthesize_trace


def test_batch_costs_are_sums_of_sample_costs() -> None:
    cost = CostModel(mllm_preset("omni-8b"), device_preset("h100"))
    samples = synthesize_trace(300, seed=1)
    prof = profile_batches(samples, cost, global_batch=32, n_batches=12, seed=0)
    per_sample = cost.sample_costs(samples)
    assert prof.batch_costs.shape == (12, 5)
    for k in (0, 11):
        assert len(set(prof.batches[k])) == 32
        assert np.allclose(prof.batch_costs[k], per_sample[prof.batches[k]].sum(axis=0))
    assert prof.sample_load("llm").tokens > 0


def test_ratio_cv_shrinks_with_the_global_batch(shared_traces) -> None:
    cost = CostModel(mllm_preset("internvl-8b", training={"vision": "frozen"}), device_preset("h100"))
    samples = read_trace(shared_traces / "ai2d.csv")
    vision = cost.modules.index("vision")
    cv = [profile_batches(samples, cost, b, 32, seed=0).ratio_cv()[vision] for b in (4, 64, 1024)]
    assert cv[0] > 2 * cv[1] > 4 * cv[2]


def test_bad_profile_requests() -> None:
    cost = CostModel(mllm_preset("tiny-vlm"), device_preset("cpu"))
    with pytest.raises(ConfigError, match="exceeds the trace"):
        profile_batches(synthesize_trace(10), cost, 11)
