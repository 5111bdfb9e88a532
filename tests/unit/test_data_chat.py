"""A checkpoint's tokenizer and chat template: labels on every assistant turn, LlavaProcessor's input_ids."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from harmonia.data.chat import HFTokenizer
from harmonia.data.conversation import Conversation, MediaRef, Turn
from harmonia.data.loader import build_tokenizer, open_dataset
from harmonia.data.media import write_wav
from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from harmonia.model.projector_spec import ProjectorSpec
from tests.unit._hf_tokenizer import END_OF_TURN, TEMPLATES, write_chat_tokenizer

QUESTIONS = ["What colour is the square?", "How many squares are there?", "Describe the picture in detail."]
ANSWERS = ["The square is red.", "There are two squares.", "A cat sits on a mat next to a dog."]


def llava_spec():
    """tiny-vlm with LLaVA-1.5's item rule: one 16 px tile, 4 px patches, class token dropped -> 16 tokens."""
    base = mllm_preset("tiny-vlm")
    enc = replace(base.encoders["vision"], token_merge=1, max_tiles=1, dropped_tokens=1)
    proj = ProjectorSpec("vision_proj", enc.out_dim, base.llm.hidden, base.llm.hidden, input_norm=False)
    return replace(base, encoders={"vision": enc}, projectors={"vision_proj": proj}, item_attention="causal")


def _conversation(turns: int = 3, image: bool = False) -> Conversation:
    out = []
    for q, a in list(zip(QUESTIONS, ANSWERS))[:turns]:
        out += [Turn("user", [q]), Turn("assistant", [a])]
    if image:
        out[0].parts.insert(0, MediaRef("image", "a.png"))
    return Conversation(out, "probe", None)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: HFTokenizer.from_pretrained(write_chat_tokenizer(root / name, name)) for name in TEMPLATES}


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_labels_cover_every_assistant_turn_and_its_end_token_only(tokenizers, template):
    tok = tokenizers[template]
    enc = tok.encode_conversation(_conversation(3, image=True), [5])
    eot = END_OF_TURN[template]
    runs, run = [], []  # maximal runs of learned tokens
    for i, t in zip(enc.ids, enc.targets):
        if t:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    # one run per assistant turn: its content (a token may carry the space before it) and end-of-turn token
    assert [tok.hf.decode(r).strip() for r in runs] == [a + eot for a in ANSWERS]
    eot_id = tok.hf.convert_tokens_to_ids(eot)
    assert all(r[-1] == eot_id for r in runs)
    unlearned = tok.hf.decode([i for i, t in zip(enc.ids, enc.targets) if not t])
    assert all(q in unlearned for q in QUESTIONS)
    assert enc.items == [(enc.ids.index(tok.item_token_ids["image"]), 5)]
    assert not any(enc.targets[enc.items[0][0]:enc.items[0][0] + 5])


def test_prefix_spans_agree_with_generation_blocks(tokenizers):
    """The same ChatML rendered with and without {% generation %} marks the same tokens."""
    a = tokenizers["chatml"].encode_conversation(_conversation(3), [])
    b = tokenizers["generation"].encode_conversation(_conversation(3), [])
    assert a.ids == b.ids and a.targets == b.targets


def test_default_system_prompt_and_bos_appear_once(tokenizers):
    qwen = tokenizers["qwen"]
    text, spans = qwen.render(_conversation(1))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.") and len(spans) == 1
    llama = tokenizers["llama3"]
    ids = llama.encode_conversation(_conversation(1), []).ids
    bos = llama.hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1  # the template's bos, not a second from the tokenizer


