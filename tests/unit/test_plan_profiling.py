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


def test_a_scenarios_memory_batches_are_the_heaviest_of_a_larger_draw() -> None:
    """The batches a plan must fit memory on are the heaviest of MEMORY_POOL times as many drawn:
    the most LLM tokens first, then each module's heaviest in turn; the drawn batches come first,
    as before, and only they make the profile's means."""
    from harmonia.plan.profiling import MEMORY_POOL
    from harmonia.plan.scenario import Scenario, ScenarioRun

    scenario = Scenario("m", "omni-8b", "h100:1x8", "synthetic", 32, iterations=3, search_batches=2, memory_batches=4)
    run = ScenarioRun(scenario)
    cost, samples = run.cost, run.samples
    drawn = profile_batches(samples, cost, 32, 5 + MEMORY_POOL * 4, seed=0)
    prof = run.profile
    assert prof.batches.shape == (9, 32) and prof.drawn == 5
    assert np.array_equal(prof.batches[:5], drawn.batches[:5])
    pool = drawn.batch_tokens[5:]
    llm, vision = cost.modules.index("llm"), cost.modules.index("vision")
    assert prof.batch_tokens[5, llm] == pool[:, llm].max()  # the most LLM tokens
    assert prof.batch_tokens[6, vision] == max(t for k, t in enumerate(pool[:, vision])
                                               if not np.array_equal(drawn.batches[5 + k], prof.batches[5]))
    heavier = prof.batch_tokens[5:, llm].mean() > drawn.batch_tokens[5:, llm].mean()
    assert heavier and len({tuple(b) for b in prof.batches[5:]}) == 4
    assert prof.mean_costs()["llm"] == pytest.approx(drawn.batch_costs[:5, llm].mean())
    assert prof.sample_load("llm").tokens == int(drawn.batch_tokens[:5, llm].mean() / 32)
