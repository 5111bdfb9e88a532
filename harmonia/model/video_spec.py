"""How a Qwen-VL video processor turns a video into frames of one size: its numbers and arithmetic.

transformers' ``Qwen2VLVideoProcessor`` (Qwen2-VL and Qwen2.5-VL share it) with frame sampling on:

- frames: ``n = total / video_fps * fps`` clamped to ``[min_frames, min(max_frames, total)]`` (the
  upper bound first rounded down to a multiple of the temporal patch), then rounded down to a
  multiple of the temporal patch ``tp``; the indices are ``torch.arange(0, total, total / n).int()``
  (float32 steps, as it computes them). A video that leaves no whole temporal patch (``n = 0``)
  cannot be merged and is refused.
- size: every frame resized by ``smart_resize`` to multiples of patch x merge side within
  ``[min_pixels, max_pixels]``; with ``cap_pixels_per_frame`` the upper bound is first cut to an
  even share of a whole-video budget (``max(min(max_pixels, budget * tp // n), int(1.05 *
  min_pixels))``, ``budget = int(max_video_tokens * factor ** 2 * 0.9)``).
- the grid: ``(ceil(n / tp), h / patch, w / patch)``; the processor repeats the last frame to fill
  the last temporal patch.
- Qwen2.5-VL's rotary time step: ``second_per_grid_t = tp / sampled_fps`` with ``sampled_fps =
  n / total * video_fps``.

transformers' ``Qwen3VLVideoProcessor`` (``style="qwen3_vl"``) differs in three places:

- frames: ``n = int(total / video_fps * fps)`` clamped to ``[min_frames, min(max_frames, total)]``,
  not rounded to the temporal patch; the indices are ``np.linspace(0, total - 1, n).round()``. A
  video of fewer frames than one temporal patch is refused, as its ``smart_resize`` refuses it.
- size: the pixel bounds hold for the whole clip (``t * h * w`` with ``t`` the frame count rounded
  to the temporal patch; `harmonia.model.native_resize.smart_resize_clip`); with
  ``cap_pixels_per_frame`` the upper bound is ``n * max(min(max_video_tokens * factor ** 2,
  max_pixels // n), int(1.05 * min_pixels))``.
- the prompt: each temporal group of frames is written as its own run of video tokens after the
  text ``<{seconds:.1f} seconds><|vision_start|>`` and before ``<|vision_end|>`` (`frame_texts`),
  the seconds the mean of the group's first and last sampled frame's time (`VideoNumbers.timestamps`).

The numbers come from the checkpoint's video processor config (`video_config`, read in transformers'
order; `VideoNumbers.from_config`)
and travel on the encoder spec (`harmonia.model.spec.EncoderSpec.video`), so the scheduler's token
counts from headers and the data path's frames are computed by the same functions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from harmonia.errors import ConfigError, SampleError
from harmonia.model.native_resize import smart_resize, smart_resize_clip

# Qwen2VLVideoProcessor's class defaults (fps as its processor samples when asked to, and Qwen3-VL's).
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768
# Qwen3VLVideoProcessor's (pixels of the whole clip) and its per-frame token ceiling under the cap.
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS, QWEN3_MAX_VIDEO_TOKENS = 128 * 32 * 32, 32 * 32 * 768, 768
STYLES = ("qwen2_vl", "qwen3_vl")
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
_KNOWN = {"size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "min_frames",
          "max_frames", "fps", "num_frames", "do_sample_frames", "cap_pixels_per_frame", "max_video_tokens",
          "do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "rescale_factor", "image_mean",
          "image_std", "resample", "video_processor_type", "processor_class", "return_metadata",
          "default_to_square", "data_format", "input_data_format", "device", "return_tensors",
          "crop_size", "do_center_crop", "do_pad", "video_metadata", "image_processor_type"}


@dataclass(frozen=True)
class VideoNumbers:
    """A Qwen-VL video processor's frame sampling and sizes.

    Attributes:
        min_pixels: smallest resized frame, in pixels (``size.shortest_edge``; Qwen3-VL: of the clip).
        max_pixels: largest (``size.longest_edge``; Qwen3-VL: of the clip).
        fps: frames sampled per second of video.
        min_frames: fewest frames sampled.
        max_frames: most frames sampled.
        pixel_budget: with ``cap_pixels_per_frame``, Qwen2-VL's whole-video pixels, Qwen3-VL's
            per-frame ceiling (None: no cap).
        style: whose processor: ``qwen2_vl`` (Qwen2-VL and Qwen2.5-VL) or ``qwen3_vl``.
    """

    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    pixel_budget: int | None = None
    style: str = "qwen2_vl"

    @classmethod
    def qwen3(cls) -> VideoNumbers:
        """``Qwen3VLVideoProcessor``'s class defaults."""
        return cls(QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS, style="qwen3_vl")

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ConfigError(f"video processor style {self.style!r} is unknown; expected one of {STYLES}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(f"video min_pixels={self.min_pixels} and max_pixels={self.max_pixels} must be positive "
                              "with min_pixels <= max_pixels")
        if not self.fps > 0 or not 0 < self.min_frames <= self.max_frames:
            raise ConfigError(f"video fps={self.fps}, min_frames={self.min_frames}, max_frames={self.max_frames}: "
                              "expected a positive rate and 0 < min_frames <= max_frames")

    @classmethod
    def from_config(cls, numbers: dict, factor: int, where: str, style: str = "qwen2_vl") -> VideoNumbers:
        """The numbers of a ``video_preprocessor_config.json``; ``factor`` is patch x merge side;
        ``style`` whose processor reads them (its class defaults fill what the file leaves out).

        Raises:
            ConfigError: a field harmonia does not know, a fixed ``num_frames`` (harmonia samples by
                rate), or preprocessing other than resize, rescale and normalise.
        """
        unknown = sorted(set(numbers) - _KNOWN)
        if unknown:
            raise ConfigError(f"{where}: fields {unknown} are not understood by harmonia's video path")
        off = [k for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if numbers.get(k) is False]
        if off or numbers.get("do_center_crop") or numbers.get("do_pad"):
            raise ConfigError(f"{where}: {off or ['do_center_crop / do_pad']} differ from the Qwen-VL video "
                              "processor's resize, rescale and normalise, which harmonia implements")
        if numbers.get("resample", 3) != 3:
            raise ConfigError(f"{where}: resample={numbers['resample']}; harmonia resizes video frames bicubic (3), "
                              "as the Qwen-VL video processor does")
        if numbers.get("num_frames") is not None:
            raise ConfigError(f"{where}: num_frames={numbers['num_frames']}: harmonia samples a video's frames by "
                              "rate (fps, min_frames, max_frames); remove num_frames")
        size = numbers.get("size") or {}
        qwen3 = style == "qwen3_vl"
        low_default, high_default = (QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS) if qwen3 else (VIDEO_MIN_PIXELS,
                                                                                        VIDEO_MAX_PIXELS)
        low = numbers.get("min_pixels", size.get("shortest_edge", low_default))
        high = numbers.get("max_pixels", size.get("longest_edge", high_default))
        budget = None
        if numbers.get("cap_pixels_per_frame") and qwen3:
            budget = int(numbers.get("max_video_tokens", QWEN3_MAX_VIDEO_TOKENS)) * factor * factor
        elif numbers.get("cap_pixels_per_frame"):
            budget = int(numbers.get("max_video_tokens", 128000) * factor * factor * 0.9)
        return cls(int(low), int(high), float(numbers.get("fps") or 2.0), int(numbers.get("min_frames", 4)),
                   int(numbers.get("max_frames", 768)), budget, style)

    def frame_count(self, total: int, video_fps: float, temporal_patch: int, cap: int | None = None) -> int:
        """Frames sampled from a video of ``total`` frames at ``video_fps`` (``cap``: at most that many,
        the job's ``data.max_frames``, passed as the processor's ``max_frames``).

        Raises:
            SampleError: no whole temporal patch of frames (a video too short to merge).
        """
        return len(self.frame_indices(total, video_fps, temporal_patch, cap))

    def frame_indices(self, total: int, video_fps: float, temporal_patch: int, cap: int | None = None) -> list[int]:
        """The sampled frames' indices, as ``Qwen2VLVideoProcessor.sample_frames`` (``Qwen3VLVideoProcessor``'s
        for ``qwen3_vl``) with ``fps``."""
        if total < 1 or not video_fps or not video_fps > 0:
            raise SampleError(f"a video of {total} frames at {video_fps} fps cannot be sampled by rate")
        top = min(self.max_frames, cap) if cap is not None else self.max_frames
        if self.style == "qwen3_vl":
            return self._qwen3_indices(total, video_fps, temporal_patch, top)
        top = math.floor(min(top, total) / temporal_patch) * temporal_patch
        n = min(max(total / video_fps * self.fps, self.min_frames), top, total)
        n = math.floor(n / temporal_patch) * temporal_patch
        if n < 1:
            raise SampleError(f"a video of {total} frames gives no whole temporal patch of {temporal_patch} frames at "
                              f"fps={self.fps}; the processor cannot merge it")
        import torch

        return torch.arange(0, total, total / n).int().tolist()

    def _qwen3_indices(self, total: int, video_fps: float, temporal_patch: int, top: int) -> list[int]:
        n = min(max(int(total / video_fps * self.fps), self.min_frames), top, total)
        if n < temporal_patch:
            raise SampleError(f"a video of {total} frames gives {n} sampled frames, fewer than the temporal patch of "
                              f"{temporal_patch}; the Qwen3-VL processor cannot merge it")
        import numpy as np

        return np.linspace(0, total - 1, n).round().astype(int).tolist()

    def frame_size(self, frames: int, height: int, width: int, factor: int, temporal_patch: int) -> tuple[int, int]:
        """``(height, width)`` every sampled frame is resized to (``frames`` sampled frames)."""
        if self.style == "qwen3_vl":
            high = self.max_pixels
            if self.pixel_budget is not None:
                high = frames * max(min(self.pixel_budget, self.max_pixels // frames), int(self.min_pixels * 1.05))
            return smart_resize_clip(frames, height, width, temporal_patch, factor, self.min_pixels, high)
        high = self.max_pixels
        if self.pixel_budget is not None:
            high = max(min(high, self.pixel_budget * temporal_patch // frames), int(self.min_pixels * 1.05))
        return smart_resize(height, width, factor, self.min_pixels, high)

    def second_per_grid(self, frames: int, total: int, video_fps: float, temporal_patch: int) -> float:
        """Seconds of video per temporal grid step (Qwen2.5-VL's ``second_per_grid_ts`` entry)."""
        return temporal_patch / (frames / total * video_fps)

    @staticmethod
    def timestamps(indices: list[int], video_fps: float, temporal_patch: int) -> tuple[float, ...]:
        """Seconds of each temporal group of the sampled frames ``indices`` (Qwen3-VL's prompt): the
        indices padded with the last to whole groups, each group the mean of its first and last
        frame's ``index / video_fps`` (``Qwen3VLProcessor._calculate_timestamps``)."""
        padded = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch)
        seconds = [i / video_fps for i in padded]
        return tuple((seconds[i] + seconds[i + temporal_patch - 1]) / 2
                     for i in range(0, len(seconds), temporal_patch))


def frame_texts(seconds: float) -> tuple[str, str]:
    """The text a Qwen3-VL prompt writes before and after one temporal group's video tokens
    (``Qwen3VLProcessor.replace_video_token``)."""
    return f"<{seconds:.1f} seconds>{VISION_START}", VISION_END


def video_config(root: str | Path) -> tuple[Path, dict] | None:
    """The checkpoint's video processor numbers and their file, looked up as transformers does:
    ``processor_config.json``'s ``video_processor``, else ``video_preprocessor_config.json``, else
    the image processor's ``preprocessor_config.json`` (checkpoints saved before video processors)."""
    root = Path(root)
    nested = root / "processor_config.json"
    if nested.is_file():
        numbers = json.loads(nested.read_text())
        if isinstance(numbers.get("video_processor"), dict):
            return nested, numbers["video_processor"]
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (root / name).is_file():
            return root / name, json.loads((root / name).read_text())
    return None
