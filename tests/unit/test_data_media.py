"""Media decoding equals the model's own transformers processors; headers give the decoded shapes."""

import io
import math
from dataclasses import replace

import av
import numpy as np
import pytest
import soundfile as sf
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageOps
from transformers import AutoImageProcessor, WhisperFeatureExtractor
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

from harmonia.data import media as M
from harmonia.data.audio import AudioPreprocessor, audio_header, decode_audio, resample
from harmonia.data.image import FAMILIES, ImagePreprocessor, _processor_class, image_header, load_image
from harmonia.data.media_errors import MediaError
from harmonia.data.video import FrameSampling, sample_frame_indices, video_header
from harmonia.errors import ConfigError
from harmonia.model.presets import encoder_preset
from harmonia.workload.shapes import ModalityItem, encoder_sequences, find_tile_grid, image_tiles

VIT = encoder_preset("tiny-vit")  # 16 px tiles, SigLIP's numbers
AUD = encoder_preset("tiny-audio")


def _vit(name: str, size: int, max_tiles: int):
    return replace(VIT, name=name, image_size=size, patch_size=4, max_tiles=max_tiles)


def _image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)  # smooth enough to resize
    img = Image.fromarray(base).resize((w, h), Image.BILINEAR)
    return img.convert(mode)


