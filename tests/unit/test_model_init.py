"""Initial values one tensor at a time: the constructors' rules, the same under any stage split,
and a model built on ``meta`` filled from them."""

import dataclasses

import pytest
import torch

from harmonia.errors import ConfigError
from harmonia.model.init import initial_value
from harmonia.model.mllm import build_module, build_mllm_model
from harmonia.model.presets import mllm_preset
from harmonia.runtime.materialize import materialize
from harmonia.train.weights import chunk_values, initial_model, initial_state


def varied_spec(training: dict[str, str] | None = None):
    """tiny-omni with layer scales in the vision tower, LLaVA-NeXT's newline and tied embeddings."""
    spec = mllm_preset("tiny-omni", training)
    vision = spec.encoders["vision"]
    vision = dataclasses.replace(vision, body=dataclasses.replace(vision.body, layer_scale=True))
    proj = dataclasses.replace(spec.projectors["vision_proj"], newline=True)
    llm = dataclasses.replace(spec.llm, tie_embeddings=True)
    return dataclasses.replace(spec, encoders={**spec.encoders, "vision": vision},
                               projectors={**spec.projectors, "vision_proj": proj}, llm=llm)


@pytest.mark.parametrize("training", [None, {"llm": "lora", "vision": "frozen"}])
def test_every_parameter_follows_its_constructors_rule(training) -> None:
    torch.manual_seed(0)
    built = build_mllm_model(varied_spec(training))
    for name, made in built.named_parameters():
        rule = initial_value(built, name, seed=3, full_name=name)
        assert rule.shape == made.shape, name
        made = made.detach()
        if bool((made == made.flatten()[0]).all()):
            assert torch.equal(rule, made), f"{name}: a constant the rule does not give"
            continue
        assert not bool((rule == rule.flatten()[0]).all()), name
        assert abs(float(rule.std() / made.std()) - 1) < 0.3, f"{name}: std {rule.std():.4f} vs {made.std():.4f}"
        assert float(rule.abs().max()) <= 6 * float(made.std()) + 1e-6 or "newline" in name, name
        if ".lora_a." in name:
            assert float(rule.abs().max()) <= float(made.abs().max()) * 1.05, name


def test_a_stage_chunk_gets_the_whole_models_values() -> None:
    spec = varied_spec({"llm": "lora"})
    whole = initial_state(spec, seed=5)
    with torch.device("meta"):
        chunk = build_module(spec, "llm", (2, 4))
    from harmonia.model.lora import apply_training

    apply_training(chunk, spec.training_of("llm"))
    materialize(chunk, torch.device("cpu"), chunk_values(chunk, spec, "llm", seed=5))
    state = chunk.state_dict()
    assert "embed.weight" in state  # the tied head's own copy
    for key, t in state.items():
        torch.testing.assert_close(t, whole["llm." + key], rtol=0, atol=0)
    other = initial_state(spec, seed=6)
    assert not torch.equal(other["llm.layers.2.attn.q_proj.base.weight"], whole["llm.layers.2.attn.q_proj.base.weight"])


def test_a_parameter_without_a_rule_is_an_error() -> None:
    module = torch.nn.Module()
    module.odd = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="no initial value rule for parameter 'odd'"):
        initial_value(module, "odd", 0, "x.odd")
