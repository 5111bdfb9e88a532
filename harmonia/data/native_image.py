"""Images into a native-resolution tower's patch rows, with the model's own Qwen-VL image processor.

transformers' ``Qwen2VLImageProcessor`` (Qwen2-VL and Qwen2.5-VL share it) does the arithmetic:
``smart_resize`` to multiples of patch x merge side within the pixel bounds, rescale, normalise,
repeat the image to ``temporal_patch_size`` frames, and cut it into ``(t * h * w, C * tp * p * p)``
patch rows in the tower's block-major order, with its ``grid_thw``. The numbers come from the
checkpoint's ``preprocessor_config.json`` (`NativeImagePreprocessor.from_pretrained`), or from the
encoder spec (`NativeImagePreprocessor.for_encoder`). The grid a decoded image gets is checked
against the one its header gives (`harmonia.workload.shapes.native_grid`), so the scheduler's token
counts are the model's.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch
from PIL import Image

from harmonia.data.image import DEFAULT_MAX_PIXELS, _processor_class, load_image
from harmonia.data.media_errors import MediaError
from harmonia.data.native_video import NativeVideoPreprocessor
from harmonia.errors import ConfigError
from harmonia.model.spec import EncoderSpec
from harmonia.workload.shapes import ModalityItem, native_grid


class NativeImagePreprocessor:
    """Turns an image into the patch rows and grid a native-resolution tower takes.

    Args:
        processor: the model's transformers ``Qwen2VLImageProcessor`` (either backend).
        encoder: the tower's encoder spec; the processor's patch, merge and temporal patch sizes and
            pixel bounds must be its.
        max_pixels: images with more pixels are refused from their header (not the resize bound).
        video_root: the checkpoint whose ``video_preprocessor_config.json`` gives the video
            normalisation (None: transformers' defaults); the sampling numbers are the spec's.
    """

    def __init__(self, processor, encoder: EncoderSpec, max_pixels: int = DEFAULT_MAX_PIXELS,
                 video_root: str | Path | None = None) -> None:
        if encoder.native is None:
            raise ConfigError(f"encoder {encoder.name!r} is not a native-resolution tower harmonia builds")
        size = processor.size if isinstance(processor.size, dict) else dict(processor.size)
        have = {"patch_size": processor.patch_size, "merge_size": processor.merge_size,
                "temporal_patch_size": processor.temporal_patch_size,
                "min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
        want = {"patch_size": encoder.patch_size, "merge_size": encoder.native.merge_size,
                "temporal_patch_size": encoder.temporal_merge, "min_pixels": encoder.min_pixels,
                "max_pixels": encoder.max_pixels}
        wrong = {k: v for k, v in have.items() if v != want[k]}
        if wrong:
            raise ConfigError(f"image processor {type(processor).__name__} has {wrong} but encoder {encoder.name!r} "
                              f"has {want}; use the checkpoint's own preprocessor_config.json")
        self.processor, self.encoder, self.max_pixels = processor, encoder, max_pixels
        self._video_root = video_root

    @cached_property
    def video(self) -> NativeVideoPreprocessor:
        """The tower's video preprocessing.

        Raises:
            MediaError: the tower's videos are not implemented in the data path (Qwen3-VL's).
        """
        try:
            return NativeVideoPreprocessor.from_pretrained(self._video_root, self.encoder)
        except ConfigError as e:
            raise MediaError("unsupported_media", str(e)) from e

    @classmethod
    def for_encoder(cls, encoder: EncoderSpec, max_pixels: int = DEFAULT_MAX_PIXELS,
                    video_root: str | Path | None = None) -> NativeImagePreprocessor:
        """The processor with the spec's numbers (transformers' defaults for the rest)."""
        if encoder.native is None:
            raise ConfigError(f"encoder {encoder.name!r} is not a native-resolution tower harmonia builds")
        processor = _processor_class("Qwen2VLImageProcessor")(
            size={"shortest_edge": encoder.min_pixels, "longest_edge": encoder.max_pixels},
            patch_size=encoder.patch_size, merge_size=encoder.native.merge_size,
            temporal_patch_size=encoder.temporal_merge)
        return cls(processor, encoder, max_pixels, video_root)

    @classmethod
    def from_pretrained(cls, path: str | Path, encoder: EncoderSpec,
                        max_pixels: int = DEFAULT_MAX_PIXELS) -> NativeImagePreprocessor:
        """The checkpoint's own image processor (``preprocessor_config.json``), offline."""
        from transformers import AutoImageProcessor

        if not (Path(path) / "preprocessor_config.json").is_file():
            return cls.for_encoder(encoder, max_pixels, video_root=path)
        return cls(AutoImageProcessor.from_pretrained(str(path), local_files_only=True), encoder, max_pixels, path)

    def patches(self, img: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """An (oriented) image -> ``(t * h * w, C * tp * p * p)`` float32 rows and its ``(1, 3)`` grid.

        Raises:
            MediaError: the processor's grid is not the one the image's size gives.
        """
        out = self.processor(images=[img], return_tensors="pt")
        grid = out["image_grid_thw"]
        want = native_grid(ModalityItem.image(height=img.height, width=img.width), self.encoder)
        if tuple(grid.shape) != (1, 3) or tuple(grid[0].tolist()) != want:
            raise MediaError("unsupported_media", f"the image processor gave grid {grid.tolist()} for a "
                             f"{img.width}x{img.height} image, expected {list(want)}")
        return out["pixel_values"].float(), grid

    def load(self, data: bytes | str | Path) -> Image.Image:
        """Decode an image, refusing it from its header when over ``max_pixels``; EXIF orientation applied."""
        return load_image(data, self.max_pixels)
