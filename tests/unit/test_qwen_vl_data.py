"""Qwen-VL data and pricing: token counts from image headers equal the checkpoint's processor's, decoded
samples equal what transformers' tokenizer and image processor give, and the cost model prices the
windows the tower attends within."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize  # noqa: E402

from harmonia.data.chat import HFTokenizer  # noqa: E402
from harmonia.data.media import build_media_preprocessors  # noqa: E402
from harmonia.data.samples import SampleBuilder  # noqa: E402
from harmonia.data.sources import read_conversations  # noqa: E402
from harmonia.errors import SampleError  # noqa: E402
from harmonia.model.hf.mllm import mllm_spec_from_hf  # noqa: E402
from harmonia.model.qwen_vit import plan_windows  # noqa: E402
from harmonia.train.tiny_qwen_vl import IMAGE_PAD, write_tiny_qwen_vl  # noqa: E402
from harmonia.workload.layers import module_layers  # noqa: E402
from harmonia.workload.shapes import (  # noqa: E402
    ModalityItem,
    SampleShape,
    llm_tokens_of_item,
    native_grid,
    smart_resize,
    window_sequences,
)
from harmonia.workload.work import sample_loads  # noqa: E402

SIZES = [(32, 32), (17, 95), (400, 9), (1000, 1000), (3, 500), (64, 48), (123, 77), (28, 28 * 150)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_qwen_vl(tmp_path_factory.mktemp("qwen") / "base")


@pytest.mark.parametrize("factor, low, high", [(28, 56 * 56, 28 * 28 * 1280), (16, 32 * 32, 64 * 64), (8, 64, 4096)])
def test_smart_resize_is_transformers(factor, low, high):
    for h, w in SIZES:
        assert smart_resize(h, w, factor, low, high) == hf_smart_resize(h, w, factor, low, high), (h, w)
    with pytest.raises(SampleError, match="aspect ratio"):
        smart_resize(2, 500, factor, low, high)


def test_header_counts_and_patches_are_the_processors(ckpt):
    spec = mllm_spec_from_hf(ckpt)
    enc = spec.encoders["vision"]
    prep = build_media_preprocessors(spec, {"vision": ckpt})["vision"]
    processor = transformers.AutoImageProcessor.from_pretrained(ckpt)
    rng = np.random.default_rng(0)
    for h, w in [(32, 32), (20, 90), (90, 20), (200, 150), (7, 9)]:
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        want = processor(images=[img], return_tensors="pt")
        item = ModalityItem.image(height=h, width=w)
        assert native_grid(item, enc) == tuple(want["image_grid_thw"][0].tolist())
        assert llm_tokens_of_item(item, enc) == int(want["image_grid_thw"].prod()) // 4
        rows, grid = prep.patches(img)
        assert torch.equal(grid, want["image_grid_thw"]) and torch.equal(rows, want["pixel_values"])


def test_windows_and_their_price_are_the_towers(ckpt):
    spec = mllm_spec_from_hf(ckpt)
    enc = spec.encoders["vision"]
    tower = enc.native
    for h, w in [(32, 32), (20, 90), (200, 150), (64, 40)]:
        item = ModalityItem.image(height=h, width=w)
        grid = native_grid(item, enc)
        _, lengths = plan_windows([grid], tower.merge_size, tower.window_tokens)
        assert window_sequences(item, enc) == lengths
    item = ModalityItem.image(height=64, width=64)
    load = sample_loads(SampleShape(5, (item,), (2,)), spec)["vision"]
    assert load.pairs == 64 * 64 and load.window_pairs == 4 * 16 * 16  # 8x8 patches: four 4x4 windows
    blocks = [layer for layer in module_layers(spec)["vision"] if layer.kind == "block"]
    assert [b.windowed for b in blocks] == [i not in tower.full_attention_layers for i in range(len(blocks))]


def test_decoded_samples_are_transformers(ckpt, tmp_path):
    spec = mllm_spec_from_hf(ckpt)
    rng = np.random.default_rng(1)
    records = []
    for k, (h, w) in enumerate([(32, 48), (90, 20)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"{k}.png")
        records.append({"id": k, "image": f"{k}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is the square?"}, {"from": "gpt", "value": "red"}]})
    (tmp_path / "data.json").write_text(json.dumps(records))
    builder = SampleBuilder(spec, HFTokenizer.from_pretrained(ckpt),
                            preprocessors=build_media_preprocessors(spec, {"vision": ckpt}))
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    processor = transformers.AutoImageProcessor.from_pretrained(ckpt)
    conversations, bad, _ = read_conversations(tmp_path / "data.json")
    assert not bad and len(conversations) == 2
    for k, conv in enumerate(conversations):
        built = builder.build(conv, k)
        assert builder.shape(conv, k) == built.shape  # headers only: the same token counts
        media = processor(images=[Image.open(tmp_path / f"{k}.png").convert("RGB")], return_tensors="pt")
        n = int(media["image_grid_thw"].prod()) // 4
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat colour is the square?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
        text = tok.apply_chat_template(msgs, tokenize=False).replace(IMAGE_PAD, IMAGE_PAD * n)
        assert built.tokens.input_ids.tolist() == tok(text)["input_ids"]
        (item,) = built.tokens.items
        assert torch.equal(item.inputs, media["pixel_values"]) and torch.equal(item.grid, media["image_grid_thw"])
        assert built.tokens.rope_positions.shape == (3, len(built.tokens))


def test_a_sample_decoded_again_takes_its_tokens_from_memory(ckpt, tmp_path, monkeypatch):
    """A later epoch's decode neither renders nor tokenizes the conversation again, and gives the same
    sample; a cache with no room keeps nothing and changes nothing."""
    spec = mllm_spec_from_hf(ckpt)
    Image.fromarray(np.zeros((32, 48, 3), dtype=np.uint8)).save(tmp_path / "0.png")
    (tmp_path / "data.json").write_text(json.dumps([{"id": 0, "image": "0.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "red"},
        {"from": "human", "value": "And now?"}, {"from": "gpt", "value": "blue"}]}]))
    (conv,), _, _ = read_conversations(tmp_path / "data.json")
    tokenizer = HFTokenizer.from_pretrained(ckpt)
    calls = []
    encode = tokenizer.encode_conversation
    monkeypatch.setattr(tokenizer, "encode_conversation", lambda *a: calls.append(1) or encode(*a))
    prep = build_media_preprocessors(spec, {"vision": ckpt})
    builder = SampleBuilder(spec, tokenizer, preprocessors=prep)
    first, again = builder.build(conv, 0), builder.build(conv, 0)
    assert len(calls) == 1 and len(builder.encoded) == 1
    for a, b in ((first.tokens.input_ids, again.tokens.input_ids), (first.tokens.labels, again.tokens.labels),
                 (first.tokens.rope_positions, again.tokens.rope_positions)):
        assert torch.equal(a, b)
    assert first.tokens.segments == again.tokens.segments and first.shape == again.shape
    from harmonia.data.encoded_cache import EncodedCache

    full = SampleBuilder(spec, tokenizer, preprocessors=prep, encoded=EncodedCache(limit=0))
    assert torch.equal(full.build(conv, 0).tokens.labels, first.tokens.labels) and len(full.encoded) == 0
    assert len(calls) == 2


def test_hf_generate_takes_a_qwen_vl_checkpoint_without_video_support(ckpt, tmp_path, capsys):
    """`harmonia hf generate` on a Qwen-VL directory where transformers' video processor cannot load
    (no torchvision): the processor class without it gives what its image processor and tokenizer give
    (each image pad repeated for its grid), the checkpoint's own greedy answer scores 100%, and a video
    record is refused by name instead of being answered without its video."""
    from transformers.utils import is_torchvision_available

    from harmonia.errors import ConfigError
    from harmonia.train.hf_generate import _messages, generate_accuracy, load_processor

    Image.fromarray(np.random.default_rng(2).integers(0, 255, (40, 24, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    turns = [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "?"}]
    msgs, _ = _messages(turns)
    processor = load_processor(ckpt)
    if not is_torchvision_available():
        assert processor.video_processor is None
    image = Image.open(tmp_path / "a.png").convert("RGB")
    batch = processor(images=[image], text=[processor.apply_chat_template(msgs, add_generation_prompt=True)],
                      return_tensors="pt")
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    media = transformers.AutoImageProcessor.from_pretrained(ckpt)(images=[image], return_tensors="pt")
    n = int(media["image_grid_thw"].prod()) // 4
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert batch["input_ids"][0].tolist() == tok(prompt.replace(IMAGE_PAD, IMAGE_PAD * n))["input_ids"]
    assert torch.equal(batch["pixel_values"], media["pixel_values"])
    model = transformers.AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    answer = tok.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert answer  # a random model still says something
    rows = [{"image": "a.png", "task": "colour", "conversations": [turns[0], {"from": "gpt", "value": answer}]},
            {"images": ["a.png"], "task": "count", "conversations": [turns[0], {"from": "gpt", "value": answer + "x"}]}]
    (tmp_path / "held_out.json").write_text(json.dumps(rows))
    assert generate_accuracy(ckpt, tmp_path / "held_out.json") == {"colour": (1.0, 1), "count": (0.0, 1)}
    messages = [{"role": "user", "content": turns[0]["value"]}, {"role": "assistant", "content": answer}]
    (tmp_path / "held_out.jsonl").write_text(json.dumps({"messages": messages, "images": ["a.png"]}) + "\n")
    assert generate_accuracy(ckpt, tmp_path / "held_out.jsonl") == {"all": (1.0, 1)}  # messages JSONL, no task
    from harmonia.train.hf_generate import main

    main([str(ckpt), str(tmp_path / "held_out.jsonl")])  # a task of no known answers: no chance figure
    assert re.search(r"all\W+1\W+100%\W+-", capsys.readouterr().out)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "bot", "content": "?"}]}) + "\n")
    with pytest.raises(ConfigError, match="'role'/'content' with a role among"):
        generate_accuracy(ckpt, tmp_path / "bad.jsonl")
    rows.append({"id": "clip0", "video": "clip0.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhich way?"}, {"from": "gpt", "value": "left"}]})
    (tmp_path / "held_out.json").write_text(json.dumps(rows))
    with pytest.raises(ConfigError, match="record 'clip0' holds a video"):
        generate_accuracy(ckpt, tmp_path / "held_out.json")