def test_labels_of_built_samples_are_next_token_targets(tmp_path):
    tok_dir = write_chat_tokenizer(tmp_path / "tok", "llama3")
    rows = [{"id": "r0", "conversations": [{"from": "human", "value": QUESTIONS[0]}, {"from": "gpt", "value": ANSWERS[0]},
                                           {"from": "human", "value": QUESTIONS[1]}, {"from": "gpt", "value": ANSWERS[1]}]}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    tok = build_tokenizer(tok_dir)
    ds = open_dataset(tmp_path / "d.json", llava_spec(), tokenizer=tok)
    (s,) = ds.load([0])
    ids, labels = s.tokens.input_ids, s.tokens.labels
    enc = tok.encode_conversation(ds.records[0], [])
    want = torch.tensor([ids[t + 1].item() if enc.targets[t + 1] else -100 for t in range(len(ids) - 1)] + [-100])
    assert torch.equal(labels, want)
    assert s.shape.text_tokens == len(ids) and s.answer == ANSWERS[1]
    assert tok.hf.decode(labels[labels != -100].tolist()) == "<|eot_id|>".join(ANSWERS[:2]) + "<|eot_id|>"


def _png(path, h, w, seed):
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return Image.open(path).convert("RGB")


@pytest.mark.parametrize("template", ["chatml", "typed"])
def test_input_ids_equal_llava_processor(tmp_path, template):
    """Each <image> becomes image_token x (16/4)^2 (+1 class token -1 'default'), tokenised as one string."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok_dir = write_chat_tokenizer(tmp_path / "tok", template)
    imgs = [_png(tmp_path / f"{k}.png", 20 + 7 * k, 30, k) for k in range(2)]
    rows = [{"id": "two-images", "images": ["0.png", "1.png"],
             "conversations": [{"from": "human", "value": "<image>\n" + QUESTIONS[0]}, {"from": "gpt", "value": ANSWERS[0]},
                               {"from": "human", "value": "And this one? <image>"}, {"from": "gpt", "value": ANSWERS[1]}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tok = build_tokenizer(tok_dir)
    ds = open_dataset(tmp_path / "d.jsonl", llava_spec(), tokenizer=tok)
    (s,) = ds.load([0])

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}),
        tokenizer=tok.hf, patch_size=4, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=TEMPLATES[template])
    if template == "typed":
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\n" + QUESTIONS[0]}]},
                    {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[0]}]},
                    {"role": "user", "content": [{"type": "text", "text": "And this one? "}, {"type": "image"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[1]}]}]
    else:
        messages = [{"role": "user", "content": "<image>\n" + QUESTIONS[0]}, {"role": "assistant", "content": ANSWERS[0]},
                    {"role": "user", "content": "And this one? <image>"}, {"role": "assistant", "content": ANSWERS[1]}]
    prompt = processor.apply_chat_template(messages)
    want = processor(text=prompt, images=imgs, return_tensors="pt")["input_ids"][0]
    assert tok.typed_parts == (template == "typed")
    assert torch.equal(s.tokens.input_ids, want)
    assert [n for kind, n in s.tokens.segments if kind == "item"] == [16, 16]


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path):
    tok_dir = write_chat_tokenizer(tmp_path / "tok", None)
    with pytest.raises(ConfigError, match="data.chat_template"):
        build_tokenizer(tok_dir)
    (tmp_path / "t.jinja").write_text(TEMPLATES["chatml"])
    tok = build_tokenizer(tok_dir, tmp_path / "t.jinja")
    assert tok.render(_conversation(1))[0].startswith("<|im_start|>user\n")


def test_media_without_item_token_is_a_bad_record(tmp_path):
    tok_dir = write_chat_tokenizer(tmp_path / "tok", "chatml", item_tokens=False)
    tok = build_tokenizer(tok_dir)  # the tokenizer's own image_token still names <image>
    assert tok.item_tokens == {"image": "<image>"}
    write_wav(tmp_path / "a.wav", np.zeros(8000, np.float32), 16000)
    rows = [{"messages": [{"role": "user", "content": "<audio> what?"}, {"role": "assistant", "content": "a tone"}],
             "audios": ["a.wav"]}]
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]))
    ds = open_dataset(tmp_path / "d.jsonl", mllm_preset("tiny-omni"), tokenizer=tok)
    assert ds.shapes() == [] and set(ds.stats.skipped) == {"unknown_modality"}
    assert "audio_token_index" in ds.stats.examples["unknown_modality"][0]


@pytest.mark.parametrize("template", ["chatml", "generation", None])
def test_turns_marked_not_learned_carry_no_labels(tmp_path, template):
    """ms-swift's "loss": false and axolotl's "weight": 0 keep a turn in the context but out of the loss."""
    from harmonia.data.tokenizer import ByteTokenizer

    msgs = []
    for k, (q, a) in enumerate(zip(QUESTIONS, ANSWERS)):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a, **({"loss": False} if k == 1 else {})}]
    rows = [{"messages": msgs}, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a",
                                                                                 "weight": 0}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss": 0.5}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tok = build_tokenizer(write_chat_tokenizer(tmp_path / "tok", template)) if template else ByteTokenizer()
    ds = open_dataset(tmp_path / "d.jsonl", llava_spec(), tokenizer=tok)
    assert len(ds) == 1 and ds.stats.skipped == {"bad_turns": 2}  # nothing learned; a scaled loss
    (s,) = ds.load([0])
    labels = s.tokens.labels[s.tokens.labels != -100].tolist()
    text = tok.decode(labels)
    assert ANSWERS[0] in text and ANSWERS[2] in text and ANSWERS[1] not in text
    assert ANSWERS[1] in tok.decode(s.tokens.input_ids.tolist())


def test_tokenizer_must_match_the_checkpoint_model(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": "a"}]}))
    tok = build_tokenizer(write_chat_tokenizer(tmp_path / "tok", "chatml"))
    image = tok.item_token_ids["image"]
    spec = replace(llava_spec(), item_token_ids={"image": image})
    assert len(open_dataset(tmp_path / "d.jsonl", spec, tokenizer=tok)) == 1
    with pytest.raises(ConfigError, match="byte tokenizer"):
        open_dataset(tmp_path / "d.jsonl", spec)
    with pytest.raises(ConfigError, match="same checkpoint"):
        open_dataset(tmp_path / "d.jsonl", replace(spec, item_token_ids={"image": image + 1}), tokenizer=tok)