def _bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _saved(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    return AutoImageProcessor.from_pretrained(tmp_path, local_files_only=True)


# ---------------------------------------------------------------- images


def test_family_constants_are_those_of_the_transformers_processors():
    assert FAMILIES["clip"].mean == pytest.approx(OPENAI_CLIP_MEAN)
    assert FAMILIES["clip"].std == pytest.approx(OPENAI_CLIP_STD)
    siglip = _processor_class("SiglipImageProcessor")()
    assert FAMILIES["siglip"].mean == pytest.approx(siglip.image_mean)
    assert FAMILIES["siglip"].std == pytest.approx(siglip.image_std)
    assert FAMILIES["internvit"].mean == pytest.approx(IMAGENET_DEFAULT_MEAN)
    assert FAMILIES["internvit"].std == pytest.approx(IMAGENET_DEFAULT_STD)
    clip = M.image_preprocessor(encoder_preset("clip-vit-l-14-336"))
    assert clip.processor.image_mean == pytest.approx(OPENAI_CLIP_MEAN) and clip.tile_size == 336
    with pytest.raises(ConfigError, match="checkpoint directory"):
        ImagePreprocessor.for_encoder(replace(VIT, name="mystery-vit"))
    with pytest.raises(ConfigError, match="native_resolution=True"):
        ImagePreprocessor.for_encoder(replace(VIT, native_resolution=True))


@pytest.mark.parametrize("size", [(50, 70), (90, 31), (32, 32)])
def test_clip_single_tile_equals_clip_image_processor(tmp_path, size):
    ref = _saved(_processor_class("CLIPImageProcessor")(size={"shortest_edge": 32},
                                                         crop_size={"height": 32, "width": 32}), tmp_path)
    img = _image(*size, mode="RGBA")  # alpha composited onto white by the processor
    want = ref(images=[img], return_tensors="pt")["pixel_values"]
    enc = _vit("clip-test", 32, max_tiles=1)
    for prep in (ImagePreprocessor.from_pretrained(tmp_path, enc), ImagePreprocessor.for_encoder(enc)):
        got = prep.tiles(img)
        assert got.shape == (1, 3, 32, 32) == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_siglip_single_tile_equals_siglip_image_processor(tmp_path):
    ref = _saved(_processor_class("SiglipImageProcessor")(size={"height": 24, "width": 24}), tmp_path)
    img = _image(41, 77, seed=3, mode="L")
    enc = _vit("siglip-test", 24, max_tiles=1)
    want = ref(images=[img], return_tensors="pt")["pixel_values"]
    for prep in (ImagePreprocessor.from_pretrained(tmp_path, enc), ImagePreprocessor.for_encoder(enc)):
        torch.testing.assert_close(prep.tiles(img), want, atol=1e-5, rtol=0)
    assert float(want.min()) >= -1.0 and float(want.max()) <= 1.0


@pytest.mark.parametrize("size", [(30, 95), (120, 40), (28, 28), (60, 64), (10, 200)])
def test_internvl_tiling_equals_got_ocr2_crop_to_patches(tmp_path, size):
    ref = _saved(_processor_class("GotOcr2ImageProcessor")(
        size={"height": 28, "width": 28}, image_mean=list(IMAGENET_DEFAULT_MEAN), image_std=list(IMAGENET_DEFAULT_STD),
        crop_to_patches=True, max_patches=6), tmp_path)
    img = _image(*size, seed=sum(size))
    out = ref(images=[img], crop_to_patches=True, max_patches=6, return_tensors="pt")
    enc = _vit("internvit-test", 28, max_tiles=6)
    for prep in (ImagePreprocessor.from_pretrained(tmp_path, enc), ImagePreprocessor.for_encoder(enc)):
        got = prep.tiles(img)
        torch.testing.assert_close(got, out["pixel_values"], atol=1e-5, rtol=0)
        item = ModalityItem.image(height=img.height, width=img.width)
        assert got.shape[0] == int(out["num_patches"][0]) == prep.n_tiles(*size) == image_tiles(item, enc)
        assert got.shape[0] == len(encoder_sequences(item, enc))


def test_clip_numbers_with_tiling_are_got_ocr2_with_clip_constants():
    enc = _vit("clip-tiled", 16, max_tiles=4)
    ref = _processor_class("GotOcr2ImageProcessor")(size={"height": 16, "width": 16}, image_mean=list(OPENAI_CLIP_MEAN),
                                                    image_std=list(OPENAI_CLIP_STD))
    img = _image(20, 61, seed=5)
    want = ref(images=[img], crop_to_patches=True, max_patches=4, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(ImagePreprocessor.for_encoder(enc).tiles(img), want, atol=1e-5, rtol=0)


@given(st.integers(1, 3000), st.integers(1, 3000), st.sampled_from([1, 2, 6, 12, 24]))
def test_tile_grid_is_transformers_optimal_tiled_canvas(h, w, max_tiles):
    assert find_tile_grid(h, w, 448, max_tiles) == get_optimal_tiled_canvas((h, w), (448, 448), 1, max_tiles)


def test_processor_of_another_size_is_a_config_error(tmp_path):
    _saved(_processor_class("SiglipImageProcessor")(size={"height": 24, "width": 24}), tmp_path)
    with pytest.raises(ConfigError, match="24, 24"):
        ImagePreprocessor.from_pretrained(tmp_path, _vit("siglip-test", 32, 1))


def test_exif_orientation_is_applied_in_headers_and_pixels():
    img = _image(20, 48, seed=7)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = _bytes(img, "JPEG", exif=exif, quality=95)
    assert image_header(data) == (48, 20)
    decoded = load_image(data)
    plain = Image.open(io.BytesIO(data))
    assert (decoded.height, decoded.width) == (48, 20)
    assert np.array_equal(np.asarray(decoded), np.asarray(plain.transpose(Image.Transpose.ROTATE_270)))
    assert np.array_equal(np.asarray(decoded), np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data)))))
    item, tiles = M.decode_item("image", data, VIT)
    assert item == M.shape_item("image", M.media_shape("image", data), VIT) == ModalityItem.image(height=48, width=20)
    torch.testing.assert_close(tiles, M.tile_image(plain.transpose(Image.Transpose.ROTATE_270), VIT))


