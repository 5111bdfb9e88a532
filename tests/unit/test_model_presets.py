"""Preset parameter counts against the published numbers, and spec validation."""

import pytest

from harmonia.errors import ConfigError
from harmonia.model.presets import ENCODERS, LLMS, MLLM_PRESETS, mllm_preset
from harmonia.model.spec import TransformerSpec


@pytest.mark.parametrize("name", [*ENCODERS, *LLMS])
def test_published_parameter_counts_within_two_percent(name: str) -> None:
    preset = {**ENCODERS, **LLMS}[name]
    assert abs(preset.spec.n_params() / preset.params - 1) <= 0.02, preset.source


def test_exact_counts_of_reference_checkpoints() -> None:
    # Counts of the HF checkpoints' state dicts.
    assert LLMS["llama3-8b"].spec.n_params() == 8_030_261_248
    assert LLMS["qwen2.5-7b"].spec.n_params() == 7_615_616_512
    assert ENCODERS["clip-vit-l-14-336"].spec.n_params() == 303_507_456


@pytest.mark.parametrize("name", list(MLLM_PRESETS))
def test_mllm_presets_assemble(name: str) -> None:
    mllm = mllm_preset(name)
    assert mllm.module_names[-1] == "llm"
    assert all(f"{e}_proj" in mllm.projectors for e in mllm.encoders)


def test_bad_specs_name_the_field() -> None:
    with pytest.raises(ConfigError, match="hidden=-4"):
        TransformerSpec(2, -4, 2, 8)
    with pytest.raises(ConfigError, match="n_kv_heads"):
        TransformerSpec(2, 48, 4, 96, n_kv_heads=3)
    with pytest.raises(ConfigError, match="unknown MLLM preset"):
        mllm_preset("nope")
    with pytest.raises(ConfigError, match="unknown modules"):
        mllm_preset("tiny-vlm", training={"speech": "frozen"})
    with pytest.raises(ValueError):
        mllm_preset("tiny-vlm", training={"vision": "half-frozen"})
