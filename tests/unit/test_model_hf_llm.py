"""Llama / Mistral / Qwen2 / Qwen3 checkpoints against `transformers`, strict config reading, windows.

Each family is a tiny random-weight transformers model (fp32, eager attention) exercising what sets
it apart: Llama 3.1 RoPE scaling over a sequence longer than its original context with offset
positions, linear scaling with biases, Mistral's and Qwen2's sliding windows shorter than the
sequence, Qwen3's per-head q/k norms. Ours must give transformers' logits in one piece, as two
pipeline stages, and after saving and reloading in transformers.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harmonia.errors import ConfigError
from harmonia.model.attention_mask import TokenLayout, multimodal_mask
from harmonia.model.hf.llama import load_hf_llm, save_hf_llm
from harmonia.model.hf.llama_config import DEFAULTS, llm_config_to_hf, llm_spec_from_hf
from harmonia.model.layers import rope_inv_freq
from harmonia.model.llm import build_llm

TOL = {"atol": 1e-5, "rtol": 1e-5}
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def _randomize(model: torch.nn.Module) -> None:
    """Non-trivial norms and biases too, so that a swapped or dropped tensor shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 and p.numel() == p.shape[0] else 0.0))


FAMILIES = {
    "llama3-rope": (lambda: transformers.LlamaConfig(
        **SIZES, num_hidden_layers=3, head_dim=16, max_position_embeddings=256, rope_theta=500.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}), 40, 9),
    "llama-linear-bias-tied": (lambda: transformers.LlamaConfig(
        **SIZES, num_hidden_layers=3, rope_scaling={"rope_type": "linear", "factor": 4.0}, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True), 30, 3),
    "mistral-window": (lambda: transformers.MistralConfig(
        **SIZES, num_hidden_layers=3, sliding_window=5), 24, 0),
    "qwen2-window-upper-layers": (lambda: transformers.Qwen2Config(
        **SIZES, num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2,
        rope_theta=1e6, tie_word_embeddings=True), 20, 0),
    "qwen3": (lambda: transformers.Qwen3Config(
        **SIZES, num_hidden_layers=3, head_dim=12, tie_word_embeddings=True), 17, 2),
}


def _inputs(config, length: int, offset: int) -> tuple[torch.Tensor, TokenLayout]:
    ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    layout = TokenLayout.from_segments([[("text", length)]])
    layout = dataclasses.replace(layout, position=layout.position + offset)
    return ids, layout


