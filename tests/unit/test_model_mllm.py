"""Reference models: shapes, stage splits, packing, placeholder replacement, training modes, TP plans."""

import pytest
import torch

from harmonia.errors import ConfigError, LayoutError, SampleError
from harmonia.model.batch import ItemInputs, TokenizedSample, frame_groups, pack_samples
from harmonia.model.lora import LoRALinear, merge_lora, trainable_parameters
from harmonia.model.mllm import build_mllm_model, build_module
from harmonia.model.presets import mllm_preset
from harmonia.model.tp import check_tp_degree, plan_tp, tp_styles
from harmonia.workload.shapes import ModalityItem, llm_tokens_of_item

SPEC = mllm_preset("tiny-omni")
VIT, AUD = SPEC.encoders["vision"], SPEC.encoders["audio"]
IMG_TOKENS = llm_tokens_of_item(ModalityItem.image(tiles=1), VIT)  # 16 patches / 4
AUD_TOKENS = llm_tokens_of_item(ModalityItem.audio(2.0), AUD)  # one 2 s chunk


def sample(seed: int, n_text: int = 6, audio: bool = False) -> TokenizedSample:
    g = torch.Generator().manual_seed(seed)
    items = [ItemInputs("vision", torch.randn(1, 3, 16, 16, generator=g))]
    segments = [("text", 2), ("item", IMG_TOKENS)]
    if audio:
        items.append(ItemInputs("audio", torch.randn(1, AUD.n_mels, 100, generator=g)))
        segments.append(("item", AUD_TOKENS))
    segments.append(("text", n_text))
    T = sum(n for _, n in segments)
    ids = torch.randint(3, 256, (T,), generator=g)
    labels = torch.roll(ids, -1)
    labels[-1] = -100
    return TokenizedSample(ids, labels, segments, items, sample_id=seed)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_mllm_model(SPEC).eval()


def test_module_shapes():
    torch.manual_seed(0)
    vit = build_module(SPEC, "vision")
    y = vit(torch.randn(3, 3, 16, 16))
    assert y.shape == (3, IMG_TOKENS, 4 * VIT.body.hidden)  # class token dropped, 2x2 merged
    aud = build_module(SPEC, "audio")
    assert aud(torch.randn(2, AUD.n_mels, 100)).shape == (2, AUD_TOKENS, AUD.body.hidden)
    proj = build_module(SPEC, "vision_proj")
    assert proj(y).shape == (3, IMG_TOKENS, SPEC.llm.hidden)


def test_param_counts_match_spec(model):
    for name, n in SPEC.n_params().items():
        assert sum(p.numel() for p in model.module(name).parameters()) == n


@pytest.mark.parametrize("module,split", [("llm", 1), ("llm", 3), ("vision", 1), ("audio", 1)])
def test_stages_compose_to_the_whole_module(module, split):
    torch.manual_seed(0)
    whole = build_module(SPEC, module).eval()
    n = (SPEC.llm.body if module == "llm" else SPEC.encoders[module].body).n_layers
    first, second = build_module(SPEC, module, (0, split)), build_module(SPEC, module, (split, n))
    sd = whole.state_dict()
    assert set(first.state_dict()) | set(second.state_dict()) == set(sd)
    assert not set(first.state_dict()) & set(second.state_dict())
    first.load_state_dict({k: sd[k] for k in first.state_dict()})
    second.load_state_dict({k: sd[k] for k in second.state_dict()})
    if module == "llm":
        batch = pack_samples([sample(1)])
        args = (batch.positions(), batch.mask())
        ref = whole(batch.input_ids, *args)
        out = second(first(batch.input_ids, *args), *args)
    else:
        x = torch.randn(2, 3, 16, 16) if module == "vision" else torch.randn(2, AUD.n_mels, 100)
        ref, out = whole(x), second(first(x))
    torch.testing.assert_close(out, ref)


def test_bad_stage_range():
    with pytest.raises(ConfigError, match="out of range"):
        build_module(SPEC, "llm", (2, 9))


def test_packing_equals_separate_forwards(model):
    a, b = sample(1, audio=True), sample(2, n_text=4)
    packed = model(pack_samples([a, b]))
    sep = torch.cat([model(pack_samples([a])), model(pack_samples([b]))], dim=1)
    torch.testing.assert_close(packed, sep, atol=1e-5, rtol=1e-5)


def test_placeholders_replaced_and_items_causal(model):
    s = sample(3)
    base = model(pack_samples([s]))
    s2 = TokenizedSample(s.input_ids.clone(), s.labels, s.segments, s.items)
    s2.input_ids[2:2 + IMG_TOKENS] = 0  # placeholder ids do not matter
    torch.testing.assert_close(model(pack_samples([s2])), base)
    s3 = TokenizedSample(s.input_ids, s.labels, s.segments, [ItemInputs("vision", torch.randn(1, 3, 16, 16))])
    out = model(pack_samples([s3]))
    torch.testing.assert_close(out[:, :2], base[:, :2])  # text before the image cannot see it
    assert not torch.allclose(out[:, 2:], base[:, 2:])


