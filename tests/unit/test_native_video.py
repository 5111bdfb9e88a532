"""Qwen-VL videos: harmonia's video processors equal transformers' (frame indices, sizes, grids, pixel
values, ``second_per_grid_ts``, Qwen3-VL's timestamped prompt) on the reference cases in
tests/fixtures, and a decoded video sample has the header's shape, transformers' tokens and
transformers' rotary positions (Qwen3-VL's: and transformers' logits)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from harmonia.data.chat import HFTokenizer  # noqa: E402
from harmonia.data.loader import MultimodalDataset  # noqa: E402
from harmonia.data.media import build_media_preprocessors  # noqa: E402
from harmonia.data.native_video import NativeVideoPreprocessor  # noqa: E402
from harmonia.data.samples import SampleBuilder  # noqa: E402
from harmonia.data.sources import read_conversations  # noqa: E402
from harmonia.errors import ConfigError  # noqa: E402
from harmonia.model.hf.mllm import mllm_spec_from_hf  # noqa: E402
from harmonia.model.qwen_spec import native_encoder_spec, spec_from_hf  # noqa: E402
from harmonia.model.video_spec import VideoNumbers, frame_texts  # noqa: E402
from harmonia.train.tiny_qwen_vl import VIDEO_PAD, write_tiny_qwen_vl  # noqa: E402
from harmonia.workload.shapes import ModalityItem, item_parts, llm_tokens_of_item, native_grid  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from make_qwen_video_reference import frames  # noqa: E402

REFERENCE = safe_open(FIXTURES / "qwen_video_reference.safetensors", "pt")
CASES = json.loads(REFERENCE.metadata()["cases"])
REFERENCE3 = safe_open(FIXTURES / "qwen3_video_reference.safetensors", "pt")
CASES3 = json.loads(REFERENCE3.metadata()["cases"])


def _encoder(config: dict):
    """A Qwen2-VL tower spec with the case's patch size and the case's video processor numbers."""
    hf = transformers.Qwen2VLConfig(vision_config=dict(depth=1, embed_dim=32, mlp_ratio=2, hidden_size=64,
                                                       num_heads=4, patch_size=config["patch_size"],
                                                       spatial_merge_size=2, temporal_patch_size=2)).to_dict()
    video = VideoNumbers.from_config(config, config["patch_size"] * 2, "case")
    return native_encoder_spec(spec_from_hf(hf), "vision", video=video)


def _checked_frames(enc, case: dict, reference) -> tuple[NativeVideoPreprocessor, list[int]]:
    """The case's video processor (its mean, std and rescale factor) and sampled frame indices,
    checked against the reference: indices, grid and pixel values bit for bit."""
    config = case["config"]
    prep = NativeVideoPreprocessor(enc, tuple(config["image_mean"]), tuple(config["image_std"]),
                                   config["rescale_factor"])
    total = case["total"]
    indices = prep.indices(total, case["fps"], case["call"].get("max_frames"))
    assert indices == case["indices"]
    rows, grid = prep.patches(frames(total, case["height"], case["width"])[indices])
    assert list(grid) == case["grid"]
    assert torch.equal(rows, reference.get_tensor(case["key"]))
    return prep, indices


@pytest.mark.parametrize("name", list(CASES))
def test_the_video_processor_is_transformers(name):
    case = CASES[name]
    config = case["config"]
    enc = _encoder(config)
    prep, indices = _checked_frames(enc, case, REFERENCE)
    total, fps = case["total"], case["fps"]
    assert prep.second_per_grid(len(indices), total, fps) == case["second_per_grid"]
    item = ModalityItem.video(frames=len(indices), height=case["height"], width=case["width"])
    assert native_grid(item, enc) == tuple(case["grid"])  # from the header alone
    assert llm_tokens_of_item(item, enc) == int(np.prod(case["grid"])) // 4


def test_video_numbers_refuse_what_harmonia_does_not_implement():
    for bad, match in [({"num_frames": 8}, "samples a video's frames by rate"), ({"resample": 2}, "bicubic"),
                       ({"do_center_crop": True}, "resize, rescale and normalise"),
                       ({"frame_stride": 2}, "not understood")]:
        with pytest.raises(ConfigError, match=match):
            VideoNumbers.from_config(bad, 28, "video_preprocessor_config.json")


def _mp4(n_frames: int, fps: int, height: int, width: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for k, frame in enumerate(frames(n_frames, height, width)):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _record(k: int, media: dict, question: str = "<video>\nWhat moves?") -> dict:
    return {"id": k, **media, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "x"}]}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_a_video_sample_has_the_headers_shape_and_transformers_tokens_and_positions(family, tmp_path):
    ckpt = write_tiny_qwen_vl(tmp_path / "ckpt", family)
    spec = mllm_spec_from_hf(ckpt)
    (tmp_path / "v.mp4").write_bytes(_mp4(21, 10, 40, 24))
    (tmp_path / "w.mp4").write_bytes(_mp4(9, 3, 24, 56))
    (tmp_path / "data.json").write_text(json.dumps([
        _record(0, {"video": "v.mp4"}),
        _record(1, {"video": "w.mp4", "image": "v.png"}, "<image> then <video>\nWhich changed?")]))
    from PIL import Image

    Image.fromarray(frames(1, 30, 20)[0]).save(tmp_path / "v.png")
    builder = SampleBuilder(spec, HFTokenizer.from_pretrained(ckpt),
                            preprocessors=build_media_preprocessors(spec, {"vision": ckpt}))
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(ckpt).model
    conversations, bad, _ = read_conversations(tmp_path / "data.json")
    assert not bad
    for k, conv in enumerate(conversations):
        built = builder.build(conv, k)
        assert builder.shape(conv, k) == built.shape  # headers only: the same frames and token counts
        video = built.tokens.items[-1]
        t, h, w = video.grid[0].tolist()
        assert t == built.shape.items[-1].frames // 2 and video.inputs.shape == (t * h * w, 3 * 2 * 8 * 8)
        ids = built.tokens.input_ids
        assert int((ids == tok.convert_tokens_to_ids(VIDEO_PAD)).sum()) == t * h * w // 4
        types = (ids == spec.item_token_ids["image"]).int() + 2 * (ids == spec.item_token_ids["video"]).int()
        extra = {"second_per_grid_ts": torch.tensor([video.second_per_grid])} if family == "qwen2_5_vl" else {}
        images = [i.grid[0].tolist() for i in built.tokens.items[:-1]]
        want, _ = hf.get_rope_index(ids[None], types[None], image_grid_thw=torch.tensor(images) if images else None,
                                    video_grid_thw=video.grid, **extra)
        assert torch.equal(built.tokens.rope_positions, want[:, 0])
    # 21 frames at 10 fps sampled at 2 per second: 4 frames (min_frames) at transformers' indices
    assert conversations and builder.build(conversations[0], 0).shape.items[0].frames == 4


def test_videos_that_cannot_be_read_are_counted_bad_records(tmp_path):
    ckpt = write_tiny_qwen_vl(tmp_path / "ckpt")
    spec = mllm_spec_from_hf(ckpt)
    (tmp_path / "one.mp4").write_bytes(_mp4(1, 4, 16, 16))  # one frame: no whole temporal patch
    (tmp_path / "ok.mp4").write_bytes(_mp4(8, 4, 16, 16))
    (tmp_path / "data.json").write_text(json.dumps([
        _record(0, {"video": "one.mp4"}), _record(1, {"video": "ok.mp4"}),
        _record(2, {"video": "ok.mp4"}, "no tag here")]))
    data = MultimodalDataset(tmp_path / "data.json", spec, tokenizer=HFTokenizer.from_pretrained(ckpt),
                             preprocessors=build_media_preprocessors(spec, {"vision": ckpt}), max_frames=2)
    shapes = data.shapes()
    assert [s.sample_id for s in shapes] == [1]
    assert shapes[0].items[0].frames == 2  # data.max_frames caps the processor's frames
    assert sum(data.stats.skipped.values()) == 2
    assert "temporal patch" in " ".join(data.stats.examples["unsupported_media"])


@pytest.mark.parametrize("name", list(CASES3))
def test_the_qwen3_video_processor_and_prompt_are_transformers(name):
    """Qwen3-VL's video processor: frames sampled by ``linspace``, sized with the clip's pixel
    bounds, and the prompt text of each temporal group (its timestamp) as its processor writes it."""
    case = CASES3[name]
    config = case["config"]
    patch = config["patch_size"]
    hf = transformers.Qwen3VLConfig(vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                                                       patch_size=patch, spatial_merge_size=2, temporal_patch_size=2,
                                                       out_hidden_size=64, num_position_embeddings=16,
                                                       deepstack_visual_indexes=[0])).to_dict()
    enc = native_encoder_spec(spec_from_hf(hf), "vision",
                              video=VideoNumbers.from_config(config, patch * 2, "case", "qwen3_vl"))
    prep, indices = _checked_frames(enc, case, REFERENCE3)
    fps = case["fps"]
    item = ModalityItem("video", height=case["height"], width=case["width"], frames=len(indices),
                        times=prep.timestamps(indices, fps))
    assert native_grid(item, enc) == tuple(case["grid"])  # from the header alone
    parts = item_parts(item, enc)
    t, h, w = case["grid"]
    assert [native_grid(p, enc) for p in parts] == [(1, h, w)] * t
    prompt = "".join(frame_texts(p.times[0])[0] + VIDEO_PAD * llm_tokens_of_item(p, enc) + frame_texts(p.times[0])[1]
                     for p in parts)
    assert prompt == case["prompt"]


def test_a_qwen3_vl_video_sample_is_transformers_prompt_positions_and_logits(tmp_path):
    """A decoded Qwen3-VL video sample: the header's shape, the ids of transformers' prompt (the
    template's text with the video token replaced by `Qwen3VLProcessor.replace_video_token`'s
    timestamps and runs), transformers' rotary positions, and transformers' logits."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from harmonia.data.tokenizer import Framed
    from harmonia.model.batch import pack_samples
    from harmonia.train.tiny_qwen_vl import END, START
    from tests.unit.test_model_hf_llava import load_whole

    ckpt = write_tiny_qwen_vl(tmp_path / "ckpt", "qwen3_vl")
    spec = mllm_spec_from_hf(ckpt)
    (tmp_path / "v.mp4").write_bytes(_mp4(21, 10, 40, 24))
    (tmp_path / "w.mp4").write_bytes(_mp4(9, 3, 24, 56))
    from PIL import Image

    Image.fromarray(frames(1, 30, 20)[0]).save(tmp_path / "v.png")
    (tmp_path / "data.json").write_text(json.dumps([
        _record(0, {"video": "v.mp4"}),
        _record(1, {"video": "w.mp4", "image": "v.png"}, "<image> then <video>\nWhich changed?")]))
    tokenizer = HFTokenizer.from_pretrained(ckpt)
    builder = SampleBuilder(spec, tokenizer, preprocessors=build_media_preprocessors(spec, {"vision": ckpt}))
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    model = load_whole(ckpt, spec)
    video_prep = NativeVideoPreprocessor.from_pretrained(ckpt, spec.encoders["vision"])
    conversations, bad, _ = read_conversations(tmp_path / "data.json")
    assert not bad
    for k, (conv, (total, fps)) in enumerate(zip(conversations, [(21, 10.0), (9, 3.0)])):
        built = builder.build(conv, k)
        assert builder.shape(conv, k) == built.shape  # headers only: the same frames, sizes and token counts
        *images, = (i for i in built.tokens.items if i.grid is not None and built.shape.items[0].modality == "image")
        groups = [x for x, item in zip(built.tokens.items, built.shape.items) if item.part is not None]
        rows = torch.cat([g.inputs for g in groups])
        _, h, w = groups[0].grid[0].tolist()
        video_grid = torch.tensor([[len(groups), h, w]])
        # transformers' prompt for the video: its processor's replacement of the template's video token
        metadata = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=video_prep.indices(total, fps))
        fake = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                               vision_start_token=START, vision_end_token=END, video_token=VIDEO_PAD)
        fake._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(fake, *a)
        placeholder = Qwen3VLProcessor.replace_video_token(fake, {"video_grid_thw": video_grid,
                                                                  "video_metadata": [metadata]}, 0)
        text, _ = tokenizer.render(conv)
        image_tokens = [llm_tokens_of_item(i, spec.encoders["vision"]) for i in built.shape.items if i.part is None]
        for n in image_tokens:
            text = text.replace("<|image_pad|>", "<IMG>" * n, 1)
        text = text.replace(VIDEO_PAD, placeholder, 1).replace("<IMG>", "<|image_pad|>")
        ids = built.tokens.input_ids
        assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
        types = (ids == spec.item_token_ids["image"]).int() + 2 * (ids == spec.item_token_ids["video"]).int()
        image_items = [x for x, item in zip(built.tokens.items, built.shape.items) if item.part is None]
        image_grid = torch.cat([i.grid for i in image_items]) if image_items else None
        want, _ = hf.model.get_rope_index(ids[None], types[None], image_grid_thw=image_grid,
                                          video_grid_thw=video_grid)
        assert torch.equal(built.tokens.rope_positions, want[:, 0])
        with torch.no_grad():
            media = {"pixel_values_videos": rows, "video_grid_thw": video_grid}
            if image_items:
                media |= {"pixel_values": torch.cat([i.inputs for i in image_items]), "image_grid_thw": image_grid}
            logits = hf(input_ids=ids[None], mm_token_type_ids=types[None], **media).logits
            torch.testing.assert_close(model(pack_samples([built.tokens])), logits, atol=2e-5, rtol=1e-5)
    framed = builder._writing(list(builder.shape(conversations[0], 0).items))
    assert len(framed) == 1 and isinstance(framed[0], Framed) and len(framed[0].runs) == 2  # 4 frames: 2 groups


