"""Stage partitioning: exact against brute force, frozen-aware, memory caps."""

import itertools

import numpy as np
import pytest

from harmonia.errors import LayoutError
from harmonia.model.presets import mllm_preset
from harmonia.plan.partition import layer_seconds, plan_module_stages, plan_stage_split
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset
from harmonia.workload.work import ModuleLoad


def brute_force(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_optimal_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    costs = list(rng.uniform(0.1, 3.0, size=int(rng.integers(4, 11))))
    k = int(rng.integers(1, min(5, len(costs)) + 1))
    split = plan_stage_split(costs, k)
    assert sum(split) == len(costs) and len(split) == k and min(split) >= 1
    bounds = np.cumsum((0, *split))
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == pytest.approx(brute_force(costs, k))


def test_memory_cap_is_respected_and_reported() -> None:
    costs = [1.0] * 6
    split = plan_stage_split(costs, 2, memory=[5, 1, 1, 1, 1, 1], memory_cap=6)
    assert split[0] <= 2
    with pytest.raises(LayoutError, match="more pipeline stages"):
        plan_stage_split(costs, 2, memory=[3] * 6, memory_cap=8)
    with pytest.raises(LayoutError, match="at most 3 stages"):
        plan_stage_split([1, 1, 1], 4)


def test_frozen_layers_weigh_less_so_frozen_stages_hold_more() -> None:
    h100 = device_preset("h100")
    load = ModuleLoad(8192, 8192 * 4096, 1)
    trainable = CostModel(mllm_preset("internvl-8b"), h100)
    # frozen LLM behind a trainable projector: B but no W on every block
    frozen = CostModel(mllm_preset("internvl-8b", training={"vision": "frozen", "llm": "frozen"}), h100)
    t, f = layer_seconds(trainable, "llm", load), layer_seconds(frozen, "llm", load)
    assert f[5] < t[5]
    split = plan_module_stages(trainable, "llm", load, 4)
    assert sum(split) == len(trainable.layers["llm"])
    # the head (a 3584 x 152064 matmul) is heavy: the last stage holds fewer blocks
    assert split[-1] < split[1]
