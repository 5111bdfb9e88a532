"""The pixel size a Qwen-VL processor resizes an image or video frame to (transformers' ``smart_resize``)."""

from __future__ import annotations

import math

from harmonia.errors import SampleError


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The ``(height, width)`` a Qwen-VL processor resizes an image to (transformers' ``smart_resize``):
    each side rounded to a multiple of ``factor`` (patch x merge side), then scaled, keeping the aspect
    ratio, to between ``min_pixels`` and ``max_pixels`` pixels.

    Raises:
        SampleError: an aspect ratio over 200, which the processor refuses.
    """
    if max(height, width) / min(height, width) > 200:
        raise SampleError(f"an image of {height}x{width} has an aspect ratio over 200, which the Qwen-VL processor "
                          "refuses")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def smart_resize_clip(frames: int, height: int, width: int, temporal_patch: int, factor: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """The ``(height, width)`` Qwen3-VL's video processor resizes a clip's frames to (its
    ``smart_resize``): sides under ``factor`` first scaled up to it, each side rounded to a multiple
    of ``factor``, then scaled so that the clip's pixels (frames rounded to the temporal patch, times
    height and width) lie within ``[min_pixels, max_pixels]``.

    Raises:
        SampleError: fewer frames than one temporal patch, or an aspect ratio over 200.
    """
    if frames < temporal_patch:
        raise SampleError(f"a clip of {frames} frames is shorter than the temporal patch of {temporal_patch}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise SampleError(f"video frames of {height}x{width} have an aspect ratio over 200, which the Qwen3-VL "
                          "processor refuses")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / temporal_patch) * temporal_patch
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w