def test_qwen3_vl_videos_too_short_or_cut_are_counted_bad_records(tmp_path):
    ckpt = write_tiny_qwen_vl(tmp_path / "ckpt", "qwen3_vl")
    spec = mllm_spec_from_hf(ckpt)
    (tmp_path / "one.mp4").write_bytes(_mp4(1, 4, 16, 16))  # one frame: fewer than the temporal patch
    (tmp_path / "ok.mp4").write_bytes(_mp4(16, 4, 32, 32))
    two_turns = _record(1, {"video": "ok.mp4"}, "Hello?")
    two_turns["conversations"] += [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "y"}]
    (tmp_path / "data.json").write_text(json.dumps([_record(0, {"video": "one.mp4"}), two_turns]))
    args = dict(tokenizer=HFTokenizer.from_pretrained(ckpt),
                preprocessors=build_media_preprocessors(spec, {"vision": ckpt}))
    data = MultimodalDataset(tmp_path / "data.json", spec, **args)
    (shape,) = data.shapes()
    assert [p.part for p in shape.items] == [(0, 4), (1, 4), (2, 4), (3, 4)]  # 8 frames sampled: 4 groups
    assert "temporal patch" in " ".join(data.stats.examples["unsupported_media"])
    from harmonia.data.inspect import inspect_dataset

    report = inspect_dataset(data, progress=False)  # one video of 8 frames, not 4 items
    assert report["modalities"]["items"] == {"video": 1} and report["frames"]["max"] == 8
    n = llm_tokens_of_item(shape.items[0], spec.encoders["vision"])
    between = shape.item_offsets[0] + n + 1  # after the first group's run and its <|vision_end|>
    cut = MultimodalDataset(tmp_path / "data.json", spec, max_tokens=between, truncate=True, **args)
    assert not cut.shapes()  # a cut inside the video's groups is refused, not trained on half a video
    assert "split a video's frames" in " ".join(cut.stats.examples["too_long"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl"])  # Qwen2.5-VL's: tests/e2e/test_real_qwen_vl.py, 4 processes
def test_harmonia_trains_a_qwen_vl_on_videos(family, tmp_path):
    import io as _io

    from rich.console import Console

    from harmonia.config import load_config
    from harmonia.train import run_training

    ckpt = write_tiny_qwen_vl(tmp_path / "ckpt", family)
    records = []
    for k in range(12):
        (tmp_path / f"v{k}.mp4").write_bytes(_mp4(8 + 3 * k, 4 + k % 3, 16 + 8 * (k % 3), 24))
        records.append(_record(k, {"video": f"v{k}.mp4"}))
    (tmp_path / "data.json").write_text(json.dumps(records))
    config = load_config(None, [
        f"--model.hf={ckpt}", f"--data.path={tmp_path / 'data.json'}", "--data.max_frames=16", "--train.steps=4",
        "--train.global_batch=6", "--train.warmup=1", "--train.lr=5e-3", "--parallel.world_size=1",
        "--log.tensorboard=false", f"--log.dir={tmp_path / 'run'}", f"--checkpoint.dir={tmp_path / 'ck'}"])
    result = run_training(config, Console(file=_io.StringIO(), width=200))
    assert result.losses[-1] < result.losses[0]
    last = result.records[-1]
    assert last["data/skipped"] == 0 and last["data/loaded"] == 4 * 6  # every step's samples, every video decoded


def test_messages_jsonl_videos_are_the_llava_json_ones(tmp_path):
    """LLaMA-Factory / ms-swift records (``messages`` with ``<video>`` tags, a ``videos`` column) give
    the samples LLaVA JSON gives for the same conversation and video."""
    ckpt = write_tiny_qwen_vl(tmp_path / "ckpt")
    spec = mllm_spec_from_hf(ckpt)
    (tmp_path / "v.mp4").write_bytes(_mp4(13, 5, 24, 40))
    (tmp_path / "a.json").write_text(json.dumps([_record(0, {"video": "v.mp4"})]))
    (tmp_path / "b.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "<video>\nWhat moves?"}, {"role": "assistant", "content": "x"}],
        "videos": ["v.mp4"]}) + "\n")
    builder = SampleBuilder(spec, HFTokenizer.from_pretrained(ckpt),
                            preprocessors=build_media_preprocessors(spec, {"vision": ckpt}))
    (a,), (b,) = (read_conversations(tmp_path / name)[0] for name in ("a.json", "b.jsonl"))
    one, two = builder.build(a, 0), builder.build(b, 0)
    assert one.shape == two.shape and torch.equal(one.tokens.input_ids, two.tokens.input_ids)
    assert torch.equal(one.tokens.items[0].inputs, two.tokens.items[0].inputs)
    assert torch.equal(one.tokens.rope_positions, two.tokens.rope_positions)


