"""LLaVA-NeXT checkpoints against `transformers`: anyres tiles, token counts, logits, loss and export
(fp32, a tiny random-weight model with its processor saved to a temporary directory)."""

import functools
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")

from harmonia.data.image import ImagePreprocessor
from harmonia.data.loader import build_tokenizer, open_dataset
from harmonia.data.media import build_media_preprocessors, decode_item, media_shape, shape_item
from harmonia.errors import ConfigError, SampleError
from harmonia.model.anyres import anyres_order, anyres_tokens, unsized_tokens
from harmonia.model.batch import pack_samples
from harmonia.model.families.llava import tokenized_sample
from harmonia.model.hf.mllm import export_hf, load_module_state, mllm_spec_from_hf
from harmonia.model.mllm import build_module, encode_media
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset
from harmonia.workload.shapes import ModalityItem, SampleShape, llm_tokens_of_item
from harmonia.workload.work import sample_loads
from tests.unit._hf_load import load_cleanly
from tests.unit._hf_tokenizer import CHATML, build_chat_tokenizer
from tests.unit.test_model_hf_llava import TOL, _edit_config, _randomize, load_whole

PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]  # 32 px tiles: grids 1x1, 1x2, 2x1, 2x2
SIZES = [(20, 50), (50, 20), (40, 40), (33, 97), (97, 33), (64, 30), (7, 120), (61, 64)]


def write_llava_next(path, strategy="default", seed=0, vision="clip", layer=-2, tie=False):
    """A tiny LlavaNextForConditionalGeneration (CLIP 32 px / 8 px patches + Llama, or SigLIP + Qwen2)
    and its processor."""
    tok = build_chat_tokenizer("chatml")
    shape = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                 patch_size=8)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    if vision == "clip":
        vision, text = transformers.CLIPVisionConfig(**shape), transformers.LlamaConfig(rope_theta=5000.0, **text)
    else:
        vision, text = transformers.SiglipVisionConfig(**shape), transformers.Qwen2Config(tie_word_embeddings=True, **text)
    config = transformers.LlavaNextConfig(vision_config=vision, text_config=text,
                                          image_token_index=tok.convert_tokens_to_ids("<image>"),
                                          image_grid_pinpoints=PINPOINTS, vision_feature_layer=layer,
                                          vision_feature_select_strategy=strategy, tie_word_embeddings=tie)
    hf = transformers.LlavaNextForConditionalGeneration(config).eval()
    _randomize(hf, seed)
    hf.save_pretrained(path)
    images = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                     image_grid_pinpoints=PINPOINTS)
    processor = transformers.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                                vision_feature_select_strategy=strategy,
                                                num_additional_image_tokens=int(strategy == "default"),
                                                chat_template=CHATML)
    processor.save_pretrained(path)
    return hf, processor


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava_next") / "hf"
    hf, processor = write_llava_next(path)
    spec = mllm_spec_from_hf(path)
    return SimpleNamespace(path=path, hf=hf, processor=processor, spec=spec, model=load_whole(path, spec),
                           image_token=spec.item_token_ids["image"])


def _image(h, w, seed, path=None):
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))
    if path is not None:
        img.save(path)
    return img


def _inputs(ckpt, sizes, seed=0, answer=" The square is red."):
    """transformers' processor inputs for images of ``sizes`` between text, labels on the answer only."""
    text = "".join(f"Picture {k}: <image>." for k in range(len(sizes))) + answer
    imgs = [_image(h, w, seed + k) for k, (h, w) in enumerate(sizes)]
    batch = ckpt.processor(text=text, images=imgs, return_tensors="pt")
    labels = batch["input_ids"].clone()
    n_answer = len(ckpt.processor.tokenizer.encode(answer, add_special_tokens=False))
    labels[:, :-n_answer] = -100
    return {**batch, "labels": labels}


def _sample(ckpt, batch, labels=True):
    return tokenized_sample(ckpt.spec, batch["input_ids"][0], batch["pixel_values"],
                            batch["labels"][0] if labels else None, image_sizes=batch["image_sizes"])


