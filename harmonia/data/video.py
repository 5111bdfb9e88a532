"""Video: frames decoded from a container with PyAV, or given as image files, sampled uniformly.

Sampling (`FrameSampling`) is by count or by rate, over the whole video:

- by count: ``n = min(num_frames, total)`` frames at indices ``i * total // n`` (transformers' default
  video sampler, the uniform sampling of LLaVA-Video and InternVL);
- by rate: ``n = max(1, int(total / video_fps * fps))`` frames (at most ``num_frames`` when it is also
  given, as Qwen2-VL caps ``fps`` sampling), at the same uniform indices.

`video_header` reads the frame count, rate and size from the container without decoding
(``stream.frames``; the packets are counted by demuxing when the container does not say), so the
scheduler's frame counts come from headers; `decode_frames` then decodes exactly those frames.
Each frame is preprocessed as one image tile (`harmonia.data.image.ImagePreprocessor.frames`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from harmonia.data.media_errors import MediaError
from harmonia.errors import ConfigError


@dataclass(frozen=True)
class VideoInfo:
    """What a container says about its first video stream."""

    frames: int
    fps: float
    height: int
    width: int

    @property
    def seconds(self) -> float:
        return self.frames / self.fps


@dataclass(frozen=True)
class FrameSampling:
    """Which frames of a video become encoder inputs.

    Attributes:
        num_frames: frames sampled uniformly (the most, when ``fps`` is also given).
        fps: frames per second of video sampled instead of a fixed count; needs the video's own rate.
    """

    num_frames: int | None = 8
    fps: float | None = None

    def __post_init__(self) -> None:
        if self.num_frames is None and self.fps is None:
            raise ConfigError("frame sampling needs num_frames, fps, or both (fps with num_frames as the cap)")
        if (self.num_frames is not None and self.num_frames < 1) or (self.fps is not None and not self.fps > 0):
            raise ConfigError(f"frame sampling num_frames={self.num_frames}, fps={self.fps}: expected positive values")

    def indices(self, total: int, video_fps: float | None = None) -> list[int]:
        """Sampled frame indices of a video of ``total`` frames at ``video_fps``."""
        return sample_frame_indices(total, self.num_frames, self.fps, video_fps)


def sample_frame_indices(total: int, num_frames: int | None = None, fps: float | None = None,
                         video_fps: float | None = None) -> list[int]:
    """Uniform frame indices: ``i * total // n`` for ``n`` frames (see the module docstring for ``n``)."""
    if total < 1:
        raise MediaError("corrupt_media", "video has no frames")
    if fps is not None:
        if not video_fps:
            raise MediaError("unsupported_media", f"sampling at fps={fps} needs the video's own frame rate; give "
                             "'fps' for a frame list, or sample by num_frames")
        n = max(1, int(total / video_fps * fps))
        n = min(n, num_frames) if num_frames is not None else n
    elif num_frames is not None:
        n = num_frames
    else:
        raise ConfigError("frame sampling needs num_frames or fps")
    n = min(n, total)
    return [i * total // n for i in range(n)]


def _source(data: bytes | str | Path):
    return io.BytesIO(data) if isinstance(data, bytes) else str(data)


def _open(data: bytes | str | Path):
    import av

    try:
        container = av.open(_source(data))
    except Exception as e:
        raise MediaError("corrupt_media", f"PyAV cannot open the video: {type(e).__name__}: {e}") from e
    if not container.streams.video:
        container.close()
        raise MediaError("unsupported_media", "the file has no video stream")
    return container


def video_header(data: bytes | str | Path) -> VideoInfo:
    """Frame count, rate and size of the first video stream, from the container (no decoding)."""
    with _open(data) as container:
        stream = container.streams.video[0]
        try:
            frames = stream.frames or sum(1 for p in container.demux(stream) if p.size)
        except Exception as e:
            raise MediaError("corrupt_media", f"cannot read the video's packets: {type(e).__name__}: {e}") from e
        rate = stream.average_rate or stream.guessed_rate
        if not frames or not rate:
            raise MediaError("corrupt_media", f"video declares {frames} frames at {rate} fps; nothing to sample")
        return VideoInfo(int(frames), float(rate), stream.codec_context.height, stream.codec_context.width)


def decode_frames(data: bytes | str | Path, indices: list[int]) -> list[Image.Image]:
    """The frames at ``indices`` (increasing) as RGB images, decoding up to the last one."""
    wanted, out = set(indices), []
    with _open(data) as container:
        container.streams.video[0].thread_type = "AUTO"
        try:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    out.append(frame.to_image())
                if i >= indices[-1]:
                    break
        except Exception as e:
            raise MediaError("corrupt_media", f"cannot decode the video: {type(e).__name__}: {e}") from e
    if len(out) != len(indices):
        raise MediaError("shape_mismatch", f"needed frames {indices[0]}..{indices[-1]} but only {len(out)} of "
                         f"{len(indices)} decode; the container's frame count is wrong, re-encode it")
    return out
