"""Qwen2-VL and Qwen2.5-VL from HF checkpoints: logits, loss and gradients equal transformers' (tiny
random-weight models saved inside the test, fp32, CPU), packed samples restart their positions, and
the export loads back into transformers unchanged."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harmonia.errors import ConfigError, SampleError  # noqa: E402
from harmonia.model.batch import pack_samples  # noqa: E402
from harmonia.model.families.qwen_vl import tokenized_sample  # noqa: E402
from harmonia.model.hf.mllm import export_hf, mllm_spec_from_hf  # noqa: E402
from harmonia.workload.cost import CostModel  # noqa: E402
from harmonia.workload.devices import device_preset  # noqa: E402
from tests.unit.test_model_hf_llava import load_whole  # noqa: E402

TOL = {"atol": 2e-5, "rtol": 1e-5}
VOCAB, IMAGE, VIDEO, START, END = 300, 290, 291, 292, 293
PATCH, MERGE = 4, 2
TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, intermediate_size=96,
            vocab_size=VOCAB, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
TEXT3 = {**TEXT, "head_dim": 16, "rope_parameters": {**TEXT["rope_parameters"], "mrope_interleaved": True}}
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                     spatial_merge_size=MERGE, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                       spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                       out_hidden_size=64, tokens_per_second=2),
    "qwen3_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                     spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=36,
                     deepstack_visual_indexes=[0, 2]),
}
CLASSES = {"qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
           "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
           "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration)}
# (t, h, w) patch grids: a small image, a very wide and a very tall one, a 4-frame video (2 temporal patches)
GRIDS = {"image": [(1, 6, 8), (1, 2, 20), (1, 18, 2)], "video": [(2, 4, 6)]}


def make_qwen_vl(path, family: str, tied: bool = False):
    config_cls, model_cls = CLASSES[family]
    text = TEXT3 if family == "qwen3_vl" else TEXT
    config = config_cls(text_config=text, vision_config=VISION[family], image_token_id=IMAGE, video_token_id=VIDEO,
                        vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():  # non-trivial norms and biases, so that a swapped or dropped tensor shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "merge_size": MERGE,
        "temporal_patch_size": 2, "min_pixels": 8 * 8, "max_pixels": 64 * 64}))
    return model.eval()


def sample(seed: int, images: list, videos: list = (), text=(3, 2, 4, 3, 2), framed: bool = False):
    """input_ids as the processor writes them (``<|vision_start|>`` pads ``<|vision_end|>`` per item;
    ``framed``: a video as Qwen3-VL's writes it, inside those one ``<t seconds>`` text (random ids
    here), ``<|vision_start|>`` pads ``<|vision_end|>`` per temporal group), random patch rows, grids
    and labels on the last text run."""
    g = torch.Generator().manual_seed(seed)
    texts = iter(torch.randint(0, 280, (k,), generator=g) for k in text)
    ids, out = [next(texts)], {}
    for mod, token, grids in (("image", IMAGE, images), ("video", VIDEO, videos)):
        if not grids:
            continue
        rows = []
        for t, h, w in grids:
            run = [torch.full((t * h * w // MERGE**2,), token)]
            if framed and mod == "video":
                stamps = torch.randint(0, 280, (t, 3), generator=g)
                run = [torch.cat([stamps[k], torch.tensor([START]), torch.full((h * w // MERGE**2,), token),
                                  torch.tensor([END])]) for k in range(t)]
            ids += [torch.tensor([START]), *run, torch.tensor([END]), next(texts)]
            rows.append(torch.randn(t * h * w, 3 * 2 * PATCH * PATCH, generator=g))
        key = "pixel_values" if mod == "image" else "pixel_values_videos"
        out[key], out[f"{mod}_grid_thw"] = torch.cat(rows), torch.tensor(grids)
    ids = torch.cat(ids)
    labels = ids.clone()
    labels[: len(ids) - 3] = -100
    return ids, labels, out


def hf_inputs(ids, media) -> dict:
    """What transformers' model takes besides the ids: the media and the token types its processor marks."""
    types = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
    return {**media, "mm_token_type_ids": types[None]}


