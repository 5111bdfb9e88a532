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
from harmonia.model.native_resize import smart_resize

# Qwen2VLVideoProcessor's class defaults (fps as its processor samples when asked to, and Qwen3-VL's).
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768
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
        min_pixels: smallest resized frame, in pixels (``size.shortest_edge``).
        max_pixels: largest (``size.longest_edge``).
        fps: frames sampled per second of video.
        min_frames: fewest frames sampled.
        max_frames: most frames sampled.
        pixel_budget: the whole video's pixels with ``cap_pixels_per_frame`` (None: no cap).
    """

    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    pixel_budget: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(f"video min_pixels={self.min_pixels} and max_pixels={self.max_pixels} must be positive "
                              "with min_pixels <= max_pixels")
        if not self.fps > 0 or not 0 < self.min_frames <= self.max_frames:
            raise ConfigError(f"video fps={self.fps}, min_frames={self.min_frames}, max_frames={self.max_frames}: "
                              "expected a positive rate and 0 < min_frames <= max_frames")

    @classmethod
    def from_config(cls, numbers: dict, factor: int, where: str) -> VideoNumbers:
        """The numbers of a ``video_preprocessor_config.json``; ``factor`` is patch x merge side.

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
        low = numbers.get("min_pixels", size.get("shortest_edge", VIDEO_MIN_PIXELS))
        high = numbers.get("max_pixels", size.get("longest_edge", VIDEO_MAX_PIXELS))
        budget = None
        if numbers.get("cap_pixels_per_frame"):
            budget = int(numbers.get("max_video_tokens", 128000) * factor * factor * 0.9)
        return cls(int(low), int(high), float(numbers.get("fps") or 2.0), int(numbers.get("min_frames", 4)),
                   int(numbers.get("max_frames", 768)), budget)

    def frame_count(self, total: int, video_fps: float, temporal_patch: int, cap: int | None = None) -> int:
        """Frames sampled from a video of ``total`` frames at ``video_fps`` (``cap``: at most that many,
        the job's ``data.max_frames``, passed as the processor's ``max_frames``).

        Raises:
            SampleError: no whole temporal patch of frames (a video too short to merge).
        """
        return len(self.frame_indices(total, video_fps, temporal_patch, cap))

    def frame_indices(self, total: int, video_fps: float, temporal_patch: int, cap: int | None = None) -> list[int]:
        """The sampled frames' indices, as ``Qwen2VLVideoProcessor.sample_frames`` with ``fps``."""
        if total < 1 or not video_fps or not video_fps > 0:
            raise SampleError(f"a video of {total} frames at {video_fps} fps cannot be sampled by rate")
        top = min(self.max_frames, cap) if cap is not None else self.max_frames
        top = math.floor(min(top, total) / temporal_patch) * temporal_patch
        n = min(max(total / video_fps * self.fps, self.min_frames), top, total)
        n = math.floor(n / temporal_patch) * temporal_patch
        if n < 1:
            raise SampleError(f"a video of {total} frames gives no whole temporal patch of {temporal_patch} frames at "
                              f"fps={self.fps}; the processor cannot merge it")
        import torch

        return torch.arange(0, total, total / n).int().tolist()

    def frame_size(self, frames: int, height: int, width: int, factor: int, temporal_patch: int) -> tuple[int, int]:
        """``(height, width)`` every sampled frame is resized to (``frames`` sampled frames)."""
        high = self.max_pixels
        if self.pixel_budget is not None:
            high = max(min(high, self.pixel_budget * temporal_patch // frames), int(self.min_pixels * 1.05))
        return smart_resize(height, width, factor, self.min_pixels, high)

    def second_per_grid(self, frames: int, total: int, video_fps: float, temporal_patch: int) -> float:
        """Seconds of video per temporal grid step (Qwen2.5-VL's ``second_per_grid_ts`` entry)."""
        return temporal_patch / (frames / total * video_fps)


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