def test_image_over_max_pixels_is_refused_from_its_header():
    data = _bytes(_image(300, 400))
    truncated = data[:200]  # header intact, pixels gone: decoding would fail
    prep = ImagePreprocessor.for_encoder(VIT, max_pixels=300 * 400 - 1)
    for call in (lambda: image_header(truncated, 119_999), lambda: load_image(truncated, 119_999),
                 lambda: M.shape_item("image", M.media_shape("image", truncated), prep),
                 lambda: M.decode_item("image", truncated, prep)):
        with pytest.raises(MediaError, match="max_pixels") as e:
            call()
        assert e.value.kind == "too_large"
    with pytest.raises(MediaError) as e:
        load_image(truncated)
    assert e.value.kind == "corrupt_media"


# ---------------------------------------------------------------- audio


def _tone(freq: float, rate: int, seconds: float, channels: int = 1, amp: float = 0.5) -> np.ndarray:
    t = np.arange(round(rate * seconds)) / rate
    x = amp * np.sin(2 * np.pi * freq * t)
    return np.stack([x * (1 - 0.3 * c) for c in range(channels)], axis=1).astype(np.float32)


def _sf_bytes(x: np.ndarray, rate: int, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _m4a_bytes(x: np.ndarray, rate: int) -> bytes:
    """AAC in an MP4 container (soundfile refuses it; PyAV decodes it)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(x[:, :1].T.copy(), format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,subtype,tol", [
    ("WAV", "PCM_16", 1 / 32768), ("WAV", "PCM_32", 1e-8), ("WAV", "FLOAT", 0.0), ("FLAC", "PCM_16", 1 / 32768),
    ("MP3", "MPEG_LAYER_III", None),
])
def test_audio_formats_decode_to_the_mono_mix(fmt, subtype, tol):
    assert fmt in sf.available_formats()
    x = _tone(440.0, 22050, 0.7, channels=2)
    data = _sf_bytes(x, 22050, fmt, subtype)
    y, rate = decode_audio(data)
    assert rate == 22050 and y.dtype == np.float32 and y.shape == (x.shape[0],)
    want = x.mean(axis=1)
    if tol is None:  # lossy: aligned and within 2% RMS
        assert np.sqrt(np.mean((y - want) ** 2)) < 0.02 * np.sqrt(np.mean(want**2))
    else:
        np.testing.assert_allclose(y, want, atol=tol + 1e-7)
    assert audio_header(data).frames == x.shape[0] and audio_header(data).channels == 2


def test_audio_soundfile_refuses_goes_through_pyav():
    x = _tone(500.0, 16000, 1.0)
    data = _m4a_bytes(x, 16000)
    with pytest.raises(Exception):
        sf.info(io.BytesIO(data))
    y, rate = decode_audio(data)
    assert rate == 16000 and len(y) == audio_header(data).frames
    assert abs(len(y) - len(x)) < 0.1 * rate
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(np.argmax(spectrum) * rate / len(y) - 500.0) < 5.0
    with pytest.raises(MediaError) as e:
        decode_audio(b"RIFF nonsense")
    assert e.value.kind == "corrupt_media" and "soundfile" in str(e.value)


def _level_db(x: np.ndarray) -> float:
    core = x[len(x) // 8: -len(x) // 8]
    return 20 * math.log10(math.sqrt(2) * core.std() / 0.5)


def test_resampling_is_anti_aliased_and_keeps_the_passband():
    hi = resample(_tone(12000.0, 44100, 1.0)[:, 0], 44100, 16000)
    lo = resample(_tone(1000.0, 44100, 1.0)[:, 0], 44100, 16000)
    assert len(hi) == len(lo) == 16000
    assert _level_db(hi) < -40.0  # the 12 kHz tone would alias to 4 kHz
    assert abs(math.sqrt(2) * lo[2000:-2000].std() / 0.5 - 1) < 0.01
    assert len(resample(np.zeros(1001, np.float32), 44100, 16000)) == math.ceil(1001 * 16000 / 44100)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_equals_whisper_feature_extractor(tmp_path, n_mels):
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(tmp_path)
    ref = WhisperFeatureExtractor.from_pretrained(tmp_path)
    enc = replace(encoder_preset("whisper-large-v3-encoder"), n_mels=n_mels)
    prep = AudioPreprocessor.from_pretrained(tmp_path, enc)
    rng = np.random.default_rng(n_mels)
    x = (0.1 * rng.standard_normal(16000 * 35) + _tone(700.0, 16000, 35.0)[:, 0]).astype(np.float32)
    got = prep.features(x)  # 35 s -> two 30 s chunks, the second zero-padded
    want = [ref(x[i * 480000:(i + 1) * 480000], sampling_rate=16000, return_tensors="np")["input_features"][0]
            for i in range(2)]
    assert got.shape == (2, n_mels, 3000)
    np.testing.assert_allclose(got.numpy(), np.stack(want), atol=1e-4, rtol=0)
    assert got.shape[0] == len(encoder_sequences(ModalityItem.audio(35.0), enc))
    with pytest.raises(ConfigError, match="n_mels"):
        AudioPreprocessor.from_pretrained(tmp_path, replace(enc, n_mels=n_mels + 1))


def test_preset_audio_uses_whisper_numbers_at_the_spec_sizes():
    ref = WhisperFeatureExtractor(feature_size=AUD.n_mels, hop_length=AUD.hop_length, chunk_length=2,
                                  n_fft=round(2.5 * AUD.hop_length))
    x = _tone(300.0, 16000, 1.3)[:, 0]
    chunks, item = M.audio_chunks(x, 16000, AUD)
    want = ref(x, sampling_rate=16000, return_tensors="np")["input_features"]
    np.testing.assert_allclose(chunks.numpy(), want, atol=1e-4, rtol=0)
    assert chunks.shape == (1, AUD.n_mels, 100) and item == ModalityItem.audio(1.3)
    whole = M.log_mel(torch.from_numpy(x), AUD)
    assert whole.shape == (AUD.n_mels, len(x) // AUD.hop_length)


# ---------------------------------------------------------------- video


def _mp4(n_frames: int, fps: int, h: int = 32, w: int = 48) -> bytes:
    """Frame i has a white column at x = 2 i (mod w), so decoded frames tell their index."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(n_frames):
            img = np.zeros((h, w, 3), np.uint8)
            img[:, (2 * i) % w] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _column(img: Image.Image) -> int:
    return int(np.argmax(np.asarray(img.convert("L"), dtype=np.float32).sum(axis=0)))


@pytest.mark.parametrize("sampling,indices", [(FrameSampling(num_frames=4), [0, 5, 11, 17]),
                                              (FrameSampling(num_frames=None, fps=2.0), [0, 5, 11, 17]),
                                              (FrameSampling(num_frames=3, fps=5.0), [0, 7, 15])])
def test_mp4_frames_sampled_by_count_and_by_fps(tmp_path, sampling, indices):
    from harmonia.data.video import decode_frames

    data = _mp4(23, fps=10)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    info = video_header(path)
    assert (info.frames, info.fps, info.height, info.width) == (23, 10.0, 32, 48)
    assert sampling.indices(info.frames, info.fps) == indices
    frames = decode_frames(path, indices)
    assert [_column(f) for f in frames] == [2 * i for i in indices]
    item, tiles = M.decode_item("video", path, VIT, sampling)
    assert tiles.shape == (len(indices), 3, 16, 16)
    assert item == M.shape_item("video", M.media_shape("video", data), VIT, sampling)


def test_uniform_sampling_is_transformers_default_sampler():
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    for total in (1, 7, 23, 300):
        for n in (1, 4, 8):
            if n <= total:
                want = default_sample_indices_fn(VideoMetadata(total_num_frames=total, fps=10.0), num_frames=n)
                assert sample_frame_indices(total, n) == want.tolist()
    assert sample_frame_indices(3, 8) == [0, 1, 2]
    with pytest.raises(MediaError, match="frame rate"):
        FrameSampling(num_frames=None, fps=1.0).indices(10, None)


def test_frame_lists_are_sampled_and_preprocessed_per_frame():
    frames = [_bytes(_image(20, 30, seed=i)) for i in range(10)]
    item, tiles = M.decode_item("frames", frames, VIT, FrameSampling(num_frames=4))
    assert item == ModalityItem.video(frames=4, tiles=1) == M.shape_item(
        "frames", M.media_shape("frames", frames), VIT, FrameSampling(num_frames=4))
    want = M.frame_tiles([load_image(frames[i]) for i in (0, 2, 5, 7)], VIT)
    torch.testing.assert_close(tiles, want)


# ---------------------------------------------------------------- header-only shapes


def test_header_only_shapes_equal_decoded_shapes():
    exif = Image.Exif()
    exif[0x0112] = 8
    x = _tone(440.0, 44100, 2.345, channels=2)
    media = [
        ("image", _bytes(_image(37, 90), "JPEG", exif=exif)),
        ("image", _bytes(_image(17, 16, mode="P"))),
        ("audio", _sf_bytes(x, 44100, "WAV", "PCM_16")),
        ("audio", _sf_bytes(x, 44100, "FLAC", "PCM_16")),
        ("audio", _sf_bytes(x, 44100, "MP3", "MPEG_LAYER_III")),
        ("audio", _m4a_bytes(x, 22050)),
        ("video", _mp4(9, fps=3)),
    ]
    for kind, data in media:
        enc = AUD if kind == "audio" else VIT
        from_header = M.shape_item(kind, M.media_shape(kind, data), enc)
        item, inputs = M.decode_item(kind, data, enc)
        assert from_header == item, kind
        assert inputs.shape[0] == len(encoder_sequences(item, enc)), kind


# ---------------------------------------------------------------- shape index


def _dataset(tmp_path):
    """A manifest beside an image, a WAV, an MP4, frame files and a tar shard holding an image."""
    import tarfile

    root = tmp_path / "data"
    root.mkdir()
    (root / "a.png").write_bytes(_bytes(_image(20, 50)))
    (root / "b.wav").write_bytes(_sf_bytes(_tone(300.0, 8000, 1.5), 8000, "WAV", "PCM_16"))
    (root / "c.mp4").write_bytes(_mp4(12, fps=6))
    for i in range(3):
        (root / f"f{i}.png").write_bytes(_bytes(_image(18, 18, seed=i)))
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with tarfile.open(root / "shard.tar", "w") as tar:
        data = _bytes(_image(40, 16))
        info = tarfile.TarInfo("k.png")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (root / "manifest.jsonl").write_text("{}\n")
    r = str(root)
    items = [
        [M.MediaFile("image", f"{r}/a.png"), M.MediaFile("audio", f"{r}/b.wav")],
        [M.MediaFile("video", f"{r}/c.mp4")],
        [M.MediaFile("frames", frames=tuple(f"{r}/f{i}.png" for i in range(3)))],
        [M.MediaFile("image", "k.png", shard=f"{r}/shard.tar"), M.MediaFile("image", f"{r}/a.png")],
        [M.MediaFile("image", f"{r}/broken.png"), M.MediaFile("image", f"{r}/gone.png"),
         M.MediaFile("image", "nope.png", shard=f"{r}/shard.tar")],
    ]
    return root, items


EXPECTED = [
    [{"height": 20, "width": 50}, {"samples": 12000, "rate": 8000, "channels": 1}],
    [{"frames": 12, "fps": 6.0, "height": 32, "width": 48}],
    [{"frames": 3, "height": 18, "width": 18}],
    [{"height": 40, "width": 16}, {"height": 20, "width": 50}],
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shape_index_reads_headers_in_workers_and_records_bad_items(tmp_path, num_workers):
    root, items = _dataset(tmp_path)
    shapes = M.build_shape_index(items, num_workers=num_workers, progress=False)
    assert shapes[:4] == EXPECTED
    assert [s["error"] for s in shapes[4]] == ["corrupt_media", "missing_file", "missing_file"]
    assert "broken.png" in shapes[4][0]["message"] and "nope.png" in shapes[4][2]["message"]
    item = M.shape_item("audio", shapes[0][1], AUD)
    assert item == M.decode_item("audio", root / "b.wav", AUD)[0]
    with pytest.raises(MediaError) as e:
        M.shape_item("image", shapes[4][1], VIT)
    assert e.value.kind == "missing_file"


def test_shape_index_is_cached_and_rebuilt_when_the_dataset_changes(tmp_path):
    root, items = _dataset(tmp_path)
    manifest = root / "manifest.jsonl"
    cache = M.shape_cache_path(manifest)
    assert cache.parent == root
    first = M.build_shape_index(items, cache_path=cache, dataset=manifest, progress=False)
    assert cache.is_file()
    (root / "a.png").unlink()  # the cache answers without reading headers
    assert M.build_shape_index(items, cache_path=cache, dataset=manifest, progress=False) == first
    manifest.write_text("{}\n{}\n")  # changed dataset: re-indexed
    again = M.build_shape_index(items, cache_path=cache, dataset=manifest, progress=False)
    assert again[0][0]["error"] == "missing_file"


def test_shape_index_cache_falls_back_to_the_user_cache_dir(tmp_path, monkeypatch):
    root, items = _dataset(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    blocked = root / "not-a-dir"
    blocked.write_text("a file where the cache's directory would be")
    cache = blocked / "shapes.json"  # cannot be written, even by root
    shapes = M.build_shape_index(items[:2], cache_path=cache, dataset=root / "manifest.jsonl", progress=False)
    assert shapes == EXPECTED[:2]
    written = list((tmp_path / "user-cache" / "harmonia" / "shape-index").iterdir())
    assert len(written) == 1
    (root / "a.png").unlink()
    assert M.build_shape_index(items[:2], cache_path=cache, dataset=root / "manifest.jsonl", progress=False) == shapes
    monkeypatch.setattr("harmonia.data.shape_index.os.access", lambda path, mode: False)
    assert M.shape_cache_path(root / "manifest.jsonl").parent == tmp_path / "user-cache" / "harmonia" / "shape-index"


def test_model_preprocessors_from_checkpoints_and_presets(tmp_path):
    from harmonia.model.presets import mllm_preset

    spec = mllm_preset("tiny-omni")
    vit, aud = spec.encoders["vision"], spec.encoders["audio"]
    _processor_class("CLIPImageProcessor")(size={"shortest_edge": vit.image_size},
                                           crop_size={"height": vit.image_size, "width": vit.image_size}
                                           ).save_pretrained(tmp_path / "vision")
    WhisperFeatureExtractor(feature_size=aud.n_mels, hop_length=aud.hop_length, chunk_length=2,
                            n_fft=round(2.5 * aud.hop_length)).save_pretrained(tmp_path / "audio")
    preps = M.build_media_preprocessors(spec, {"vision": tmp_path / "vision", "audio": tmp_path / "audio"},
                                        max_pixels=10_000)
    assert preps["vision"].processor.image_mean == pytest.approx(OPENAI_CLIP_MEAN)  # not the preset's SigLIP numbers
    assert preps["vision"].max_tiles == vit.max_tiles and preps["vision"].max_pixels == 10_000
    assert preps["audio"].extractor.feature_size == aud.n_mels
    presets = M.build_media_preprocessors(spec)
    assert presets["vision"].processor.image_mean == pytest.approx(FAMILIES["siglip"].mean)
    with pytest.raises(ConfigError, match="not encoders"):
        M.build_media_preprocessors(spec, {"vison": tmp_path / "vision"})
    with pytest.raises(ConfigError, match="preprocessor_config.json"):
        M.build_media_preprocessors(spec, {"vision": tmp_path})