def ours_of(spec, ids, labels, media, seconds=None):
    return tokenized_sample(spec, ids, media.get("pixel_values"), labels, image_grid_thw=media.get("image_grid_thw"),
                            pixel_values_videos=media.get("pixel_values_videos"),
                            video_grid_thw=media.get("video_grid_thw"), second_per_grid_ts=seconds)


@pytest.mark.parametrize("family", list(CLASSES))
def test_logits_loss_and_packing_match_transformers(family, tmp_path):
    hf = make_qwen_vl(tmp_path / "hf", family)
    spec = mllm_spec_from_hf(tmp_path / "hf")
    model = load_whole(tmp_path / "hf", spec)
    one = sample(1, GRIDS["image"][:2], GRIDS["video"], framed=family == "qwen3_vl")
    two = sample(2, GRIDS["image"][2:], text=(4, 5))
    seconds = [1.0]
    with torch.no_grad():
        extra = {"second_per_grid_ts": torch.tensor(seconds)} if family == "qwen2_5_vl" else {}
        want = hf(input_ids=one[0][None], labels=one[1][None], **hf_inputs(one[0], one[2]), **extra)
        want2 = hf(input_ids=two[0][None], **hf_inputs(two[0], two[2])).logits
        a, b = ours_of(spec, *one, seconds=seconds), ours_of(spec, *two)
        batch = pack_samples([a])
        torch.testing.assert_close(model(batch), want.logits, **TOL)
        torch.testing.assert_close(model.loss(batch, batch.n_targets), want.loss, **TOL)
        # Two samples packed in one sequence: each restarts its rotary positions, computes what it does alone.
        packed = model(pack_samples([a, b]))
        torch.testing.assert_close(packed, torch.cat([want.logits, want2], dim=1), **TOL)


