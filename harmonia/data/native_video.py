"""Videos into a native-resolution tower's patch rows, as the model's Qwen-VL video processor makes them.

transformers' ``Qwen2VLVideoProcessor`` (Qwen2-VL, Qwen2.5-VL) and ``Qwen3VLVideoProcessor`` need
torchvision, which harmonia does not install; this is their arithmetic, checked against their outputs
(``tests/fixtures/qwen_video_reference.safetensors``, ``qwen3_video_reference.safetensors``):

1. frames sampled by rate (`harmonia.model.video_spec.VideoNumbers.frame_indices`; the job's
   ``data.max_frames`` is the processor's ``max_frames`` argument);
2. every frame resized to one ``(h, w)`` (`VideoNumbers.frame_size`) as torchvision resizes a uint8
   tensor on the CPU: torch's own uint8 bicubic kernel with antialias;
3. rescale and normalise fused as transformers fuses them: ``(x - mean * 255) / (std * 255)``;
4. the last frame repeated to fill the last temporal patch, then cut into
   ``(t * h * w, C * tp * p * p)`` patch rows in the tower's block-major order, with grid
   ``(t, h / p, w / p)``.

The numbers come from the checkpoint's video processor config (`harmonia.model.video_spec.video_config`)
through the encoder spec (`harmonia.model.spec.EncoderSpec.video`, whose ``style`` says how Qwen3-VL
samples and sizes otherwise); mean, std and rescale factor from the same file. A Qwen3-VL video is
written in the prompt one temporal group at a time, each after its timestamp (`timestamps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from harmonia.data.media_errors import MediaError
from harmonia.errors import ConfigError, SampleError
from harmonia.model.spec import EncoderSpec
from harmonia.model.video_spec import video_config

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / STD, the Qwen2-VL processors' defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN / STD, Qwen3VLVideoProcessor's


@dataclass(frozen=True)
class NativeVideoPreprocessor:
    """Sampled frames of one video -> patch rows and grid for a Qwen-VL tower.

    Args:
        encoder: the tower's spec; its ``video`` numbers sample and size the frames.
        mean: per-channel normalisation mean (of pixel values in ``[0, 1]``).
        std: per-channel standard deviation.
        rescale_factor: what a uint8 value is multiplied by before normalising (1 / 255).
    """

    encoder: EncoderSpec
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        if self.encoder.native is None or self.encoder.video is None:
            raise ConfigError(f"encoder {self.encoder.name!r} has no native-resolution tower with video numbers")

    @classmethod
    def from_pretrained(cls, path: str | Path | None, encoder: EncoderSpec) -> NativeVideoPreprocessor:
        """The checkpoint's mean, std and rescale factor (its spec carries the sampling numbers)."""
        found = video_config(path) if path is not None else None
        numbers = found[1] if found is not None else {}
        default = HALF if encoder.video is not None and encoder.video.style == "qwen3_vl" else None
        return cls(encoder, tuple(numbers.get("image_mean", default or CLIP_MEAN)),
                   tuple(numbers.get("image_std", default or CLIP_STD)),
                   float(numbers.get("rescale_factor", 1 / 255)))

    @property
    def grouped(self) -> bool:
        """Whether the prompt writes the video one temporal group at a time, each after its
        timestamp (Qwen3-VL)."""
        return self.encoder.video.style == "qwen3_vl"

    @property
    def temporal_patch(self) -> int:
        return self.encoder.temporal_merge

    @property
    def factor(self) -> int:
        return self.encoder.patch_size * self.encoder.native.merge_size

    def indices(self, total: int, video_fps: float | None, cap: int | None = None) -> list[int]:
        """Indices of the frames sampled from a video of ``total`` frames at ``video_fps``.

        Raises:
            MediaError: no frame rate (a frame list without ``data.frames_fps``), or too few frames to merge.
        """
        if not video_fps:
            raise MediaError("unsupported_media", "a Qwen-VL video is sampled by rate and needs its frame rate; for "
                             "videos given as lists of frame files set data.frames_fps")
        try:
            return self.encoder.video.frame_indices(total, video_fps, self.temporal_patch, cap)
        except SampleError as e:
            raise MediaError("unsupported_media", str(e)) from e

    def timestamps(self, indices: list[int], video_fps: float) -> tuple[float, ...]:
        """Seconds of each temporal group of the sampled frames (Qwen3-VL's prompt)."""
        return self.encoder.video.timestamps(indices, video_fps, self.temporal_patch)

    def second_per_grid(self, frames: int, total: int, video_fps: float) -> float:
        """Seconds of video per temporal grid step (Qwen2.5-VL's rotary time step)."""
        return self.encoder.video.second_per_grid(frames, total, video_fps, self.temporal_patch)

    def patches(self, frames: list[Image.Image] | np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Sampled frames (PIL images, or ``(n, H, W, 3)`` uint8) -> ``(t * h * w, C * tp * p * p)``
        float32 rows and the grid ``(t, h, w)`` in patches."""
        x = self._stack(frames)  # (n, 3, H, W) uint8
        n, _, height, width = x.shape
        h, w = self.encoder.video.frame_size(n, height, width, self.factor, self.temporal_patch)
        if (h, w) != (height, width):
            x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
        mean = torch.tensor(self.mean) * (1.0 / self.rescale_factor)  # (3,) float32, as transformers fuses them
        std = torch.tensor(self.std) * (1.0 / self.rescale_factor)
        x = (x.float() - mean[:, None, None]) / std[:, None, None]  # (n, 3, h, w)
        return self._patchify(x)

    @staticmethod
    def _stack(frames: list[Image.Image] | np.ndarray) -> torch.Tensor:
        if isinstance(frames, np.ndarray):
            arrays = frames
        else:
            sizes = {f.size for f in frames}
            if len(sizes) != 1:
                raise MediaError("shape_mismatch", f"a video's frames differ in size ({sorted(sizes)}); the processor "
                                 "resizes them as one")
            arrays = np.stack([np.asarray(f.convert("RGB")) for f in frames])
        if arrays.ndim != 4 or arrays.shape[-1] != 3 or arrays.dtype != np.uint8:
            raise MediaError("unsupported_media", f"video frames of shape {arrays.shape} and {arrays.dtype}; expected "
                             "(n, H, W, 3) uint8")
        return torch.from_numpy(np.ascontiguousarray(arrays)).permute(0, 3, 1, 2)

    def _patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``(n, C, h, w)`` -> patch rows in ``(t, h / m, w / m, m, m)`` order, each ``(C, tp, p, p)``."""
        tp, p, m = self.temporal_patch, self.encoder.patch_size, self.encoder.native.merge_size
        if pad := -x.shape[0] % tp:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        n, c, h, w = x.shape
        t, gh, gw = n // tp, h // p, w // p
        rows = x.reshape(t, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return rows.reshape(t * gh * gw, c * tp * p * p).contiguous(), (t, gh, gw)
