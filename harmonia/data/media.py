"""Media into encoder inputs with the model's own preprocessing numbers: the sample builder's entry point.

Every function here produces exactly the sequences `harmonia.workload.shapes.encoder_sequences` counts
for the same item, and the header-only path (`media_shape` then `shape_item`) gives the same
`ModalityItem` as decoding (`decode_item`), so the shapes the scheduler plans with are the tensors the
executor receives.

Per modality (see each module):

- images (`harmonia.data.image`): the checkpoint's transformers image processor, or the encoder
  family's constants; EXIF orientation; InternVL tiling up to the spec's ``max_tiles``; ``max_pixels``.
- audio (`harmonia.data.audio`): soundfile / PyAV, mono, polyphase resampling, WhisperFeatureExtractor.
- video (`harmonia.data.video`): PyAV containers or frame lists, uniform sampling by count or fps, one
  image tile per frame; for a native-resolution tower (Qwen2-VL, Qwen2.5-VL), its video processor's
  sampling by rate and patch rows (`harmonia.data.native_video`, `decode_native_video`).

A model's preprocessing is one `ImagePreprocessor` or `AudioPreprocessor` per encoder module
(`build_media_preprocessors`); functions also accept a bare `EncoderSpec`, whose preset family gives it.
"""

from __future__ import annotations

import io
import wave
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from harmonia.data.audio import AudioPreprocessor, audio_header, decode_audio
from harmonia.data.image import DEFAULT_MAX_PIXELS, ImagePreprocessor, check_pixels, image_header, load_image
from harmonia.data.native_image import NativeImagePreprocessor
from harmonia.data.media_errors import MediaError
from harmonia.data.shape_index import MediaFile, build_shape_index, media_shape, shape_cache_path
from harmonia.data.video import FrameSampling, decode_frames, sample_frame_indices, video_header
from harmonia.errors import ConfigError
from harmonia.model.spec import EncoderSpec, MLLMSpec
from harmonia.workload.shapes import ModalityItem

__all__ = [
    "AudioPreprocessor", "FrameSampling", "ImagePreprocessor", "MediaError", "MediaFile", "audio_chunks",
    "audio_header", "build_media_preprocessors", "build_shape_index", "decode_audio", "decode_item",
    "decode_native_video", "frame_tiles", "image_size", "log_mel", "media_shape", "open_image",
    "sample_frame_indices", "shape_cache_path", "shape_item", "tile_image", "write_wav",
]

Preprocessor = ImagePreprocessor | NativeImagePreprocessor | AudioPreprocessor
Source = bytes | str | Path


def build_media_preprocessors(mllm: MLLMSpec, checkpoints: dict[str, str | Path] | None = None,
                              max_pixels: int = DEFAULT_MAX_PIXELS) -> dict[str, Preprocessor]:
    """One preprocessor per encoder module of ``mllm``.

    Args:
        mllm: the model; each encoder's spec fixes tile size, ``max_tiles``, mels, rate and chunks.
        checkpoints: module -> HF checkpoint directory whose ``preprocessor_config.json`` gives the
            numbers; modules not named use their preset family's constants.
        max_pixels: images with more pixels are bad records (``too_large``), found from the header.
    """
    checkpoints = checkpoints or {}
    unknown = set(checkpoints) - set(mllm.encoders)
    if unknown:
        raise ConfigError(f"checkpoints for {sorted(unknown)}, which are not encoders of {mllm.name!r} "
                          f"(encoders: {sorted(mllm.encoders)})")
    out: dict[str, Preprocessor] = {}
    for module, enc in mllm.encoders.items():
        path = checkpoints.get(module)
        if enc.is_audio:
            out[module] = AudioPreprocessor.from_pretrained(path, enc) if path else AudioPreprocessor.for_encoder(enc)
        elif enc.native is not None:
            out[module] = (NativeImagePreprocessor.from_pretrained(path, enc, max_pixels) if path
                           else NativeImagePreprocessor.for_encoder(enc, max_pixels))
        elif path:
            out[module] = ImagePreprocessor.from_pretrained(path, enc, max_pixels)
        else:
            out[module] = ImagePreprocessor.for_encoder(enc, max_pixels=max_pixels)
    return out


@lru_cache(maxsize=64)
def _preset_image(encoder: EncoderSpec) -> ImagePreprocessor | NativeImagePreprocessor:
    if encoder.native is not None:
        return NativeImagePreprocessor.for_encoder(encoder)
    return ImagePreprocessor.for_encoder(encoder)


@lru_cache(maxsize=64)
def _preset_audio(encoder: EncoderSpec) -> AudioPreprocessor:
    return AudioPreprocessor.for_encoder(encoder)


