"""LLaVA checkpoints and compositions against `transformers` (fp32, tiny random-weight models saved to tmp_path)."""

import json

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from harmonia.errors import ConfigError, SampleError
from harmonia.model.batch import pack_samples
from harmonia.model.hf.lazy import LazyTensors
from harmonia.model.families.llava import tokenized_sample
from harmonia.model.hf.mllm import export_hf, load_module_state, mllm_spec_from_hf
from harmonia.model.hf.siglip import load_hf_siglip
from harmonia.model.lora import apply_lora
from harmonia.model.mllm import MLLM, build_module, encode_media
from harmonia.model.training_mode import ModuleTraining
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset
from tests.unit._hf_load import load_cleanly

TOL = {"atol": 1e-5, "rtol": 1e-5}
IMAGE = 95
VISION = {
    "clip": lambda: transformers.CLIPVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                                                  num_attention_heads=4, image_size=16, patch_size=4),
    "siglip": lambda: transformers.SiglipVisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                                                      num_attention_heads=4, image_size=16, patch_size=4),
}
TEXT = {
    "llama": lambda: transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0),
    "qwen2": lambda: transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
}
# (vision, text, vision_feature_layer, strategy)
CASES = [("clip", "llama", -2, "default"), ("clip", "llama", [-2, -1], "full"),
         ("siglip", "qwen2", -2, "full"), ("siglip", "qwen2", [-2, -1], "default"),
         ("clip", "llama", [0, -2], "default"), ("siglip", "qwen2", [-1, 0], "full")]  # 0: embeddings (pre-normed)


def _randomize(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial norms and biases too, so that a swapped or dropped tensor shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))


def make_llava(path, vision="clip", text="llama", layer=-2, strategy="default", **save):
    config = transformers.LlavaConfig(vision_config=VISION[vision](), text_config=TEXT[text](),
                                      image_token_index=IMAGE, vision_feature_layer=layer,
                                      vision_feature_select_strategy=strategy)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    _randomize(hf)
    hf.save_pretrained(path, **save)
    return hf


def load_whole(source, spec) -> MLLM:
    """The whole MLLM with every module's tensors from `load_module_state`."""
    model = MLLM(spec).eval()
    for name in spec.module_names:
        module = model.module(name)
        module.load_state_dict(load_module_state(source, spec, name, None, set(module.state_dict())), strict=True)
    return model


def sample_inputs(spec, seed=1, text=(3, 4, 2)):
    """input_ids with two images between text runs, pixel values, transformers-style labels."""
    g = torch.Generator().manual_seed(seed)
    n = spec.encoders["vision"].llm_tokens_per_tile()
    a, b, c = (torch.randint(0, IMAGE, (k,), generator=g) for k in text)
    ids = torch.cat([a, torch.full((n,), IMAGE), b, torch.full((n,), IMAGE), c])
    labels = ids.clone()
    labels[: len(ids) - len(c)] = -100  # loss on the answer only
    return ids, torch.randn(2, 3, 16, 16, generator=g), labels


@pytest.mark.parametrize("vision,text,layer,strategy", CASES)
def test_llava_logits_and_loss_match_transformers(vision, text, layer, strategy, tmp_path):
    hf = make_llava(tmp_path / "hf", vision, text, layer, strategy)
    spec = mllm_spec_from_hf(tmp_path / "hf")
    model = load_whole(tmp_path / "hf", spec)
    (ids, pixels, labels), (ids2, pixels2, _) = sample_inputs(spec, 1), sample_inputs(spec, 2, (5, 1, 3))
    with torch.no_grad():
        want = hf(input_ids=ids[None], pixel_values=pixels, labels=labels[None])
        want2 = hf(input_ids=ids2[None], pixel_values=pixels2).logits
        one = pack_samples([tokenized_sample(spec, ids, pixels, labels)])
        torch.testing.assert_close(model(one), want.logits, **TOL)
        torch.testing.assert_close(model.loss(one), want.loss, **TOL)
        # Two samples packed in one sequence compute what each does alone.
        packed = model(pack_samples([tokenized_sample(spec, ids, pixels), tokenized_sample(spec, ids2, pixels2)]))
        torch.testing.assert_close(packed, torch.cat([want.logits, want2], dim=1), **TOL)


