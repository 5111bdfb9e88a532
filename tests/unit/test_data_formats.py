"""Every dataset format users hold reads to the same samples; bad records are counted by kind."""

import io
import json
import tarfile

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from harmonia.data.loader import build_tokenizer, open_dataset
from harmonia.data.records import DataError
from harmonia.data.sources import dataset_splits, is_dataset
from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from tests.unit._hf_tokenizer import write_chat_tokenizer

SPEC = mllm_preset("tiny-vlm")
SAMPLES = [  # (id, image, system, [(question, answer), ...]); the image goes before the first question
    ("s0", (24, 40), None, [("What colour is the square?", "red"), ("How many squares?", "two")]),
    ("s1", None, None, [("What is 3+4?", "7")]),
    ("s2", (16, 16), "You are terse.", [("Describe the picture.", "A cat.")]),
]


def _png_bytes(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _turns(sample, tag: bool = True):
    _, image, system, qa = sample
    out = [("system", system)] if system else []
    for k, (q, a) in enumerate(qa):
        out += [("user", ("<image>\n" if image and k == 0 and tag else "") + q), ("assistant", a)]
    return out


def _llava(sample, with_image: bool = True) -> dict:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    row = {"id": sample[0], "conversations": [{"from": names[r], "value": v} for r, v in _turns(sample)]}
    if sample[1] and with_image:
        row["image"] = f"img/{sample[0]}.png"
    return row


def _messages(sample, typed: bool) -> dict:
    msgs = []
    for role, text in _turns(sample):
        if typed and text.startswith("<image>\n"):
            msgs.append({"role": role, "content": [{"type": "image"}, {"type": "text", "text": text[len("<image>"):]}]})
        elif typed:
            msgs.append({"role": role, "content": [{"type": "text", "text": text}]})
        else:
            msgs.append({"role": role, "content": text})
    row = {"id": sample[0], "messages": msgs}
    if sample[1]:
        row["images"] = [f"img/{sample[0]}.png"]
    return row


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same three conversations as LLaVA JSON / JSONL, messages JSONL (string and typed parts), and a shard."""
    root = tmp_path_factory.mktemp("formats")
    (root / "img").mkdir()
    for k, s in enumerate(SAMPLES):
        if s[1]:
            (root / "img" / f"{s[0]}.png").write_bytes(_png_bytes(*s[1], k))
    (root / "llava.json").write_text(json.dumps([_llava(s) for s in SAMPLES]))
    (root / "llava.jsonl").write_text("\n".join(json.dumps(_llava(s)) for s in SAMPLES))
    (root / "messages.jsonl").write_text("\n".join(json.dumps(_messages(s, False)) for s in SAMPLES))
    (root / "typed.jsonl").write_text("\n".join(json.dumps(_messages(s, True)) for s in SAMPLES))
    with tarfile.open(root / "shard-0.tar", "w") as tar:
        for s in SAMPLES:
            _add(tar, f"{s[0]}.json", json.dumps(_llava(s, with_image=False)).encode())
            if s[1]:
                _add(tar, f"{s[0]}.png", (root / "img" / f"{s[0]}.png").read_bytes())
    tok = build_tokenizer(write_chat_tokenizer(root / "tok", "qwen"))
    return root, tok


@pytest.mark.parametrize("name", ["llava.jsonl", "messages.jsonl", "typed.jsonl", "shard-0.tar"])
def test_every_format_gives_the_same_samples(formats, name):
    root, tok = formats
    ref = open_dataset(root / "llava.json", SPEC, tokenizer=tok)
    ds = open_dataset(root / name, SPEC, tokenizer=tok)
    assert len(ds) == len(ref) == 3
    assert ds.shapes() == ref.shapes()
    for a, b in zip(ds.load([0, 1, 2]), ref.load([0, 1, 2])):
        assert torch.equal(a.tokens.input_ids, b.tokens.input_ids)
        assert torch.equal(a.tokens.labels, b.tokens.labels)
        assert len(a.tokens.items) == len(b.tokens.items)
        for x, y in zip(a.tokens.items, b.tokens.items):
            assert torch.equal(x.inputs, y.inputs)
    assert ds.stats.metrics() == {"data/loaded": 3, "data/skipped": 0}
    s0, s1, s2 = ref.load([0, 1, 2])
    assert [i.modality for i in s0.shape.items] == ["image"] and s0.shape.items[0].height == 24
    assert s1.shape.items == () and s2.answer == "A cat."
    assert "You are terse." in tok.decode(s2.tokens.input_ids.tolist())


def test_byte_tokenizer_reads_users_formats_too(formats):
    root, _ = formats
    ds = open_dataset(root / "llava.json", SPEC)
    s1 = ds.load([1])[0]
    assert bytes(s1.tokens.input_ids[1:-1].tolist()) == b"What is 3+4?7"  # bos, question, answer, eos


def test_webdataset_captions_and_metadata_json(tmp_path):
    with tarfile.open(tmp_path / "caps.tar", "w") as tar:
        _add(tar, "c0.jpg", _png_bytes(16, 32, 0))
        _add(tar, "c0.txt", b"A red square on grey.")
        _add(tar, "c1.png", _png_bytes(16, 16, 1))
        _add(tar, "c1.txt", b"Noise.")
        _add(tar, "c1.json", json.dumps({"url": "http://x", "width": 16}).encode())  # LAION-style metadata
        _add(tar, "c2.cls", b"3")  # not a sample
    ds = open_dataset(tmp_path / "caps.tar", SPEC)
    shapes = ds.shapes()
    assert len(shapes) == 2 and [s.items[0].width for s in shapes] == [32, 16]
    s = ds.load([0])[0]
    assert s.answer == "A red square on grey."
    targets = s.tokens.labels[s.tokens.labels != -100]
    assert bytes(targets[:-1].tolist()).decode() == "A red square on grey."


def _bad_rows(root) -> list[bytes]:
    (root / "img").mkdir(exist_ok=True)
    (root / "img" / "a.png").write_bytes(_png_bytes(16, 16, 0))
    (root / "img" / "b.png").write_bytes(_png_bytes(16, 24, 1))
    (root / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root.parent / "outside.png").write_bytes(_png_bytes(16, 16, 2))

    def conv(q, **extra):
        return json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "ok"}], **extra})

    return [
        conv("<image>\nfine", image="img/a.png").encode(),  # good
        conv("fine too").encode(),  # good
        b'{"conversations": [',  # bad_json
        b'{"conversations": "\xff\xfe"}',  # bad_utf8
        json.dumps({"question": "q", "answer_text": "a"}).encode(),  # unknown_schema
        json.dumps({"conversations": "hello"}).encode(),  # bad_turns
        json.dumps({"conversations": [{"from": "alien", "value": "x"}]}).encode(),  # bad_turns
        json.dumps({"conversations": [{"from": "human", "value": "no answer"}]}).encode(),  # bad_turns
        conv("<image><image> two tags", image="img/a.png").encode(),  # placeholder_mismatch: more tags
        conv("<image> one tag", images=["img/a.png", "img/b.png"]).encode(),  # placeholder_mismatch: fewer
        conv("no tag", image="img/a.png").encode(),  # placeholder_mismatch: none
        conv("<image>", image="../outside.png").encode(),  # outside_root
        conv("<image>", image=str(root.parent / "outside.png")).encode(),  # outside_root (absolute)
        conv("<image>", image="img/missing.png").encode(),  # missing_file
        conv("<image>", image="img/broken.png").encode(),  # corrupt_media
    ]


BAD_KINDS = {"bad_json": 1, "bad_utf8": 1, "unknown_schema": 1, "bad_turns": 3, "placeholder_mismatch": 3,
             "outside_root": 2, "missing_file": 1, "corrupt_media": 1}


def test_planted_bad_records_are_counted_by_kind_and_skipped(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "d.jsonl").write_bytes(b"\n".join(_bad_rows(root)) + b"\n")
    ds = open_dataset(root / "d.jsonl", SPEC)
    assert len(ds) == 4  # 2 good, a missing and a corrupt image: read-time failures never become records
    good = ds.shapes()
    loaded = [s for b in ds.iter_load([[g.sample_id for g in good]], num_workers=2) for s in b]
    assert len(loaded) == 2 and [s.answer for s in loaded] == ["ok", "ok"]
    assert dict(ds.stats.skipped) == BAD_KINDS
    where = " ".join(m for ms in ds.stats.examples.values() for m in ms)
    assert "d.jsonl:3" in where and "d.jsonl:4" in where and "outside the media root" in where
    ds.load([g.sample_id for g in good])  # reading again counts nothing twice
    assert dict(ds.stats.skipped) == BAD_KINDS

    allowed = open_dataset(root / "d.jsonl", SPEC, allow_outside_root=True)
    assert len(allowed) == 6 and "outside_root" not in allowed.stats.skipped
    assert len(allowed.load(list(range(6)))) == 4
    with pytest.raises(DataError, match="not JSON"):
        open_dataset(root / "d.jsonl", SPEC, on_error="fail")


def test_format_override_and_errors(formats, tmp_path):
    root, _ = formats
    with pytest.raises(ConfigError, match=r"first 3 records do not match data.format=messages: keys found "
                       r"\['conversations', 'id', 'image'\]"):
        open_dataset(root / "llava.json", SPEC, format="messages")
    assert len(open_dataset(root / "shard-0.tar", SPEC, format="llava")) == 3
    with pytest.raises(ConfigError, match="webdataset"):
        open_dataset(root / "llava.json", SPEC, format="webdataset")
    with pytest.raises(ConfigError, match="format="):
        open_dataset(root / "llava.json", SPEC, format="sharegpt4")


def _llava_rows(root, name: str, n: int) -> str:
    (root / name).write_text("\n".join(json.dumps({"id": f"{name}-{i}", "conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}) for i in range(n)))
    return name


def test_llava_next_yaml_mixture(tmp_path):
    sub = tmp_path / "ann"
    sub.mkdir()
    entries = [{"json_path": f"ann/{_llava_rows(sub, f'{k}.jsonl', 10)}", "sampling_strategy": s}
               for k, s in enumerate(["all", "first:3", "end:2", "random:50%", "first:25%"])]
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({"datasets": entries}))
    ds = open_dataset(tmp_path / "mix.yaml", SPEC, seed=1)
    ids = [c.id for c in ds.records]
    assert len(ids) == 10 + 3 + 2 + 5 + 3
    assert ids[10:15] == ["1.jsonl-0", "1.jsonl-1", "1.jsonl-2", "2.jsonl-8", "2.jsonl-9"]
    assert [c.id for c in open_dataset(tmp_path / "mix.yaml", SPEC, seed=1).records] == ids  # seeded
    assert len(open_dataset(tmp_path, SPEC).records) == len(ids)  # a directory with a mixture reads the mixture
    entries[1]["sampling_strategy"] = "middle:3"
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({"datasets": entries}))
    with pytest.raises(ConfigError, match="sampling_strategy"):
        open_dataset(tmp_path / "mix.yaml", SPEC)
    entries[1] = {"json_path": "ann/1.jsonl", "weight": 2}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({"datasets": entries}))
    with pytest.raises(ConfigError, match="unsupported keys"):
        open_dataset(tmp_path / "mix.yaml", SPEC)


def test_internvl_meta_json_mixture_with_roots_and_repeats(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name / "images").mkdir(parents=True)
        (tmp_path / name / "images" / "x.png").write_bytes(_png_bytes(16, 16, 0))
    rows = [json.dumps({"id": f"a{i}", "image": "x.png", "conversations": [
        {"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]}) for i in range(3)]
    rows.append(json.dumps({"id": "bad", "image": "x.png", "conversations": [
        {"from": "human", "value": "no tag"}, {"from": "gpt", "value": "a"}]}))
    (tmp_path / "a" / "ann.jsonl").write_text("\n".join(rows))
    _llava_rows(tmp_path / "b", "ann.jsonl", 10)
    meta = {"a": {"root": "a/images", "annotation": "a/ann.jsonl", "repeat_time": 2, "length": 4},
            "b": {"root": "b/images", "annotation": "b/ann.jsonl", "repeat_time": 0.5, "length": 10}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    ds = open_dataset(tmp_path / "meta.json", SPEC)
    assert [c.id for c in ds.records] == ["a0", "a1", "a2"] * 2 + [f"ann.jsonl-{i}" for i in range(5)]
    assert ds.records[0] is ds.records[3]  # a repeat is the same record, decoded on demand
    assert len(ds.shapes()) == 11 and dict(ds.stats.skipped) == {"placeholder_mismatch": 1}  # counted once
    meta["a"]["max_dynamic_patch"] = 6
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="max_dynamic_patch"):
        open_dataset(tmp_path / "meta.json", SPEC)


def test_is_dataset_never_claims_a_users_directory(tmp_path):
    assert not is_dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert not is_dataset(tmp_path / "empty")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("anything")
    assert is_dataset(tmp_path / "mine")
    (tmp_path / "file.json").write_text("[]")
    assert is_dataset(tmp_path / "file.json")
    (tmp_path / "synth" / "train").mkdir(parents=True)
    (tmp_path / "synth" / "heldout").mkdir()
    assert dataset_splits(tmp_path / "synth") == (tmp_path / "synth" / "train", tmp_path / "synth" / "heldout")
    assert dataset_splits(tmp_path / "mine") == (tmp_path / "mine", None)


def _mp4(n_frames: int, fps: int = 4, side: int = 16) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        for i in range(n_frames):
            img = np.full((side, side, 3), 20 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _wav(seconds: float) -> bytes:
    from harmonia.data.media import write_wav

    buf = io.BytesIO()
    write_wav(buf, np.zeros(int(16000 * seconds), np.float32), 16000)
    return buf.getvalue()


def test_audio_and_video_in_shards_and_messages_columns(tmp_path):
    """key.wav / key.mp4 members and messages' audios / videos columns become audio and video items."""
    spec = mllm_preset("tiny-omni")
    with tarfile.open(tmp_path / "av.tar", "w") as tar:
        _add(tar, "a0.wav", _wav(1.5))
        _add(tar, "a0.json", json.dumps({"messages": [{"role": "user", "content": "<audio>\nLow or high?"},
                                                      {"role": "assistant", "content": "low"}]}).encode())
        _add(tar, "v0.mp4", _mp4(12))
        _add(tar, "v0.txt", b"A fading square.")
    (tmp_path / "a.wav").write_bytes(_wav(1.5))
    (tmp_path / "v.mp4").write_bytes(_mp4(12))
    row = {"messages": [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "\nLow or high?"}]},
                        {"role": "assistant", "content": "low"}], "audios": ["a.wav"]}
    row_v = {"messages": [{"role": "user", "content": "<video>"}, {"role": "assistant", "content": "A fading square."}],
             "videos": ["v.mp4"]}
    (tmp_path / "m.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row_v))
    shard = open_dataset(tmp_path / "av.tar", spec, max_frames=4)
    files = open_dataset(tmp_path / "m.jsonl", spec, max_frames=4)
    assert shard.shapes() == files.shapes()
    a, v = shard.shapes()
    assert a.items[0].modality == "audio" and a.items[0].seconds == pytest.approx(1.5)
    assert v.items[0].modality == "video" and v.items[0].frames == 4
    for x, y in zip(shard.load([0, 1]), files.load([0, 1])):
        assert torch.equal(x.tokens.input_ids, y.tokens.input_ids)
        assert torch.equal(x.tokens.items[0].inputs, y.tokens.items[0].inputs)
    assert shard.stats.metrics()["data/skipped"] == 0


def test_empty_assistant_turns_are_bad_records(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},
            {"prompt": "q", "answer": ""},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine"}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ds = open_dataset(tmp_path / "d.jsonl", SPEC)
    assert len(ds) == 1 and dict(ds.stats.skipped) == {"bad_turns": 2}
    assert "empty" in ds.stats.examples["bad_turns"][0]


@pytest.mark.parametrize("record, unread", [
    ({"question": "What is this?", "answer": "a cat", "image": "img/a.png"}, "'image', 'question'"),
    ({"prompt": "<image> what?", "answer": "a cat", "image": "img/a.png"}, "'image'"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "tools": "[]"},
     "'tools'"),
    ({"answer": "7"}, None),
])
def test_a_record_is_read_only_by_a_format_that_explains_every_key(tmp_path, record, unread):
    """An image beside ``prompt`` or ``question`` was read as harmonia's manifest without its image."""
    from harmonia.data.formats import detect_schema, to_conversation
    from harmonia.data.records import DirSource, RawRecord

    assert detect_schema(record) is None
    raw = RawRecord(record, "d.jsonl:1", DirSource(tmp_path))
    with pytest.raises(DataError, match="unknown_schema|record has keys") as err:
        to_conversation(raw)
    assert err.value.kind == "unknown_schema"
    if unread:
        assert f"has [{unread}], which it does not read" in str(err.value)
    assert detect_schema({"prompt": "p", "answer": "a", "media": [], "id": "x", "task": "t"}) == "harmonia"
    assert detect_schema({"messages": [], "images": [], "id": "x"}) == "messages"


@pytest.mark.parametrize("rows, keys", [
    ([{"instruction": "Add", "input": "3+4", "output": "7"}] * 20, "['input', 'instruction', 'output']"),
    ([{"query": "hi", "response": "yo"}] * 5, "['query', 'response']"),
    ([{"question": "what?", "answer": "a cat", "image": "a.png"}] * 3, "['answer', 'image', 'question']"),
])
def test_a_source_whose_first_records_match_no_format_stops_with_one_message(tmp_path, rows, keys):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as err:
        open_dataset(tmp_path / "d.jsonl", SPEC)
    message = str(err.value)
    assert f"records match no format: keys found {keys}" in message
    assert "llava ('conversations'" in message and "messages ('messages'" in message
    assert f"first {min(len(rows), 16)} records" in message


def test_a_few_unknown_records_among_known_ones_are_counted(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    rows = [{"query": "hi"}] * 3 + [good] * 4
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = open_dataset(tmp_path / "d.jsonl", SPEC)
    assert len(ds) == 4 and dict(ds.stats.skipped) == {"unknown_schema": 3}
