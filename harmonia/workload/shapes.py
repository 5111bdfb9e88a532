"""Sample shapes: the sizes of a sample, everything the scheduler needs and no pixels.

A sample is text tokens plus modality items (images, videos, audio clips). Each item becomes one or
more encoder sequences (a tile, a frame, a 30-second audio chunk) and then a block of LLM tokens.
Every conversion reads the encoder's spec (`harmonia.model.spec.EncoderSpec`); nothing is a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harmonia.errors import SampleError
from harmonia.model.anyres import anyres_tiles, anyres_tokens, unsized_tokens
from harmonia.model.native_resize import smart_resize
from harmonia.model.spec import MODALITIES, EncoderSpec


@dataclass(frozen=True)
class ModalityItem:
    """One image, video or audio clip inside a sample.

    Attributes:
        modality: ``image``, ``video`` or ``audio``.
        tiles: image tiles already cut (InternVL-style dynamic tiling; a thumbnail counts), or tiles
            per video frame.
        height: pixel height (image or video frame) when ``tiles`` is not given.
        width: pixel width (image or video frame) when ``tiles`` is not given.
        frames: video frames.
        seconds: audio duration.
        times: a video the prompt writes one temporal group of frames at a time, each after its
            timestamp (Qwen3-VL): each group's seconds. Such a video is one item per group in a
            sample (`item_parts`).
        part: one temporal group of such a video: ``(its index, the video's groups)``; ``height``
            and ``width`` are then the size its frames are resized to, ``times`` its seconds.
    """

    modality: str
    tiles: int | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    seconds: float | None = None
    times: tuple[float, ...] | None = None
    part: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise SampleError(f"unknown modality {self.modality!r}: expected one of {MODALITIES}")
        for name in ("tiles", "height", "width", "frames"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise SampleError(f"{self.modality} item: {name}={value!r} must be a positive integer")
        if self.seconds is not None and not self.seconds > 0:
            raise SampleError(f"audio item: seconds={self.seconds!r} must be positive")
        if self.modality == "audio":
            if self.seconds is None:
                raise SampleError("audio item needs seconds=<duration>")
            return
        if self.tiles is None and (self.height is None or self.width is None):
            raise SampleError(f"{self.modality} item needs tiles=N or both height and width in pixels")
        if self.modality == "video" and self.frames is None:
            raise SampleError("video item needs frames=N")
        if self.modality == "image" and self.frames is not None:
            raise SampleError("image item cannot have frames; use modality='video'")
        if self.times is not None and (self.modality != "video" or not self.times):
            raise SampleError(f"{self.modality} item: times={self.times!r} are a video's temporal groups' seconds")
        if self.part is not None and (self.times is None or len(self.times) != 1
                                      or not 0 <= self.part[0] < self.part[1]):
            raise SampleError(f"video item: part={self.part!r} must be (index, groups) with index < groups and "
                              "one time")

    @staticmethod
    def image(tiles: int | None = None, height: int | None = None, width: int | None = None) -> ModalityItem:
        return ModalityItem("image", tiles=tiles, height=height, width=width)

    @staticmethod
    def video(frames: int, tiles: int | None = None, height: int | None = None,
              width: int | None = None) -> ModalityItem:
        return ModalityItem("video", tiles=tiles, height=height, width=width, frames=frames)

    @staticmethod
    def audio(seconds: float) -> ModalityItem:
        return ModalityItem("audio", seconds=float(seconds))


@dataclass(frozen=True)
class SampleShape:
    """Text tokens and modality items of one sample.

    Attributes:
        text_tokens: text tokens of the sample (prompt and answer), not counting item tokens.
        items: the sample's modality items, in sequence order.
        item_offsets: for each item, how many text tokens precede it; None places every item at the
            start (``<image>`` then the question, the common SFT layout). Non-decreasing.
        sample_id: an identifier carried through scheduling (row index of a trace, say).
    """

    text_tokens: int
    items: tuple[ModalityItem, ...] = ()
    item_offsets: tuple[int, ...] | None = None
    sample_id: int | None = None

    def __post_init__(self) -> None:
        where = f"sample {self.sample_id}" if self.sample_id is not None else "sample"
        if not isinstance(self.text_tokens, int) or self.text_tokens < 0:
            raise SampleError(f"{where}: text_tokens={self.text_tokens!r} must be a non-negative integer")
        object.__setattr__(self, "items", tuple(self.items))
        for item in self.items:
            if not isinstance(item, ModalityItem):
                raise SampleError(f"{where}: items must be ModalityItem, got {type(item).__name__}")
        if self.item_offsets is not None:
            offsets = tuple(self.item_offsets)
            if len(offsets) != len(self.items):
                raise SampleError(f"{where}: {len(offsets)} item_offsets for {len(self.items)} items")
            if any(o < 0 or o > self.text_tokens for o in offsets) or list(offsets) != sorted(offsets):
                raise SampleError(
                    f"{where}: item_offsets {offsets} must be non-decreasing within 0..text_tokens={self.text_tokens}"
                )
            object.__setattr__(self, "item_offsets", offsets)
        if self.text_tokens == 0 and not self.items:
            raise SampleError(f"{where} is empty: it has no text tokens and no items")

    def __hash__(self) -> int:
        # kept after the first call: a batch's shapes key the cost model's caches, asked millions of
        # times in a plan search; never pickled (string hashes differ between processes)
        kept = self.__dict__.get("_hash")
        if kept is None:
            kept = hash((self.text_tokens, self.items, self.item_offsets, self.sample_id))
            object.__setattr__(self, "_hash", kept)
        return kept

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def offsets(self) -> tuple[int, ...]:
        return self.item_offsets if self.item_offsets is not None else (0,) * len(self.items)

    def modalities(self) -> set[str]:
        return {item.modality for item in self.items}


def find_tile_grid(height: int, width: int, image_size: int, max_tiles: int, min_tiles: int = 1) -> tuple[int, int]:
    """InternVL dynamic tiling: the (cols, rows) grid whose aspect ratio is closest to the image's.

    Candidates are all grids with ``min_tiles <= cols * rows <= max_tiles``; ties are broken towards
    more tiles when the image has more than half the pixels of the larger grid (InternVL 1.5,
    ``find_closest_aspect_ratio``).
    """
    aspect = width / height
    grids = sorted(
        {(c, r) for n in range(min_tiles, max_tiles + 1) for c in range(1, n + 1) for r in range(1, n + 1)
         if min_tiles <= c * r <= max_tiles},
        key=lambda g: g[0] * g[1],
    )
    best, best_diff = (1, 1), float("inf")
    area = height * width
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * image_size * image_size * cols * rows:
            best = (cols, rows)
    return best


def image_tiles(item: ModalityItem, encoder: EncoderSpec, thumbnail: bool = True) -> int:
    """Tiles an image (or one video frame) is cut into by a fixed-size encoder (anyres: the base
    tile and the grid's, `harmonia.model.anyres`)."""
    if item.tiles is not None:
        return item.tiles
    if encoder.grid_pinpoints:
        return anyres_tiles(item.height, item.width, encoder)
    cols, rows = find_tile_grid(item.height, item.width, encoder.image_size, encoder.max_tiles)
    n = cols * rows
    return n + 1 if thumbnail and n > 1 else n


def item_parts(item: ModalityItem, encoder: EncoderSpec) -> tuple[ModalityItem, ...]:
    """The items an item is in a sample's sequence: itself, or, for a video written one temporal
    group at a time (``times``), one per group: its frames (the last group's may be fewer than the
    temporal patch; the processor repeats the last), sized as the whole video's, and its seconds.

    Raises:
        SampleError: ``times`` not one per temporal group of the video's frames.
    """
    if item.times is None or item.part is not None:
        return (item,)
    tm, groups = encoder.temporal_merge, len(item.times)
    if encoder.native is None or encoder.video is None or math.ceil(item.frames / tm) != groups:
        raise SampleError(f"a video of {item.frames} frames with {groups} timestamps: expected one per temporal "
                          f"group of {tm} frames, for a native-resolution tower with video numbers")
    side = encoder.patch_size * math.isqrt(encoder.token_merge)
    h, w = encoder.video.frame_size(item.frames, item.height, item.width, side, tm)
    return tuple(ModalityItem("video", height=h, width=w, frames=min(tm, item.frames - g * tm), times=(t,),
                              part=(g, groups)) for g, t in enumerate(item.times))


def native_grid(item: ModalityItem, encoder: EncoderSpec) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid of an image or video for a native-resolution tower with the
    processor's numbers (`EncoderSpec.native`): ``t = ceil(frames / temporal_merge)``, each frame
    resized by `smart_resize` (a video's frames with its video processor's bounds, `EncoderSpec.video`). An item known by its tile count only (a trace's) is that many
    ``image_size`` squares side by side, as its encoder saw them."""
    p, side = encoder.patch_size, encoder.patch_size * math.isqrt(encoder.token_merge)
    if item.tiles is not None:
        h, w = encoder.image_size, encoder.image_size * item.tiles
    elif item.part is not None:  # frames already sized with the whole video's (`item_parts`)
        h, w = item.height, item.width
    elif item.modality == "video" and encoder.video is not None:
        h, w = encoder.video.frame_size(item.frames, item.height, item.width, side, encoder.temporal_merge)
    else:
        h, w = smart_resize(item.height, item.width, side, encoder.min_pixels, encoder.max_pixels)
    return math.ceil((item.frames or 1) / encoder.temporal_merge), h // p, w // p


def window_sequences(item: ModalityItem, encoder: EncoderSpec) -> list[int]:
    """Patches of each attention window of a native-resolution tower with windows (Qwen2.5-VL;
    `harmonia.model.qwen_vit.plan_windows`): every frame's grid of merged tokens cut into squares of
    ``window_tokens`` from the top left, the last row and column of squares smaller."""
    t, h, w = native_grid(item, encoder)
    m, side = encoder.native.merge_size, encoder.native.window_tokens
    rows = [min(side, h // m - a) for a in range(0, h // m, side)]
    cols = [min(side, w // m - b) for b in range(0, w // m, side)]
    return [r * c * m * m for r in rows for c in cols] * t


def windowed_blocks(encoder: EncoderSpec) -> tuple[int, ...]:
    """Blocks of an encoder that attend within windows (Qwen2.5-VL's, all but its full-attention ones)."""
    n = encoder.native
    if n is None or n.window_size is None:
        return ()
    return tuple(i for i in range(encoder.body.n_layers) if i not in n.full_attention_layers)


def _native_patches(item: ModalityItem, encoder: EncoderSpec) -> int:
    """Patches of one frame of a native-resolution image without the processor's numbers: each side
    rounded up to a multiple of patch x merge side."""
    side = encoder.patch_size * math.isqrt(encoder.token_merge)
    rows = math.ceil(item.height / side) * side // encoder.patch_size
    cols = math.ceil(item.width / side) * side // encoder.patch_size
    return rows * cols


def _audio_chunks(item: ModalityItem, encoder: EncoderSpec) -> list[float]:
    """Seconds of each chunk the encoder processes (Whisper pads each chunk to ``chunk_seconds``)."""
    if encoder.chunk_seconds is None:
        return [item.seconds]
    n = math.ceil(item.seconds / encoder.chunk_seconds)
    return [encoder.chunk_seconds] * n


def audio_encoder_tokens(seconds: float, encoder: EncoderSpec) -> int:
    """Encoder tokens of an audio chunk: mel frames ``samples // hop`` with ``samples = round(seconds *
    sample_rate)`` (the decoded length; flooring the product in floats can lose a frame), then the strided conv."""
    mel = round(seconds * encoder.sample_rate) // encoder.hop_length
    return max(1, math.ceil(mel / encoder.conv_stride))


def encoder_sequences(item: ModalityItem, encoder: EncoderSpec) -> list[int]:
    """Token counts of the independent encoder sequences an item becomes.

    Image: one sequence per tile of ``patches_per_tile (+1 class token)``, or one sequence of all
    patches for a native-resolution encoder. Video: the same per frame. Audio: one sequence per chunk.
    """
    if item.modality not in encoder.modalities:
        raise SampleError(
            f"encoder {encoder.name!r} encodes {encoder.modalities}, not a {item.modality} item"
        )
    if item.modality == "audio":
        return [audio_encoder_tokens(s, encoder) for s in _audio_chunks(item, encoder)]
    frames = item.frames or 1
    if encoder.native is not None:  # one sequence per temporal patch of frames
        t, h, w = native_grid(item, encoder)
        return [h * w] * t
    if encoder.native_resolution and item.tiles is None:
        return [_native_patches(item, encoder)] * frames
    per_tile = encoder.patches_per_tile() + int(encoder.cls_token)
    return [per_tile] * (image_tiles(item, encoder) * frames)


def llm_tokens_of_item(item: ModalityItem, encoder: EncoderSpec, audio_merge: int = 1) -> int:
    """LLM tokens an item becomes after its projector.

    Image: `EncoderSpec.llm_tokens_per_tile` per tile (patches less the dropped class token, over
    ``token_merge``); an anyres encoder's per image size (`harmonia.model.anyres.anyres_tokens`),
    or, for an image known by its tile count only, the most such an image gives
    (`harmonia.model.anyres.unsized_tokens`). Video: per-frame tokens times
    ``ceil(frames / temporal_merge)``. Audio: encoder tokens divided by ``token_merge``.
    """
    if item.modality == "audio":
        enc = sum(encoder_sequences(item, encoder))
        return math.ceil(enc / encoder.token_merge)
    if encoder.grid_pinpoints and item.modality == "image":
        if item.tiles is not None:
            return unsized_tokens(item.tiles, encoder)
        return anyres_tokens(item.height, item.width, encoder)
    if encoder.native is not None:
        t, h, w = native_grid(item, encoder)
        return t * h * w // encoder.token_merge
    if encoder.native_resolution and item.tiles is None:
        per_frame = _native_patches(item, encoder) // encoder.token_merge
    else:
        per_frame = image_tiles(item, encoder) * encoder.llm_tokens_per_tile()
    if item.modality == "video":
        return per_frame * math.ceil(item.frames / encoder.temporal_merge)
    return per_frame
