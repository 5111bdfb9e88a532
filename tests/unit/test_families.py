"""The model-family registry: one registration makes a family known to spec reading and loading."""

from __future__ import annotations

import pytest
import torch

from harmonia.errors import ConfigError
from harmonia.model.families import FAMILIES, Family, FamilyRegistry
from harmonia.model.families import llava as llava_family
from harmonia.model.hf.mllm import load_module_state, mllm_spec_from_hf
from harmonia.model.resolve import resolve_mllm
from tests.unit.test_model_hf_llava import load_whole, make_llava, sample_inputs


def test_the_registry_knows_each_family_once_and_names_the_refused_ones() -> None:
    assert FAMILIES.supported(True) == ("llava", "llava_next", "qwen2_5_vl", "qwen2_vl", "qwen3_vl")
    assert FAMILIES.supported(False) == ("llama", "mistral", "qwen2", "qwen3")
    with pytest.raises(ConfigError, match=r"qwen3_vl_moe.*Qwen3-VL-MoE \(a mixture-of-experts"):
        FAMILIES.of("qwen3_vl_moe", "ckpt")
    with pytest.raises(ConfigError, match=r"model_type='idefics3' is neither a supported multimodal checkpoint"):
        FAMILIES.of("idefics3", "ckpt")
    assert FAMILIES.is_multimodal("llava_next") and FAMILIES.is_multimodal("qwen3_vl_moe")
    assert not FAMILIES.is_multimodal("qwen2") and not FAMILIES.is_multimodal("siglip")
    registry = FamilyRegistry()
    registry.register(llava_family.LLAVA)
    with pytest.raises(ValueError, match="twice"):
        registry.register(Family("again", ("llava",), llava_family.llava_spec_from_hf))


def test_one_registration_makes_a_family_read_and_loaded(tmp_path, monkeypatch) -> None:
    """With only the LLM family registered a LLaVA checkpoint is refused; one `register` line later
    its spec, module names and weights are read as before."""
    from harmonia.model.families.llm import LLM

    make_llava(tmp_path / "hf")
    reference = mllm_spec_from_hf(tmp_path / "hf")
    registry = FamilyRegistry()
    registry.register(LLM)
    monkeypatch.setattr(FAMILIES, "_by_type", registry._by_type)
    with pytest.raises(ConfigError, match=r"model_type='llava' is neither a supported multimodal checkpoint \(\)"):
        resolve_mllm(str(tmp_path / "hf"))
    registry.register(llava_family.LLAVA)
    spec = resolve_mllm(str(tmp_path / "hf"))
    assert spec == reference
    model = load_whole(tmp_path / "hf", spec)  # every module's tensors through the family's names
    projector = model.module("vision_proj").state_dict()
    state = load_module_state(tmp_path / "hf", spec, "vision_proj", None, set(projector))
    assert set(state) == set(projector) and all(torch.equal(state[k], v) for k, v in projector.items())
    ids, pixels, _ = sample_inputs(spec)
    assert [len(x.inputs) for x in llava_family.tokenized_sample(spec, ids, pixels).items] == [1, 1]