def test_spec_describes_the_used_architecture(tmp_path):
    hf = make_llava(tmp_path / "hf", "clip", "llama", [-2, -1], "default")
    spec = mllm_spec_from_hf(tmp_path / "hf")
    enc, proj = spec.encoders["vision"], spec.projectors["vision_proj"]
    assert enc.body.n_layers == 3 and enc.feature_layers == (2, 3) and not enc.post_norm
    assert enc.out_dim == proj.in_dim == 2 * 24 and not proj.input_norm
    assert enc.llm_tokens_per_tile() == 16 and spec.item_attention == "causal"
    assert spec.item_token_ids == {"image": IMAGE}
    # The cost model counts exactly the parameters of the modules harmonia builds, and of transformers'
    # projector and language model.
    cost = CostModel(spec, device_preset("h100"))
    for name in spec.module_names:
        built = sum(p.numel() for p in build_module(spec, name).parameters())
        assert cost.param_count(name)[0] == built == spec.n_params()[name], name
    assert spec.n_params()["vision_proj"] == sum(p.numel() for p in hf.model.multi_modal_projector.parameters())
    text = sum(p.numel() for p in hf.model.language_model.parameters()) + hf.lm_head.weight.numel()
    assert spec.n_params()["llm"] == text
    truncated = make_llava(tmp_path / "minus2", "clip", "llama", -2, "default")
    enc = mllm_spec_from_hf(tmp_path / "minus2").encoders["vision"]
    tower = truncated.model.vision_tower
    unused = sum(p.numel() for p in [*tower.encoder.layers[-1].parameters(), *tower.post_layernorm.parameters()])
    assert enc.body.n_layers == 2 and enc.n_params() == sum(p.numel() for p in tower.parameters()) - unused


def test_item_attention_is_causal_for_llava(tmp_path):
    hf = make_llava(tmp_path / "hf")
    spec = mllm_spec_from_hf(tmp_path / "hf")
    model = load_whole(tmp_path / "hf", spec)
    ids, pixels, _ = sample_inputs(spec)
    sample = tokenized_sample(spec, ids, pixels)
    sample.causal_items = False
    with pytest.raises(SampleError, match="causal_items=True"):
        model(pack_samples([sample]))
    bidirectional = MLLM(spec.__class__(**{**spec.__dict__, "item_attention": "bidirectional"})).eval()
    bidirectional.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = hf(input_ids=ids[None], pixel_values=pixels).logits
        assert not torch.allclose(bidirectional(pack_samples([sample])), want, **TOL)