def _hf_checkpoint(family: str, path) -> tuple[object, torch.nn.Module]:
    make, _, _ = FAMILIES[family]
    config = make()
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    _randomize(hf)
    hf.save_pretrained(path)
    return config, hf


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers_in_stages_and_round_trips(family, tmp_path):
    config, hf = _hf_checkpoint(family, tmp_path / "hf")
    _, length, offset = FAMILIES[family]
    ids, layout = _inputs(config, length, offset)
    args = (layout.position[None], multimodal_mask(layout))
    with torch.no_grad():
        want = hf(ids, position_ids=layout.position[None]).logits
        ours = load_hf_llm(tmp_path / "hf").eval()
        torch.testing.assert_close(ours(ids, *args), want, **TOL)
        n = config.num_hidden_layers
        k = n - 1  # Qwen2: the cut falls between two sliding-window layers
        first, last = load_hf_llm(tmp_path / "hf", layers=(0, k)), load_hf_llm(tmp_path / "hf", layers=(k, n))
        torch.testing.assert_close(last(first(ids, *args), *args), want, **TOL)
    save_hf_llm(ours, tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert again.config.model_type == config.model_type
    with torch.no_grad():
        torch.testing.assert_close(again(ids, position_ids=layout.position[None]).logits, want, **TOL)


@pytest.mark.parametrize("family", ["llama3-rope", "llama-linear-bias-tied", "mistral-window",
                                    "qwen2-window-upper-layers"])
def test_the_feature_changes_the_logits(family, tmp_path):
    """Without its scaling or window, each family's checkpoint gives other logits (the tests can fail)."""
    config, hf = _hf_checkpoint(family, tmp_path / "hf")
    _, length, offset = FAMILIES[family]
    ids, layout = _inputs(config, length, offset)
    ours = load_hf_llm(tmp_path / "hf").eval()
    spec = ours.spec
    plain = dataclasses.replace(spec, rope_scaling=None, body=dataclasses.replace(
        spec.body, sliding_window=None, window_layers=None))
    assert plain != spec
    other = build_llm(plain).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        a = ours(ids, layout.position[None], multimodal_mask(layout))
        b = other(ids, layout.position[None], multimodal_mask(layout))
    assert (a - b).abs().max() > 1e-3


def test_spec_reads_windows_and_rope():
    qwen2 = llm_spec_from_hf(FAMILIES["qwen2-window-upper-layers"][0]().to_dict())
    assert (qwen2.body.sliding_window, qwen2.body.window_layers) == (4, (2, 3))
    assert [qwen2.body.window_of(i) for i in range(4)] == [None, None, 4, 4]
    mistral = llm_spec_from_hf(FAMILIES["mistral-window"][0]().to_dict())
    assert mistral.body.window_of(0) == mistral.body.window_of(2) == 5
    llama = llm_spec_from_hf(FAMILIES["llama3-rope"][0]().to_dict())
    assert llama.rope_scaling.kind == "llama3" and llama.rope_scaling.original_max_positions == 16
    assert llama.rope_theta == 500.0
    qwen3 = llm_spec_from_hf(FAMILIES["qwen3"][0]().to_dict())
    assert qwen3.body.qk_norm_per_head and qwen3.body.dim_head == 12 and not qwen3.body.qkv_bias


def test_inverse_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for rope in ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
                 {"rope_type": "linear", "factor": 2.5}):
        config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_theta=500000.0,
                                          max_position_embeddings=131072, rope_scaling=dict(rope))
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
        spec = llm_spec_from_hf(config.to_dict())
        got = rope_inv_freq(64, spec.rope_theta, spec.rope_scaling)
        assert torch.equal(got, want), rope["rope_type"]


def test_rope_scaling_under_either_key_and_old_type_name():
    base = {"model_type": "llama", **SIZES, "num_hidden_layers": 1, "rope_theta": 77.0}
    old = llm_spec_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = llm_spec_from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    assert old == new and old.rope_scaling.factor == 2.0 and old.rope_theta == 77.0
    inner = llm_spec_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}})
    assert inner.rope_theta == 5.0 and inner.rope_scaling is None
    with pytest.raises(ConfigError, match="both rope_scaling"):
        llm_spec_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0},
                          "rope_parameters": {"rope_type": "linear", "factor": 3.0}})