@pytest.mark.parametrize("family", list(CLASSES))
def test_gradients_match_transformers(family, tmp_path):
    hf = make_qwen_vl(tmp_path / "hf", family)
    spec = mllm_spec_from_hf(tmp_path / "hf")
    model = load_whole(tmp_path / "hf", spec)
    ids, labels, media = sample(3, GRIDS["image"][:2], GRIDS["video"], framed=family == "qwen3_vl")
    extra = {"second_per_grid_ts": torch.tensor([1.0])} if family == "qwen2_5_vl" else {}
    hf.train()
    hf(input_ids=ids[None], labels=labels[None], **hf_inputs(ids, media), **extra).loss.backward()
    batch = pack_samples([ours_of(spec, ids, labels, media, seconds=[1.0])])
    model.loss(batch, batch.n_targets).backward()
    theirs = dict(hf.named_parameters())
    pairs = {  # ours -> transformers'
        "projectors.vision_proj.linears.0.weight": "model.visual.merger.mlp.0.weight",
        "projectors.vision_proj.norm.weight": "model.visual.merger.ln_q.weight",
        "encoders.vision.layers.0.attn.o_proj.weight": "model.visual.blocks.0.attn.proj.weight",
        "encoders.vision.patch_embed.weight": "model.visual.patch_embed.proj.weight",
        "llm.layers.1.mlp.down_proj.weight": "model.language_model.layers.1.mlp.down_proj.weight",
        "llm.embed.weight": "model.language_model.embed_tokens.weight",
    }
    if family == "qwen3_vl":  # the merger is the projector's first, the DeepStack mergers the others
        pairs = {k.replace("vision_proj.", "vision_proj.merger."): v.replace("mlp.0", "linear_fc1").replace("ln_q", "norm")
                 for k, v in pairs.items()}
        pairs["projectors.vision_proj.deepstack.1.linears.1.weight"] = "model.visual.deepstack_merger_list.1.linear_fc2.weight"
        pairs["encoders.vision.pos_embed.weight"] = "model.visual.pos_embed.weight"
    ours = dict(model.named_parameters())
    for mine, name in pairs.items():
        torch.testing.assert_close(ours[mine].grad, theirs[name].grad, atol=1e-5, rtol=1e-4)
    q = ours["encoders.vision.layers.1.attn.k_proj.weight"].grad
    fused = theirs["model.visual.blocks.1.attn.qkv.weight"].grad
    torch.testing.assert_close(q, fused.chunk(3)[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", list(CLASSES))
def test_export_loads_back_unchanged(family, tmp_path):
    hf = make_qwen_vl(tmp_path / "hf", family, tied=family == "qwen2_vl")
    spec = mllm_spec_from_hf(tmp_path / "hf")
    model = load_whole(tmp_path / "hf", spec)
    export_hf(model.state_dict(), spec, tmp_path / "hf", tmp_path / "out")
    back = CLASSES[family][1].from_pretrained(tmp_path / "out")
    want = hf.state_dict()
    assert back.state_dict().keys() == want.keys()
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_spec_reads_the_checkpoint_and_counts_its_parameters(family, tmp_path):
    hf = make_qwen_vl(tmp_path / "hf", family)
    spec = mllm_spec_from_hf(tmp_path / "hf")
    enc = spec.encoders["vision"]
    assert (enc.min_pixels, enc.max_pixels, enc.token_merge, enc.temporal_merge) == (64, 4096, 4, 2)
    assert spec.llm.mrope_section == (2, 3, 3) and spec.item_attention == "causal"
    assert (spec.llm.mrope_interleaved, spec.llm.deepstack) == ((True, 2) if family == "qwen3_vl" else (False, 0))
    assert spec.item_token_ids == {"image": IMAGE, "video": VIDEO}
    cost = CostModel(spec, device_preset("h100"))
    built = load_whole(tmp_path / "hf", spec)
    for name in spec.module_names:
        assert cost.param_count(name)[0] == spec.n_params()[name] == sum(
            p.numel() for p in built.module(name).parameters()), name
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in hf.parameters())


def test_mismatched_processor_numbers_are_refused(tmp_path):
    make_qwen_vl(tmp_path / "hf", "qwen2_vl")
    path = tmp_path / "hf" / "preprocessor_config.json"
    path.write_text(json.dumps({"patch_size": 14, "merge_size": MERGE}))
    with pytest.raises(ConfigError, match="patch_size"):
        mllm_spec_from_hf(tmp_path / "hf")


def test_token_runs_must_match_the_grids(tmp_path):
    make_qwen_vl(tmp_path / "hf", "qwen2_vl")
    spec = mllm_spec_from_hf(tmp_path / "hf")
    ids, labels, media = sample(4, GRIDS["image"][:1])
    with pytest.raises(SampleError, match="tokens but its run has"):
        ours_of(spec, ids[:-6], labels[:-6], {**media, "image_grid_thw": torch.tensor([[1, 6, 4]]),
                                             "pixel_values": media["pixel_values"][:24]})
    with pytest.raises(SampleError, match="without placeholder"):
        ours_of(spec, ids[:3], labels[:3], media)


def test_an_inner_vision_stage_is_priced_with_the_deepstack_outputs_it_sends(tmp_path):
    """Qwen3-VL's tower (DeepStack taps after blocks 0 and 2 of 3) cut into pipeline stages: a stage
    sends its hidden state and every tap before its end, as `QwenVisionEncoder` does."""
    from harmonia.schedule.layout import Layout
    from harmonia.schedule.plan import Plan
    from harmonia.schedule.stagework import plan_iteration_work
    from harmonia.schedule.iteration import assign_iteration, balancer_costs
    from harmonia.workload.shapes import ModalityItem, SampleShape

    make_qwen_vl(tmp_path / "hf", "qwen3_vl")
    spec = mllm_spec_from_hf(tmp_path / "hf")
    enc = spec.encoders["vision"]
    assert [enc.carried_taps(s) for s in (0, 1, 2, 3)] == [(), (0,), (0,), (0, 2)]
    cost = CostModel(spec, device_preset("h100"))
    plan = Plan(spec.name, {"vision": Layout(pp=3), "llm": Layout()}, "colocated", "1f1b", 1, global_batch=1)
    shapes = [SampleShape(12, (ModalityItem.image(height=64, width=48),), sample_id=0)]
    costs, columns, tokens = balancer_costs(cost, shapes, plan.encoders)
    iw = plan_iteration_work(shapes, plan, cost, assign_iteration(costs, columns, 1, {"vision": 1}, 1, tokens=tokens))
    sends = {key.stage: w.send_bytes for (key, _, _), w in iw.work.items() if key.module == "vision"}
    per_value = sends[0] / (enc.body.hidden * 2)  # tokens x activation bytes
    assert per_value > 0 and sends == {0: per_value * enc.body.hidden * 2, 1: per_value * enc.body.hidden * 2, 2: 0.0}