@pytest.mark.parametrize("layer,vision_split", [([-2, -1], 1), ([-3, -1], 2), ([0, -1], 2)])
def test_stages_built_from_load_module_state_match_transformers(layer, vision_split, tmp_path):
    hf = make_llava(tmp_path / "hf", "clip", "llama", layer, "default", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    spec = mllm_spec_from_hf(tmp_path / "hf")

    def stage(name, layers):
        module = build_module(spec, name, layers).eval()
        module.load_state_dict(load_module_state(tmp_path / "hf", spec, name, layers, set(module.state_dict())))
        return module

    n_vision = spec.encoders["vision"].body.n_layers
    vision = nn.Sequential(stage("vision", (0, vision_split)), stage("vision", (vision_split, n_vision)))
    projector = stage("vision_proj", None)
    llm = [stage("llm", (0, 1)), stage("llm", (1, 2))]
    ids, pixels, _ = sample_inputs(spec)
    batch = pack_samples([tokenized_sample(spec, ids, pixels)])
    with torch.no_grad():
        items = encode_media(vision, projector, batch.media["vision"])
        x = llm[0](batch.input_ids, batch.positions(), batch.mask(), items, batch.media["vision"].index)
        logits = llm[1](x, batch.positions(), batch.mask())
        torch.testing.assert_close(logits, hf(input_ids=ids[None], pixel_values=pixels).logits, **TOL)


class _Recorder:
    """A ``safetensors.safe_open`` that records every tensor read."""

    reads: list[str] = []

    def __init__(self, *args, **kwargs):
        from safetensors import _safetensors_rust

        self.f = _safetensors_rust.safe_open(*args, **kwargs)

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_slice(self, key):
        return self.f.get_slice(key)

    def get_tensor(self, key):
        _Recorder.reads.append(key)
        return self.f.get_tensor(key)


def test_load_module_state_reads_only_the_stage_tensors(tmp_path, monkeypatch):
    import safetensors

    make_llava(tmp_path / "hf", "clip", "llama", -2, "default", max_shard_size="40KB")
    spec = mllm_spec_from_hf(tmp_path / "hf")
    monkeypatch.setattr(safetensors, "safe_open", _Recorder)
    _Recorder.reads = []
    stage = build_module(spec, "llm", (1, 2))
    state = load_module_state(tmp_path / "hf", spec, "llm", (1, 2), set(stage.state_dict()))
    assert set(state) == set(stage.state_dict())
    assert len(_Recorder.reads) == len(state)
    assert all("layers.1." in k or k.endswith(("model.norm.weight", "lm_head.weight")) for k in _Recorder.reads)
    _Recorder.reads = []
    state = load_module_state(tmp_path / "hf", spec, "vision", (1, 2), {"layers.1.attn.q_proj.weight"})
    assert list(state) == ["layers.1.attn.q_proj.weight"]
    assert _Recorder.reads == ["vision_tower.encoder.layers.1.self_attn.q_proj.weight"]
    with pytest.raises(ConfigError, match="layers.0"):
        load_module_state(tmp_path / "hf", spec, "vision", (1, 2), {"layers.0.attn.q_proj.weight"})


def test_export_round_trip_merges_lora_and_copies_the_source_files(tmp_path):
    make_llava(tmp_path / "hf", "siglip", "qwen2", [-2, -1], "default")
    extras = {"tokenizer_config.json": '{"model_max_length": 64}', "chat_template.jinja": "{{ messages }}",
              "processor_config.json": '{"patch_size": 4}'}
    for name, text in extras.items():
        (tmp_path / "hf" / name).write_text(text)
    spec = mllm_spec_from_hf(tmp_path / "hf").with_training(llm=ModuleTraining("lora", lora_rank=4))
    model = load_whole(tmp_path / "hf", spec)
    apply_lora(model.llm, rank=4)
    _randomize(model.projectors, seed=3)  # "trained" weights differ from the source
    with torch.no_grad():
        for n, p in model.llm.named_parameters():
            if "lora_b" in n:
                p.normal_(std=0.05)
    state = model.state_dict()
    assert any(".lora_a." in k for k in state)
    base = state["llm.layers.0.attn.q_proj.base.weight"].clone()
    ids, pixels, _ = sample_inputs(spec)
    with torch.no_grad():
        want = model(pack_samples([tokenized_sample(spec, ids, pixels)]))
    export_hf(state, spec, tmp_path / "hf", tmp_path / "out", max_shard_bytes=64_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert all((tmp_path / "out" / n).read_text() == t for n, t in extras.items())
    again = load_cleanly(transformers.LlavaForConditionalGeneration, tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids[None], pixel_values=pixels).logits, want, **TOL)
    # The caller's state is not merged in place.
    torch.testing.assert_close(state["llm.layers.0.attn.q_proj.base.weight"], base, rtol=0, atol=0)
    export_hf(state, spec, tmp_path / "hf", tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    back = mllm_spec_from_hf(tmp_path / "bf16")
    assert load_module_state(tmp_path / "bf16", back, "vision_proj")["linears.0.weight"].dtype == torch.bfloat16


def _composition(tmp_path):
    llm = transformers.Qwen2ForCausalLM(TEXT["qwen2"]()).eval()
    vision = transformers.SiglipVisionModel(VISION["siglip"]()).eval()
    audio = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=48, decoder_ffn_dim=48, num_mel_bins=16, max_source_positions=25, vocab_size=64,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)).eval()
    for n, m in enumerate((llm, vision, audio)):
        _randomize(m, seed=n)
    for name, m in (("llm", llm), ("vision", vision), ("audio", audio)):
        m.save_pretrained(tmp_path / name)
    source = {"llm": str(tmp_path / "llm"), "encoders": {"vision": str(tmp_path / "vision"),
                                                          "audio": str(tmp_path / "audio")}}
    return source, llm, vision, audio


