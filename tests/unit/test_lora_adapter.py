"""LoRA settings (rank, alpha, dropout, targets per module) and the PEFT adapter export: peft loads the
adapter (and a fully trained projector as a module to save) onto the base checkpoint and computes
harmonia's logits; what an adapter cannot hold is refused."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from harmonia.config import load_config  # noqa: E402
from harmonia.errors import ConfigError  # noqa: E402
from harmonia.model.batch import pack_samples  # noqa: E402
from harmonia.model.families.llava import tokenized_sample  # noqa: E402
from harmonia.model.hf.adapter import export_peft_adapter  # noqa: E402
from harmonia.model.hf.mllm import mllm_spec_from_hf  # noqa: E402
from harmonia.model.lora import LoRALinear  # noqa: E402
from harmonia.model.mllm import build_mllm_model  # noqa: E402
from harmonia.model.training_mode import ModuleTraining  # noqa: E402
from harmonia.train.planning import model_spec  # noqa: E402
from tests.unit.test_model_hf_llava import load_whole, make_llava, sample_inputs  # noqa: E402

LLM_LORA = ModuleTraining("lora", lora_rank=4, lora_alpha=8.0, lora_dropout=0.1, lora_targets=("q_proj", "v_proj"))
VISION_LORA = ModuleTraining("lora", lora_rank=2, lora_alpha=6.0, lora_targets=("fc1",))


def trained(path, training: dict):
    """The checkpoint's spec and model with ``training``, every adapter's B non-zero (as after training)."""
    spec = mllm_spec_from_hf(path).with_training(**training)
    base = load_whole(path, mllm_spec_from_hf(path))
    model = build_mllm_model(spec).eval()
    mapped = {k: base.state_dict()[state_key] for k, state_key in
              ((k, k.replace(".base.", ".")) for k in model.state_dict()) if state_key in base.state_dict()}
    model.load_state_dict({**model.state_dict(), **mapped})
    torch.manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.normal_(0, 0.2)
    return spec, model


def test_peft_loads_the_adapter_with_harmonias_logits(tmp_path):
    hf = make_llava(tmp_path / "hf")
    spec, model = trained(tmp_path / "hf", {"vision": VISION_LORA, "vision_proj": "frozen", "llm": LLM_LORA})
    out = export_peft_adapter(model.state_dict(), spec, tmp_path / "hf", tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["rank_pattern"] and config["lora_dropout"] == 0.1
    assert all(p.endswith(("q_proj", "v_proj", "fc1")) for p in config["target_modules"])
    ids, pixels, _ = sample_inputs(spec)
    with torch.no_grad():
        base = hf(input_ids=ids[None], pixel_values=pixels).logits
        want = peft.PeftModel.from_pretrained(hf, out).eval()(input_ids=ids[None], pixel_values=pixels).logits
        got = model(pack_samples([tokenized_sample(spec, ids, pixels)]))
    assert not torch.allclose(got, base, atol=1e-3), "the adapters change the logits"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_fully_trained_projector_goes_in_the_adapter_as_a_module_to_save(tmp_path):
    """LoRA on the LLM with the projector trained fully (the usual LLaVA recipe): the adapter lists the
    projector in ``modules_to_save`` with its trained tensors, and peft computes harmonia's logits on an
    image sample (through the trained projector)."""
    hf = make_llava(tmp_path / "hf")
    spec, model = trained(tmp_path / "hf", {"vision": "frozen", "llm": LLM_LORA})
    source = {k: v.clone() for k, v in model.projectors.state_dict().items()}
    with torch.no_grad():
        for p in model.projectors.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    out = export_peft_adapter(model.state_dict(), spec, tmp_path / "hf", tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["model.multi_modal_projector"]
    ids, pixels, _ = sample_inputs(spec)
    with torch.no_grad():
        base = hf(input_ids=ids[None], pixel_values=pixels).logits
        adapted = peft.PeftModel.from_pretrained(hf, out).eval()
        want = adapted(input_ids=ids[None], pixel_values=pixels).logits
        got = model(pack_samples([tokenized_sample(spec, ids, pixels)]))
        model.projectors.load_state_dict(source)
        untrained_projector = model(pack_samples([tokenized_sample(spec, ids, pixels)]))
    assert not torch.allclose(untrained_projector, got, atol=1e-3), "the trained projector changes the logits"
    assert not torch.allclose(want, base, atol=1e-3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_fully_trained_llm_is_saved_as_its_modules_beside_a_lora_tower(tmp_path):
    """The LLM trained fully, the tower through LoRA: the LLM's tensors fill two transformers modules
    (the language model and the head beside it), both saved; peft computes harmonia's logits."""
    hf = make_llava(tmp_path / "hf")
    spec, model = trained(tmp_path / "hf", {"vision": VISION_LORA, "vision_proj": "frozen"})
    with torch.no_grad():
        for p in model.llm.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    out = export_peft_adapter(model.state_dict(), spec, tmp_path / "hf", tmp_path / "adapter")
    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == [
        "lm_head", "model.language_model"]
    ids, pixels, _ = sample_inputs(spec)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(hf, out).eval()(input_ids=ids[None], pixel_values=pixels).logits
        got = model(pack_samples([tokenized_sample(spec, ids, pixels)]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_modules_to_save_cover_exactly_the_trained_tensors():
    from harmonia.model.hf.adapter import _covering_modules

    meta = dict.fromkeys(["a.b.w", "a.b.bias", "a.c.w", "head.w", "x.y.w"])
    assert _covering_modules({"a.b.w", "a.b.bias", "a.c.w", "head.w"}, meta) == ["a", "head"]
    assert _covering_modules({"a.b.w", "a.b.bias"}, meta) == ["a.b"]
    assert _covering_modules({"a.b.w"}, meta) is None  # its module holds an untrained bias too


def test_what_an_adapter_cannot_hold_is_refused(tmp_path):
    make_llava(tmp_path / "hf")
    spec, model = trained(tmp_path / "hf", {"vision": "frozen", "vision_proj": "frozen"})
    with pytest.raises(ConfigError, match="without LoRA"):
        export_peft_adapter(model.state_dict(), spec, tmp_path / "hf", tmp_path / "b")


def test_lora_settings_from_the_config(tmp_path):
    make_llava(tmp_path / "hf")
    config = load_config(None, [f"--model.hf={tmp_path / 'hf'}", "--model.lora=llm", "--model.lora_alpha=16",
                                "--model.lora_dropout=0.05", "--model.lora_targets=q_proj,v_proj",
                                "--model.frozen=vision,vision_proj"])
    got = model_spec(config).training_of("llm")
    assert (got.lora_rank, got.lora_alpha, got.lora_dropout, got.lora_targets) == (8, 16.0, 0.05, ("q_proj", "v_proj"))
    model = build_mllm_model(model_spec(config))
    adapted = [n for n, m in model.llm.named_modules() if isinstance(m, LoRALinear)]
    assert adapted and all(n.endswith(("q_proj", "v_proj")) for n in adapted)
    assert model.llm.layers["0"].attn.q_proj.scale == 2.0
    with pytest.raises(ConfigError, match=r"LoRA targets \['qkv'\] match no linear"):
        model_spec(load_config(None, [f"--model.hf={tmp_path / 'hf'}", "--model.lora=llm",
                                      "--model.lora_targets=qkv,q_proj"]))
    with pytest.raises(ConfigError, match="model.lora_modules.vision"):
        load_config(None, ["--model.lora=llm", '--model.lora_modules={"vision": {"rank": 2}}'])