@pytest.mark.parametrize("sizes", [[(20, 50)], [(50, 20)], [(40, 40)], [(33, 97), (97, 33)], [(7, 120), (61, 64)]])
def test_logits_and_loss_match_transformers(ckpt, sizes):
    batch = _inputs(ckpt, sizes)
    with torch.no_grad():
        want = ckpt.hf(**batch)
        one = pack_samples([_sample(ckpt, batch)])
        torch.testing.assert_close(ckpt.model(one), want.logits, **TOL)
        torch.testing.assert_close(ckpt.model.loss(one, one.n_targets), want.loss, **TOL)
        # Packed after another sample, each image's tokens still come from its own tiles.
        other = _inputs(ckpt, [(64, 30)], seed=7)
        packed = ckpt.model(pack_samples([_sample(ckpt, other, False), _sample(ckpt, batch, False)]))
        other_logits = ckpt.hf(**{k: v for k, v in other.items() if k != "labels"}).logits
        torch.testing.assert_close(packed, torch.cat([other_logits, want.logits], dim=1), **TOL)


def test_stages_give_transformers_image_features(ckpt):
    """Encoder stages, then the projector stage holding image_newline, equal get_image_features."""
    path, spec = ckpt.path, ckpt.spec

    def stage(name, layers):
        module = build_module(spec, name, layers).eval()
        module.load_state_dict(load_module_state(path, spec, name, layers, set(module.state_dict())))
        return module

    assert "image_newline" in build_module(spec, "vision_proj").state_dict()
    n = spec.encoders["vision"].body.n_layers
    vision = torch.nn.Sequential(stage("vision", (0, 1)), stage("vision", (1, n)))
    batch = _inputs(ckpt, [(33, 97), (40, 40)])
    packed = pack_samples([_sample(ckpt, batch, False)])
    with torch.no_grad():
        got = encode_media(vision, stage("vision_proj", None), packed.media["vision"])
        want = ckpt.hf.model.get_image_features(batch["pixel_values"], batch["image_sizes"]).pooler_output
    torch.testing.assert_close(got, torch.cat(list(want)), **TOL)