def test_composition_loads_its_parts_and_exports_them(tmp_path):
    source, llm, vision, audio = _composition(tmp_path)
    spec = mllm_spec_from_hf(source)
    assert set(spec.encoders) == {"vision", "audio"} and spec.item_attention == "bidirectional"
    assert load_module_state(source, spec, "vision_proj") == {}  # fresh projectors: the caller initialises them
    model = MLLM(spec).eval()
    for name in ("llm", "vision", "audio"):
        module = model.module(name)
        module.load_state_dict(load_module_state(source, spec, name, None, set(module.state_dict())), strict=True)
    ids, pixels, mel = torch.randint(0, 96, (1, 9)), torch.randn(2, 3, 16, 16), torch.randn(2, 16, 50)
    with torch.no_grad():
        torch.testing.assert_close(model.encoders["vision"](pixels), vision(pixel_values=pixels).last_hidden_state,
                                   **TOL)
        torch.testing.assert_close(model.encoders["audio"](mel), audio.get_encoder()(mel).last_hidden_state, **TOL)
        positions = torch.arange(9)[None]
        torch.testing.assert_close(model.llm(ids, positions, _causal(9)), llm(ids).logits, **TOL)
    apply_lora(model.encoders["vision"], rank=2)
    _randomize(model.encoders["vision"], seed=5)
    state = model.state_dict()
    with pytest.raises(ConfigError, match="LoRA adapters do not match"):
        export_hf(state, spec, source, tmp_path / "out")
    spec = spec.with_training(vision=ModuleTraining("lora", lora_rank=2))
    export_hf(state, spec, source, tmp_path / "out")
    with torch.no_grad():
        want_vision = model.encoders["vision"](pixels)
        got = load_cleanly(transformers.SiglipVisionModel, tmp_path / "out" / "vision")(pixel_values=pixels)
        torch.testing.assert_close(got.last_hidden_state, want_vision, **TOL)
        got = load_cleanly(transformers.WhisperForConditionalGeneration, tmp_path / "out" / "audio")
        torch.testing.assert_close(got.get_encoder()(mel).last_hidden_state, model.encoders["audio"](mel), **TOL)
        got = load_cleanly(transformers.Qwen2ForCausalLM, tmp_path / "out" / "llm")
        torch.testing.assert_close(got(ids).logits, llm(ids).logits, **TOL)
    # The export is itself a source: projectors come back from their file.
    again = mllm_spec_from_hf(tmp_path / "out")
    assert again.projectors == spec.projectors and again.encoders.keys() == spec.encoders.keys()
    projector = load_module_state(tmp_path / "out", again, "audio_proj")
    assert projector.keys() == model.projectors["audio_proj"].state_dict().keys()
    torch.testing.assert_close(projector["linears.1.weight"], state["projectors.audio_proj.linears.1.weight"])


def _causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


