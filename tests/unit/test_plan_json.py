"""Plans: JSON round trip and validation against a model."""

import pytest

from harmonia.errors import ConfigError, LayoutError
from harmonia.model.presets import mllm_preset
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan


def disjoint_plan(**kw) -> Plan:
    layouts = {"vision": Layout(dp=2, rank_offset=0), "audio": Layout(dp=1, rank_offset=2),
               "llm": Layout(tp=1, dp=1, pp=2, rank_offset=3, stage_layers=(1, 3))}
    return Plan("tiny-omni", layouts, "disjoint", "1f1b", n_microbatches=4, global_batch=16, **kw)


def test_round_trip() -> None:
    plan = disjoint_plan(training={"vision": "frozen"}, recompute=("llm",))
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.world_size == 5
    plan.validate(mllm_preset("tiny-omni"))


def test_validation_errors_say_what_to_change() -> None:
    mllm = mllm_preset("tiny-omni")
    with pytest.raises(ConfigError, match="one layout per encoder"):
        Plan("tiny-omni", {"llm": Layout(dp=2)}).validate(mllm)
    bad = Plan("tiny-omni", {"vision": Layout(dp=2), "audio": Layout(rank_offset=2), "llm": Layout(dp=2)},
               "disjoint", global_batch=16)
    with pytest.raises(LayoutError, match="share ranks"):
        bad.validate(mllm)
    colo = Plan("tiny-omni", {"vision": Layout(dp=2, rank_offset=1), "audio": Layout(), "llm": Layout(dp=2)},
                "colocated", global_batch=16)
    with pytest.raises(LayoutError, match="not all LLM ranks"):
        colo.validate(mllm)
    with pytest.raises(ConfigError, match="global_batch=4 is smaller"):
        Plan("tiny-omni", {"llm": Layout(dp=2)}, n_microbatches=4, global_batch=4)
    with pytest.raises(ConfigError, match="schedule"):
        Plan("tiny-omni", {"llm": Layout()}, schedule="2f2b")
    with pytest.raises(LayoutError, match="stage chunks for 4 layers"):
        Plan("tiny-omni", {"vision": Layout(), "audio": Layout(), "llm": Layout(pp=5)}, "colocated",
             global_batch=64).validate(mllm)
    with pytest.raises(ConfigError, match="harmonia plan"):
        Plan.from_json("{}")