def image_preprocessor(prep: ImagePreprocessor | NativeImagePreprocessor | EncoderSpec
                       ) -> ImagePreprocessor | NativeImagePreprocessor:
    """``prep`` itself, or the preset preprocessing of a vision encoder spec (built once per spec)."""
    return prep if isinstance(prep, (ImagePreprocessor, NativeImagePreprocessor)) else _preset_image(prep)


def _native(prep) -> NativeImagePreprocessor | None:
    p = image_preprocessor(prep)
    return p if isinstance(p, NativeImagePreprocessor) else None


def audio_preprocessor(prep: AudioPreprocessor | EncoderSpec) -> AudioPreprocessor:
    """``prep`` itself, or the preset preprocessing of an audio encoder spec (built once per spec)."""
    return prep if isinstance(prep, AudioPreprocessor) else _preset_audio(prep)


def shape_item(kind: str, shape: dict, prep: Preprocessor | EncoderSpec,
               sampling: FrameSampling | None = None, fps: float | None = None) -> ModalityItem:
    """The `ModalityItem` of a header-only shape (`media_shape`'s dict) for one encoder.

    Args:
        kind: ``image``, ``audio``, ``video`` (a container) or ``frames`` (a list of image files).
        shape: `media_shape`'s dict for the item.
        prep: the encoder's preprocessor (or its preset spec).
        sampling: video frame sampling (default `FrameSampling()`: 8 frames).
        fps: a frame list's frame rate, when sampling by fps (a container's comes from its header).

    Raises:
        MediaError: ``too_large`` for an image over ``max_pixels``, or what the shape recorded.
    """
    if "error" in shape:
        raise MediaError(shape["error"], shape["message"])
    if kind == "image":
        p = image_preprocessor(prep)
        check_pixels(shape["height"], shape["width"], p.max_pixels)
        return ModalityItem.image(height=shape["height"], width=shape["width"])
    if kind == "audio":
        rate = audio_preprocessor(prep).rate
        n = -(-shape["samples"] * rate // shape["rate"])  # resampled_length
        return ModalityItem.audio(n / rate)
    if kind in ("video", "frames"):
        native = _native(prep)
        if native is not None:  # the video processor's rate sampling, frames sized from the header
            check_pixels(shape["height"], shape["width"], native.max_pixels)
            cap, rate = (sampling or FrameSampling()).num_frames, shape.get("fps", fps)
            indices = native.video.indices(shape["frames"], rate, cap)
            return _native_video_item(native, indices, rate, shape["height"], shape["width"])
        indices = (sampling or FrameSampling()).indices(shape["frames"], shape.get("fps", fps))
        return ModalityItem.video(frames=len(indices), tiles=1)
    raise MediaError("unsupported_media", f"unknown media kind {kind!r}; expected image, audio, video or frames")


def decode_item(kind: str, data: Source | list[Source], prep: Preprocessor | EncoderSpec,
                sampling: FrameSampling | None = None, fps: float | None = None) -> tuple[ModalityItem, torch.Tensor]:
    """Decode one item into its `ModalityItem` (equal to the header-only one) and encoder inputs.

    Args:
        kind: ``image``, ``audio``, ``video`` (a container) or ``frames`` (``data`` lists the frames).
        data: the file's bytes or path (a list of them for ``frames``).
        prep: the encoder's preprocessor (or its preset spec).
        sampling: video frame sampling (default `FrameSampling()`).
        fps: a frame list's frame rate, when sampling by fps.

    Returns:
        The item and its inputs: image ``(n_tiles, 3, S, S)`` (a native-resolution tower's:
        ``(h * w, C * tp * p * p)`` patch rows, grid `harmonia.workload.shapes.native_grid`), video
        ``(n_frames, 3, S, S)``, audio ``(n_chunks, n_mels, frames)``, all float32.
    """
    sampling = sampling or FrameSampling()
    if kind == "image":
        p = image_preprocessor(prep)
        img = load_image(data, p.max_pixels)
        x = p.patches(img)[0] if isinstance(p, NativeImagePreprocessor) else p.tiles(img)
        return ModalityItem.image(height=img.height, width=img.width), x
    if kind == "audio":
        chunks, seconds = audio_preprocessor(prep)(*decode_audio(data))
        return ModalityItem.audio(seconds), chunks
    if kind in ("video", "frames") and _native(prep) is not None:
        item, rows, _ = decode_native_video(kind, data, _native(prep), sampling, fps)
        return item, rows
    if kind == "video":
        info = video_header(data)
        frames = decode_frames(data, sampling.indices(info.frames, info.fps))
    elif kind == "frames":
        frames = [load_image(data[i], image_preprocessor(prep).max_pixels)
                  for i in sampling.indices(len(data), fps)]
    else:
        raise MediaError("unsupported_media", f"unknown media kind {kind!r}; expected image, audio, video or frames")
    return ModalityItem.video(frames=len(frames), tiles=1), image_preprocessor(prep).frames(frames)


def decode_native_video(kind: str, data: Source | list[Source], prep: NativeImagePreprocessor,
                        sampling: FrameSampling | None = None, fps: float | None = None
                        ) -> tuple[ModalityItem, torch.Tensor, float]:
    """A video (container or frame list) for a native-resolution tower, sampled and sized by its video
    processor: the item, its ``(t * h * w, C * tp * p * p)`` patch rows, and its seconds per
    temporal grid step (Qwen2.5-VL's ``second_per_grid_ts`` entry).

    Args:
        kind: ``video`` or ``frames``.
        data: the container's bytes or path, or the frame files'.
        prep: the tower's preprocessor (`NativeImagePreprocessor.video` does the work).
        sampling: its ``num_frames`` caps the frames sampled (the processor's ``max_frames``).
        fps: a frame list's frame rate (a container's comes from its header).
    """
    video, cap = prep.video, (sampling or FrameSampling()).num_frames
    if kind == "video":
        info = video_header(data)
        check_pixels(info.height, info.width, prep.max_pixels)
        total, rate = info.frames, info.fps
        indices = video.indices(total, rate, cap)
        frames = decode_frames(data, indices)
    else:
        total, rate = len(data), fps
        indices = video.indices(total, rate, cap)
        frames = [load_image(data[i], prep.max_pixels) for i in indices]
    rows, _ = video.patches(frames)
    item = _native_video_item(prep, indices, rate, frames[0].height, frames[0].width)
    return item, rows, video.second_per_grid(len(indices), total, rate)


def _native_video_item(prep: NativeImagePreprocessor, indices: list[int], rate: float, height: int,
                       width: int) -> ModalityItem:
    """A native-resolution tower's video of sampled frames ``indices`` (at ``rate`` fps), with each
    temporal group's seconds where the prompt writes them (Qwen3-VL)."""
    times = prep.video.timestamps(indices, rate) if prep.video.grouped else None
    return ModalityItem("video", height=height, width=width, frames=len(indices), times=times)


# Item-level helpers (images, video frames, audio) for callers that hold decoded media.

def open_image(data: Source, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode an image, EXIF orientation applied; `MediaError` when unreadable or over ``max_pixels``."""
    return load_image(data, max_pixels)


def image_size(data: Source, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """``(height, width)`` after EXIF orientation, from the header only (no pixel decode)."""
    return image_header(data, max_pixels)


def tile_image(img: Image.Image, prep: ImagePreprocessor | EncoderSpec) -> torch.Tensor:
    """An image -> ``(n_tiles, 3, S, S)`` tiles with the encoder's preprocessing."""
    return image_preprocessor(prep).tiles(img)


def frame_tiles(frames: list[Image.Image], prep: ImagePreprocessor | EncoderSpec) -> torch.Tensor:
    """One tile per video frame: ``(n_frames, 3, S, S)``."""
    return image_preprocessor(prep).frames(frames)


def log_mel(x: torch.Tensor | np.ndarray, prep: AudioPreprocessor | EncoderSpec) -> torch.Tensor:
    """Whisper log-mel of a whole waveform at the encoder's rate: ``(samples,) -> (n_mels, samples // hop)``."""
    p = audio_preprocessor(prep)
    x = x.numpy() if isinstance(x, torch.Tensor) else x
    out = p.extractor(np.asarray(x, np.float32), sampling_rate=p.rate, padding="longest", truncation=False,
                      return_tensors="pt")
    return out["input_features"][0].float()


def audio_chunks(x: np.ndarray, rate: int, prep: AudioPreprocessor | EncoderSpec) -> tuple[torch.Tensor, ModalityItem]:
    """A mono waveform at ``rate`` -> ``(n_chunks, n_mels, frames)`` log-mel chunks and the item's shape."""
    chunks, seconds = audio_preprocessor(prep)(x, rate)
    return chunks, ModalityItem.audio(seconds)


def write_wav(path: str | Path | io.BytesIO, x: np.ndarray, rate: int) -> None:
    """16-bit PCM mono WAV to a path or a binary file object."""
    pcm = (np.clip(x, -1, 1) * 32767).astype(np.int16)
    with wave.open(path if isinstance(path, io.BytesIO) else str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def _pil():
    """The PIL ``Image`` module (for writers of synthetic media)."""
    return Image