def test_composition_with_a_clip_tower_uses_its_last_hidden_state(tmp_path):
    llm = transformers.LlamaForCausalLM(TEXT["llama"]())
    llm.save_pretrained(tmp_path / "llm")
    clip = transformers.CLIPVisionModel(VISION["clip"]()).eval()
    _randomize(clip)
    clip.save_pretrained(tmp_path / "clip")
    source = {"llm": tmp_path / "llm", "vision": tmp_path / "clip"}
    spec = mllm_spec_from_hf(source)
    vision = build_module(spec, "vision").eval()
    vision.load_state_dict(load_module_state(source, spec, "vision"))
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(vision(pixels), clip(pixel_values=pixels).last_hidden_state[:, 1:], **TOL)


def _edit_config(path, change):
    file = path / "config.json"
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize("field,change", [
    ("projector_hidden_act", lambda c: c.update(projector_hidden_act="tanh")),
    ("attention_dropout", lambda c: c["vision_config"].update(attention_dropout=0.1)),
    ("hidden_act", lambda c: c["vision_config"].update(hidden_act="relu")),
    ("vision_feature_layer", lambda c: c.update(vision_feature_layer=0)),
    ("vision_feature_layer", lambda c: c.update(vision_feature_layer=[0])),
    ("vision_feature_layer", lambda c: c.update(vision_feature_layer=[-1, -9])),
    ("vision_feature_select_strategy", lambda c: c.update(vision_feature_select_strategy="cls_only")),
    ("llava_onevision", lambda c: c.update(model_type="llava_onevision")),
    ("idefics3", lambda c: c.update(model_type="idefics3")),
    ("siglip2_vision_model", lambda c: c["vision_config"].update(model_type="siglip2_vision_model")),
])
def test_unsupported_checkpoints_are_refused_by_name(field, change, tmp_path):
    make_llava(tmp_path / "hf")
    _edit_config(tmp_path / "hf", change)
    with pytest.raises(ConfigError, match=field):
        mllm_spec_from_hf(tmp_path / "hf")


def test_a_llava_directory_is_not_a_vision_encoder(tmp_path):
    make_llava(tmp_path / "hf", "siglip", "qwen2")
    with pytest.raises(ConfigError, match="'llava'"):
        load_hf_siglip(tmp_path / "hf")
    transformers.Qwen2ForCausalLM(TEXT["qwen2"]()).save_pretrained(tmp_path / "llm")
    with pytest.raises(ConfigError, match="'llava'"):
        mllm_spec_from_hf({"llm": tmp_path / "llm", "encoders": {"vision": tmp_path / "hf"}})
    alone = mllm_spec_from_hf(tmp_path / "llm")  # an LLM alone is an MLLM without encoders
    assert alone.encoders == {} and alone.module_names == ["llm"]