def test_token_counts_equal_llava_next_processor():
    """Pure counts against LlavaNextProcessor._get_number_of_features, for LLaVA-1.6's own pinpoints too."""
    base = None
    for pinpoints, tile, patch in ((PINPOINTS, 32, 8), ([[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
                                                         336, 14)):
        from harmonia.model.presets import mllm_preset

        base = base or mllm_preset("tiny-vlm").encoders["vision"]
        enc = replace(base, image_size=tile, patch_size=patch, token_merge=1, cls_token=True, dropped_tokens=1,
                      modalities=("image",), max_tiles=10, grid_pinpoints=tuple(map(tuple, pinpoints)))
        ref = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=pinpoints), patch_size=patch,
                              num_additional_image_tokens=1)
        ref._get_unpadded_features = functools.partial(transformers.LlavaNextProcessor._get_unpadded_features, ref)
        for h in range(1, 3 * tile, max(1, tile // 9)):
            for w in range(1, 3 * tile, max(1, tile // 7)):
                want = transformers.LlavaNextProcessor._get_number_of_features(ref, h, w, tile, tile) - 1
                assert anyres_tokens(h, w, enc) == want == anyres_order(h, w, enc).shape[0], (h, w, pinpoints)


def test_header_only_counts_equal_decoded_tiles_and_processor(ckpt, tmp_path):
    enc = ckpt.spec.encoders["vision"]
    prep = ImagePreprocessor.from_pretrained(ckpt.path, enc)
    for k, (h, w) in enumerate(SIZES):
        path = tmp_path / f"{k}.png"
        img = _image(h, w, k, path)
        header = shape_item("image", media_shape("image", path), prep)
        item, tiles = decode_item("image", path, prep)
        want = ckpt.processor(text="<image>", images=[img], return_tensors="pt")
        n_tokens = int((want["input_ids"] == ckpt.image_token).sum())
        assert llm_tokens_of_item(header, enc) == llm_tokens_of_item(item, enc) == n_tokens, (h, w)
        assert tiles.shape[0] == prep.n_tiles(h, w) == want["pixel_values"].shape[1]
        torch.testing.assert_close(tiles, want["pixel_values"][0], rtol=0, atol=0)


def test_dataset_input_ids_and_logits_equal_transformers(ckpt, tmp_path):
    """LLaVA JSON -> harmonia's tokenizer, image path and model == LlavaNextProcessor + transformers."""
    sizes = [(33, 97), (50, 20)]
    imgs = [_image(h, w, k, tmp_path / f"{k}.png") for k, (h, w) in enumerate(sizes)]
    row = {"id": "two", "images": ["0.png", "1.png"],
           "conversations": [{"from": "human", "value": "<image>\nWhat colour is the square?"},
                             {"from": "gpt", "value": "The square is red."},
                             {"from": "human", "value": "And this one? <image>"},
                             {"from": "gpt", "value": "There are two squares."}]}
    (tmp_path / "d.json").write_text(json.dumps([row]))
    spec = ckpt.spec
    ds = open_dataset(tmp_path / "d.json", spec, tokenizer=build_tokenizer(ckpt.path),
                      preprocessors=build_media_preprocessors(spec, {"vision": ckpt.path}))
    (shape,) = ds.shapes()
    (loaded,) = ds.load([0])
    messages = [{"role": "user", "content": "<image>\nWhat colour is the square?"},
                {"role": "assistant", "content": "The square is red."},
                {"role": "user", "content": "And this one? <image>"},
                {"role": "assistant", "content": "There are two squares."}]
    prompt = ckpt.processor.apply_chat_template(messages)
    want = ckpt.processor(text=prompt, images=imgs, return_tensors="pt")
    assert torch.equal(loaded.tokens.input_ids, want["input_ids"][0])
    counts = [llm_tokens_of_item(i, spec.encoders["vision"]) for i in shape.items]
    segments = [n for kind, n in loaded.tokens.segments if kind == "item"]
    assert counts == segments == [anyres_tokens(h, w, spec.encoders["vision"]) for h, w in sizes]
    assert shape == loaded.shape
    with torch.no_grad():
        logits = ckpt.hf(input_ids=want["input_ids"], pixel_values=want["pixel_values"],
                         image_sizes=want["image_sizes"]).logits
        torch.testing.assert_close(ckpt.model(pack_samples([loaded.tokens])), logits, **TOL)


def test_export_round_trip_keeps_image_newline(ckpt, tmp_path):
    spec, model = ckpt.spec, load_whole(ckpt.path, ckpt.spec)
    _randomize(model.projectors, seed=3)  # "trained" projector and image_newline
    batch = _inputs(ckpt, [(20, 50), (97, 33)])
    with torch.no_grad():
        want = model(pack_samples([_sample(ckpt, batch, False)]))
    export_hf(model.state_dict(), spec, ckpt.path, tmp_path / "out")
    again = load_cleanly(transformers.LlavaNextForConditionalGeneration, tmp_path / "out")
    torch.testing.assert_close(again.model.image_newline, model.projectors["vision_proj"].image_newline, rtol=0, atol=0)
    with torch.no_grad():
        got = again(**{k: v for k, v in batch.items() if k != "labels"}).logits
    torch.testing.assert_close(got, want, **TOL)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llava_next"
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "out")
    assert processor.image_processor.image_grid_pinpoints == PINPOINTS
    back = mllm_spec_from_hf(tmp_path / "out")
    assert back.projectors == spec.projectors and back.encoders["vision"].grid_pinpoints == tuple(map(tuple, PINPOINTS))


def test_spec_and_cost_model_count_the_checkpoint(ckpt):
    spec, hf = ckpt.spec, ckpt.hf
    enc, proj = spec.encoders["vision"], spec.projectors["vision_proj"]
    assert enc.grid_pinpoints == tuple(map(tuple, PINPOINTS)) and enc.max_tiles == 5 and proj.newline
    assert proj.n_params() == sum(p.numel() for p in hf.model.multi_modal_projector.parameters()) + 32
    cost = CostModel(spec, device_preset("h100"))
    for name in spec.module_names:
        assert cost.param_count(name)[0] == sum(p.numel() for p in build_module(spec, name).parameters()), name
    # An image with a size runs its anyres tiles; one known by its tile count (a trace) is priced as
    # the most tokens that many tiles give: 2x2 grid = 16 + 8 * 9; 1x2 (the tallest of 2) = 16 + 8 * 5.
    sized = sample_loads(SampleShape(5, (ModalityItem.image(height=33, width=97),)), spec)
    assert sized["vision"].tokens == 3 * 17 and sized["llm"].tokens == 5 + anyres_tokens(33, 97, enc)
    assert [unsized_tokens(n, enc) for n in (1, 3, 5)] == [17, 16 + 8 * 5, 16 + 8 * 9]
    tiles = sample_loads(SampleShape(5, (ModalityItem.image(tiles=3),)), spec)
    assert tiles["vision"].tokens == 3 * 17 and tiles["llm"].tokens == 5 + 16 + 8 * 5


def test_plan_reads_the_checkpoint(ckpt, shared_traces):
    from harmonia.plan.scenario import Scenario
    from harmonia.plan.search import search_plan

    scenario = Scenario("next", str(ckpt.path), "h100:1x2", str(shared_traces / "ai2d.csv"), 8, iterations=1,
                        search_batches=1)
    report = search_plan(scenario, top=1)
    assert set(report.best.layouts) == {"vision", "llm"} and report.simulated > 0


def test_sample_errors_name_the_image_count(ckpt):
    batch = _inputs(ckpt, [(33, 97)])
    with pytest.raises(SampleError, match="image_sizes"):
        tokenized_sample(ckpt.spec, batch["input_ids"][0], batch["pixel_values"])
    short = batch["input_ids"][0][batch["input_ids"][0] != ckpt.image_token]
    with pytest.raises(SampleError, match="image tokens"):
        tokenized_sample(ckpt.spec, short, batch["pixel_values"], image_sizes=batch["image_sizes"])


@pytest.mark.parametrize("field,change", [
    ("'default'", lambda c: c.update(vision_feature_select_strategy="full")),
    ("grid_pinpoints", lambda c: c.update(image_grid_pinpoints=[[32, 48]])),
    ("image_grid_pinpoints", lambda c: c.update(image_grid_pinpoints=[])),
    ("vision_feature_layer", lambda c: c.update(vision_feature_layer=0)),
])
def test_unsupported_llava_next_configs_are_refused_by_name(field, change, tmp_path):
    write_llava_next(tmp_path / "hf")
    _edit_config(tmp_path / "hf", change)
    with pytest.raises(ConfigError, match=field):
        mllm_spec_from_hf(tmp_path / "hf")


def test_processor_with_other_pinpoints_is_refused(ckpt, tmp_path):
    write_llava_next(tmp_path / "hf")
    file = tmp_path / "hf" / "processor_config.json"
    config = json.loads(file.read_text())
    config["image_processor"]["image_grid_pinpoints"] = [[32, 32], [64, 64]]
    file.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="image_grid_pinpoints"):
        ImagePreprocessor.from_pretrained(tmp_path / "hf", ckpt.spec.encoders["vision"])


def test_gradients_of_image_newline_and_projector_match_transformers(ckpt):
    """image_newline trains: its gradient, the projector's and the tower's equal transformers'."""
    batch = _inputs(ckpt, [(33, 97), (50, 20)])
    model = load_whole(ckpt.path, ckpt.spec)
    one = pack_samples([_sample(ckpt, batch)])
    model.loss(one, one.n_targets).backward()
    ckpt.hf.zero_grad()
    ckpt.hf(**batch).loss.backward()
    hf = ckpt.hf.model
    pairs = [(model.projectors["vision_proj"].image_newline, hf.image_newline),
             (model.projectors["vision_proj"].linears[0].weight, hf.multi_modal_projector.linear_1.weight),
             (model.encoders["vision"].layers["0"].attn.q_proj.weight,
              hf.vision_tower.encoder.layers[0].self_attn.q_proj.weight)]
    for ours, theirs in pairs:
        assert ours.grad is not None and ours.grad.abs().sum() > 0
        torch.testing.assert_close(ours.grad, theirs.grad, **TOL)
    ckpt.hf.zero_grad()


def test_sub_microbatches_give_the_whole_items_rows(ckpt):
    """An encoder replica's items cut into runs (sub-microbatches): each run's rows, concatenated, are the whole's."""
    from harmonia.runtime.mllm_inputs import encoder_items, gather_media

    samples = [_sample(ckpt, _inputs(ckpt, sizes, seed=k), False)
               for k, sizes in enumerate([[(33, 97), (40, 40)], [(97, 33)], [(7, 120)]])]
    items = [item for s in samples for item, _ in encoder_items(s, "vision")]
    whole = pack_samples(samples).media["vision"]
    encoder, projector = ckpt.model.encoders["vision"], ckpt.model.projectors["vision_proj"]
    with torch.no_grad():
        want = encode_media(encoder, projector, whole)
        runs = [gather_media(items[a:b]) for a, b in ((0, 1), (1, 3), (3, 4))]
        got = torch.cat([projector(encoder(m.inputs), m.order) for m in runs])
    torch.testing.assert_close(got, want, **TOL)  # batch sizes differ: float rounding only


@pytest.mark.parametrize("tie", [True, False])
def test_siglip_tower_with_full_strategy_and_several_layers(tie, tmp_path):
    """SigLIP + Qwen2 under 'full' (every patch kept), hidden states [-2, -1] concatenated. The text
    config ties its head, but LlavaNextConfig ties by its own flag only (LlavaConfig takes the text's)."""
    hf, processor = write_llava_next(tmp_path / "hf", "full", seed=1, vision="siglip", layer=[-2, -1], tie=tie)
    spec = mllm_spec_from_hf(tmp_path / "hf")
    assert spec.encoders["vision"].feature_layers == (2, 3) and spec.llm.tie_embeddings == tie
    run = SimpleNamespace(processor=processor, spec=spec)
    batch = _inputs(run, [(33, 97), (61, 64)])
    with torch.no_grad():
        want = hf(**batch)
        one = pack_samples([_sample(run, batch)])
        model = load_whole(tmp_path / "hf", spec)
        torch.testing.assert_close(model(one), want.logits, **TOL)
        torch.testing.assert_close(model.loss(one, one.n_targets), want.loss, **TOL)


def test_preset_preprocessing_of_an_anyres_encoder_is_llava_next_processors(ckpt):
    """No preprocessor file: the family's constants in LLaVA-NeXT's processor give the same tiles."""
    enc = ckpt.spec.encoders["vision"]
    prep = ImagePreprocessor.for_encoder(enc, family="clip")
    for k, (h, w) in enumerate(SIZES[:4]):
        img = _image(h, w, k)
        want = ckpt.processor.image_processor(images=[img], return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(prep.tiles(img), want, rtol=0, atol=0)


def test_hf_generate_scores_a_llava_next_checkpoint(ckpt, tmp_path):
    """`harmonia hf generate` loads a LLaVA-NeXT directory with transformers and scores its answers."""
    import shutil

    from harmonia.train.hf_generate import _messages, generate_accuracy
    from harmonia.train.tiny_llava import CHAT_TEMPLATE

    path = tmp_path / "ckpt"  # the checkpoint with a template that renders typed image parts
    shutil.copytree(ckpt.path, path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    processor.chat_template = processor.tokenizer.chat_template = CHAT_TEMPLATE
    processor.save_pretrained(path)
    _image(40, 24, 3, tmp_path / "a.png")
    turns = [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "?"}]
    msgs, _ = _messages(turns)
    text = processor.apply_chat_template(msgs, add_generation_prompt=True)
    batch = processor(images=[Image.open(tmp_path / "a.png").convert("RGB")], text=[text], return_tensors="pt")
    with torch.no_grad():
        out = ckpt.hf.generate(**batch, max_new_tokens=6, do_sample=False)
    answer = processor.tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert answer  # a random model still says something
    rows = [{"image": "a.png", "task": "colour", "conversations": [turns[0], {"from": "gpt", "value": answer}]},
            {"image": "a.png", "task": "count", "conversations": [turns[0], {"from": "gpt", "value": answer + "x"}]}]
    (tmp_path / "held_out.json").write_text(json.dumps(rows))
    assert generate_accuracy(path, tmp_path / "held_out.json") == {"colour": (1.0, 1), "count": (0.0, 1)}