def test_fields_real_checkpoints_carry_load():
    """Keys of published Llama 2 / 3.1, Mistral 7B v0.1, Qwen2.5 (R1 distill) and Qwen3 config.json files."""
    llama31 = _llama(pretraining_tp=1, torch_dtype="bfloat16", transformers_version="4.43.0.dev0", use_cache=True,
                     bos_token_id=128000, eos_token_id=[128001, 128008, 128009], initializer_range=0.02,
                     max_position_embeddings=131072, attention_bias=False, attention_dropout=0.0, mlp_bias=False,
                     architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                     rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    assert llm_spec_from_hf(llama31).rope_scaling.original_max_positions == 8192
    qwen = {"model_type": "qwen2", **SIZES, "num_hidden_layers": 2, "use_mrope": False, "sliding_window": 4096,
            "use_sliding_window": False, "max_window_layers": 28, "rope_theta": 10000, "tie_word_embeddings": False,
            "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16", "use_cache": True}
    assert llm_spec_from_hf(qwen).body.sliding_window is None
    mistral = {"model_type": "mistral", **SIZES, "num_hidden_layers": 2, "sliding_window": 4096,
               "max_position_embeddings": 32768, "rope_theta": 10000.0}
    assert llm_spec_from_hf(mistral).body.window_of(1) == 4096
    qwen3 = {"model_type": "qwen3", **SIZES, "num_hidden_layers": 2, "head_dim": 128, "rope_scaling": None,
             "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36, "attention_bias": False}
    assert llm_spec_from_hf(qwen3).body.dim_head == 128


@pytest.mark.parametrize("cls, kw", [("LlamaConfig", {}), ("MistralConfig", {}), ("Qwen2Config", {}),
                                     ("Qwen3Config", {}), ("Qwen2Config", {"use_sliding_window": True}),
                                     ("Qwen3Config", {"use_sliding_window": True})])
def test_default_configs_transformers_writes_load(cls, kw, tmp_path):
    config = getattr(transformers, cls)(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100, **kw)
    config.save_pretrained(tmp_path)
    spec = llm_spec_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert spec.body.n_layers == 2 and spec.vocab_size == 100
    text = transformers.LlavaConfig(text_config=config).to_dict()["text_config"]  # as an MLLM nests it
    assert llm_spec_from_hf(text) == spec


@pytest.mark.parametrize("kind", sorted(DEFAULTS))
def test_defaults_are_transformers_defaults(kind):
    cls = transformers.AutoConfig.for_model(kind).__class__
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, value in DEFAULTS[kind].items():
        assert fields[name] == value, f"{kind}.{name}"
    for name, value in {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False}.items():
        assert fields[name] == value, f"{kind}.{name}"
    assert cls.default_theta == 10000.0


def _llama(**extra) -> dict:
    return {"model_type": "llama", **SIZES, "num_hidden_layers": 2, **extra}


@pytest.mark.parametrize("extra, named", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "rope_scaling.rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}}, "rope_scaling.beta_fast"),
    ({"attn_logit_softcapping": 50.0}, "config field attn_logit_softcapping of model_type llama"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "config field quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"sliding_window": 8}, "config field sliding_window of model_type llama"),
])
def test_llama_refusals_name_the_field(extra, named):
    with pytest.raises(ConfigError) as e:
        llm_spec_from_hf(_llama(**extra))
    assert named in str(e.value)


@pytest.mark.parametrize("config, named", [
    ({"model_type": "qwen2", "mlp_bias": True}, "config field mlp_bias of model_type qwen2"),
    ({"model_type": "mistral", "layer_types": ["full_attention"] * 2},
     "config field layer_types of model_type mistral"),
    ({"model_type": "qwen2", "layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
    ({"model_type": "qwen3", "use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types="),
    ({"model_type": "qwen2", "use_mrope": True}, "use_mrope=True"),
    ({"model_type": "gemma2"}, "model_type='gemma2'"),
    ({"model_type": "llama", "hidden_size": None}, "lacks ['hidden_size']"),
])
def test_family_refusals_name_the_field(config, named):
    with pytest.raises(ConfigError) as e:
        llm_spec_from_hf({**SIZES, "num_hidden_layers": 2, **config})
    assert named in str(e.value)


def test_export_writes_what_transformers_needs():
    qwen2 = llm_spec_from_hf(FAMILIES["qwen2-window-upper-layers"][0]().to_dict())
    config = llm_config_to_hf(qwen2)
    assert config["use_sliding_window"] and config["sliding_window"] == 4 and config["max_window_layers"] == 2
    assert config["layer_types"] == ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert llm_spec_from_hf(config) == dataclasses.replace(qwen2, name="qwen2")
    llama = llm_spec_from_hf(FAMILIES["llama3-rope"][0]().to_dict())
    back = llm_spec_from_hf(llm_config_to_hf(llama))
    assert back.rope_scaling == llama.rope_scaling and back.rope_theta == llama.rope_theta
    odd = dataclasses.replace(qwen2, body=dataclasses.replace(qwen2.body, qkv_bias=False))
    with pytest.raises(ConfigError, match="no HF model type"):
        llm_config_to_hf(odd)  # a window on some layers only exists in Qwen2/Qwen3 (q/k/v biases or qk-norm)


def test_tied_head_of_a_last_stage_is_a_copy_of_the_embedding(tmp_path):
    config, _ = _hf_checkpoint("qwen3", tmp_path / "hf")
    whole = load_hf_llm(tmp_path / "hf")
    first, last = load_hf_llm(tmp_path / "hf", layers=(0, 1)), load_hf_llm(tmp_path / "hf", layers=(1, 3))
    assert whole.tied_weight() is None and whole.head is None
    assert last.head is None and torch.equal(last.tied_weight(), first.tied_weight())
    assert "embed.weight" in last.state_dict() and "head.weight" not in last.state_dict()
    middle = build_llm(whole.spec, (1, 2))
    assert middle.tied_weight() is None and middle.embed is None