def test_a_video_of_frame_files_is_sampled_at_data_frames_fps(tmp_path):
    """A list of frame files has no frame rate of its own: with ``data.frames_fps`` the video
    processor samples it as a container of that rate; without, it is a bad record naming why."""
    from PIL import Image

    ckpt = write_tiny_qwen_vl(tmp_path / "ckpt")
    spec = mllm_spec_from_hf(ckpt)
    clip = frames(10, 24, 40)
    for k, frame in enumerate(clip):
        Image.fromarray(frame).save(tmp_path / f"f{k}.png")
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "What moves?", "answer": "x", "media": [
        {"type": "video", "frames": [f"f{k}.png" for k in range(10)]}]}) + "\n")
    args = dict(tokenizer=HFTokenizer.from_pretrained(ckpt),
                preprocessors=build_media_preprocessors(spec, {"vision": ckpt}))
    unknown = MultimodalDataset(tmp_path / "data.jsonl", spec, **args)
    assert not unknown.shapes() and "frame rate" in " ".join(unknown.stats.examples["unsupported_media"])
    data = MultimodalDataset(tmp_path / "data.jsonl", spec, frames_fps=5.0, **args)
    (shape,) = data.shapes()
    (loaded,) = data.load([0])
    assert loaded.shape == shape and shape.items[0].frames == 4  # 10 frames at 5 fps, sampled at 2 per second
    video = NativeVideoPreprocessor(spec.encoders["vision"])
    indices = video.indices(10, 5.0)
    assert indices == [0, 2, 5, 7]
    rows, grid = video.patches(clip[indices])
    (item,) = loaded.tokens.items
    assert torch.equal(item.inputs, rows) and item.grid[0].tolist() == list(grid)
    assert item.second_per_grid == video.second_per_grid(4, 10, 5.0)