def test_wrong_item_token_count_is_reported(model):
    s = sample(4)
    bad = TokenizedSample(s.input_ids[:-1], s.labels[:-1], [("text", 2), ("item", IMG_TOKENS - 1), ("text", 6)],
                          s.items)
    with pytest.raises(SampleError, match="placeholder positions"):
        model(pack_samples([bad]))


def test_video_frames_temporal_groups():
    assert frame_groups(frames=3, tiles_per_frame=2, temporal_merge=2).tolist() == [0, 1, 0, 1, 2, 3]


def test_frozen_and_lora_training_modes():
    torch.manual_seed(0)
    spec = SPEC.with_training(vision="frozen", audio="frozen", llm="lora")
    model = build_mllm_model(spec)
    trainable = trainable_parameters(model)
    assert not any(k.startswith("encoders.") for k in trainable)
    assert any(k.startswith("projectors.") for k in trainable)
    llm_trainable = [k for k in trainable if k.startswith("llm.")]
    assert llm_trainable and all(".lora_" in k for k in llm_trainable)
    batch = pack_samples([sample(5, audio=True)])
    with torch.no_grad():
        before = model(batch)
    model.loss(batch).backward()
    assert all(p.grad is not None for p in trainable.values())
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    with torch.no_grad():  # a trained adapter merges into an equivalent plain model
        for p in trainable.values():
            p.add_(0.01 * torch.randn_like(p))
        adapted = model(batch)
        merge_lora(model.llm)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(batch), adapted, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(adapted, before)


def test_tp_plan_names_real_linears():
    torch.manual_seed(0)
    spec = SPEC.with_training(llm="lora")
    model = build_mllm_model(spec)
    for name in spec.module_names:
        module = model.module(name)
        plan = plan_tp(module)
        names = dict(module.named_modules())
        for pattern in plan:
            matches = [n for n in names if __import__("fnmatch").fnmatch(n, pattern)]
            assert matches, pattern
            assert all(isinstance(names[n], (torch.nn.Linear, torch.nn.Embedding)) for n in matches)
        assert len(tp_styles(plan)) == len(plan)
    llm_plan = plan_tp(model.llm)
    assert llm_plan["layers.*.attn.q_proj.base"] == "colwise"
    assert llm_plan["layers.*.attn.q_proj.lora_b"] == "colwise"
    assert llm_plan["layers.*.attn.o_proj.lora_a"] == "rowwise"


def test_tp_degree_must_split_whole_heads():
    llm = build_mllm_model(SPEC.with_training(llm="lora")).llm
    body = SPEC.llm.body
    check_tp_degree(llm, body.kv_heads)
    with pytest.raises(LayoutError, match="does not divide"):
        check_tp_degree(llm, body.n_heads * 2)


def test_video_temporal_merge_averages_frame_groups():
    from dataclasses import replace

    from harmonia.model.mllm import encode_media
    from harmonia.model.spec import MLLMSpec

    spec = MLLMSpec("t", {"vision": replace(VIT, temporal_merge=2)}, {"vision_proj": SPEC.projectors["vision_proj"]},
                    SPEC.llm)
    torch.manual_seed(0)
    model = build_mllm_model(spec).eval()
    item = ModalityItem.video(frames=3, tiles=1)
    n = llm_tokens_of_item(item, spec.encoders["vision"])
    assert n == 2 * IMG_TOKENS
    frames = torch.randn(3, 3, 16, 16)
    ids = torch.randint(4, 256, (n + 3,))
    s = TokenizedSample(ids, ids, [("item", n), ("text", 3)], [ItemInputs("vision", frames, frame_groups(3, 1, 2))])
    batch = pack_samples([s])
    with torch.no_grad():
        got = encode_media(model.encoders["vision"], model.projectors["vision_proj"], batch.media["vision"])
        per_frame = model.projectors["vision_proj"](model.encoders["vision"](frames))  # (3, P, D)
        want = torch.cat([(per_frame[0] + per_frame[1]) / 2, per_frame[2]])
        torch.testing.assert_close(got, want)
        assert model(batch).shape == (1, n + 3, spec.llm.vocab_size)


def test_the_packed_kernel_matches_the_dense_reference(model):
    batch = pack_samples([sample(6, audio=True), sample(7)])
    with torch.no_grad():
        packed = model(batch)
        model.attention = "dense"
        try:
            dense = model(batch)
        finally:
            model.attention = "auto"
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)


def test_audio_token_merge_must_divide_chunk_tokens():
    from dataclasses import replace

    with pytest.raises(ConfigError, match="token_merge=3"):
        build_module(replace(SPEC, encoders={**SPEC.encoders, "audio": replace(AUD, token_merge=3)},
                             projectors={**SPEC.projectors, "audio_proj": replace(SPEC.projectors["audio_proj"],
                                                                                  in_dim=3 * AUD.out_dim)}), "audio")