@pytest.mark.parametrize("naming", ["module", "hub"])
def test_other_key_namings_load_and_export_in_their_own_naming(naming, tmp_path):
    """transformers' module names (``model.language_model.*``) and the hub's older ones
    (``vision_tower.vision_model.*``): both read, and the export keeps the source's naming."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = make_llava(tmp_path / "hf")
    if naming == "module":
        tensors = hf.state_dict()
    else:
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            tensors = {k.replace("vision_tower.", "vision_tower.vision_model."): f.get_tensor(k) for k in f.keys()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "hf" / "model.safetensors"),
              metadata={"format": "pt"})
    spec = mllm_spec_from_hf(tmp_path / "hf")
    model = load_whole(tmp_path / "hf", spec)
    ids, pixels, _ = sample_inputs(spec)
    with torch.no_grad():
        want = hf(input_ids=ids[None], pixel_values=pixels).logits
        torch.testing.assert_close(model(pack_samples([tokenized_sample(spec, ids, pixels)])), want, **TOL)
    export_hf(model.state_dict(), spec, tmp_path / "hf", tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors)
    again = load_cleanly(transformers.LlavaForConditionalGeneration, tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids[None], pixel_values=pixels).logits, want, **TOL)


def test_cost_model_counts_the_causal_mask_of_llava(tmp_path):
    from harmonia.model.attention_mask import count_pairs
    from harmonia.workload.shapes import ModalityItem, SampleShape
    from harmonia.workload.work import sample_loads

    make_llava(tmp_path / "hf")
    spec = mllm_spec_from_hf(tmp_path / "hf")
    ids, pixels, _ = sample_inputs(spec, text=(3, 4, 2))
    batch = pack_samples([tokenized_sample(spec, ids, pixels)])
    shape = SampleShape(9, (ModalityItem.image(height=40, width=30),) * 2, (3, 7))
    load = sample_loads(shape, spec)["llm"]
    assert load.tokens == len(ids) and load.pairs == count_pairs(batch.layout)


def as_lazy(state: dict) -> LazyTensors:
    return LazyTensors(state, lambda keys: {k: state[k] for k in keys}, {k: t.dtype for k, t in state.items()},
                       {k: t.shape for k, t in state.items()})


def test_export_writes_a_frozen_module_as_the_source_had_it(tmp_path) -> None:
    """A mixed-precision run holds a frozen encoder in bf16, so its training checkpoint has it
    rounded; the export takes the frozen module's tensors from the source instead."""
    from harmonia.model.mllm import build_mllm_model, state_prefix
    from harmonia.train.export import with_source_frozen
    from harmonia.train.tiny_llava import write_tiny_llava

    base = write_tiny_llava(tmp_path / "base")
    spec = mllm_spec_from_hf(base)
    state = dict(build_mllm_model(spec).state_dict())
    source = {**{state_prefix(spec, "vision") + k: t for k, t in load_module_state(base, spec, "vision").items()},
              **{state_prefix(spec, "llm") + k: t for k, t in load_module_state(base, spec, "llm").items()}}
    with torch.no_grad():
        for key, t in state.items():  # the checkpoint: vision held in bf16, the LLM trained on
            if key in source:
                t.copy_(source[key].to(torch.bfloat16) if key.startswith("encoders.") else source[key] + 1)
    vision = [k for k in state if k.startswith(state_prefix(spec, "vision"))]
    assert any(not torch.equal(state[k], source[k].float()) for k in vision), "bf16 must round some weights"
    view = with_source_frozen(as_lazy(state), spec, base, ["vision"])
    assert all(torch.equal(view[k], source[k].float()) for k in vision)
    assert all(torch.equal(view[k], source[k] + 1) for k in source if k.startswith("llm."))


def test_export_writes_a_lora_modules_frozen_base_as_the_source_had_it(tmp_path) -> None:
    """A LoRA-trained LLM's base weights are frozen, held in bf16 under mixed precision; the export
    restores them from the source and keeps the trained adapters."""
    from harmonia.model.mllm import build_mllm_model, state_prefix
    from harmonia.model.resolve import resolve_mllm
    from harmonia.train.export import with_source_frozen
    from harmonia.train.tiny_llava import write_tiny_llava

    base = write_tiny_llava(tmp_path / "base")
    spec = resolve_mllm(str(base), training={"llm": "lora"}, lora_rank=4)
    state = dict(build_mllm_model(spec).state_dict())
    prefix = state_prefix(spec, "llm")
    source = load_module_state(base, spec, "llm")
    adapters = {k: t.clone() for k, t in state.items() if ".lora_" in k}
    assert adapters and any(".base." in k for k in state)
    with torch.no_grad():
        for key, t in state.items():
            plain = key[len(prefix):].replace(".base.", ".")
            if key.startswith(prefix) and plain in source:
                t.copy_(source[plain].to(torch.bfloat16))
    assert not torch.equal(state[prefix + "layers.0.attn.q_proj.base.weight"], source["layers.0.attn.q_proj.weight"])
    view = with_source_frozen(as_lazy(state), spec, base, ["llm"])
    for key in state:
        plain = key[len(prefix):].replace(".base.", ".")
        if key.startswith(prefix) and plain in source:
            assert torch.equal(view[key], source[plain].float()), key
    assert all(torch.equal(view[k], t) for k, t in adapters.items())
