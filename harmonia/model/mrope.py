"""Multimodal rotary position embedding (M-RoPE) of the Qwen-VL family, as transformers computes it.

Every LLM token carries three positions, temporal / height / width (``t, h, w``), and each rotary
frequency is turned by one of them:

- a text token has ``t = h = w``, counting on from the previous token, so a text-only sequence is
  plain RoPE;
- an image or video item of grid ``(t, h, w)`` patches has ``t * (h / m) * (w / m)`` tokens (``m``
  the spatial merge size) in raster order over ``(frame, row, column)``; all three positions start
  at the running position ``p``: row ``i`` has ``h = p + i``, column ``j`` has ``w = p + j``, frame
  ``k`` has ``t = p + k`` (Qwen2-VL) or ``p + int(k * second_per_grid_t * tokens_per_second)``
  (Qwen2.5-VL videos, in float32);
- after an item, the running position advances by ``max(h, w) / m`` (not by its token count).
  For a video this ignores the frames: text after a video whose temporal positions run past
  ``p + max(h, w) / m`` reuses some of them. That is transformers 5.x; transformers 4.x and Qwen's
  own code went on at the largest position so far plus one. Single-frame items (images, Qwen3-VL
  frames) come out the same either way.

Each media segment is one item. transformers reads items off runs of media tokens, so two items
with no text between would be one run to it; the processors never write that (``<|vision_end|>``
and ``<|vision_start|>`` always stand between).

Qwen3-VL writes a video frame by frame, each frame its own run of tokens between timestamp text
(``<1.5 seconds><|vision_start|>...<|vision_end|>``), so each frame is positioned like an image of
grid ``(1, h, w)``: the temporal position carries no frame index, the timestamp text says when.

`rope_index` follows ``get_rope_index`` of ``Qwen2VLModel``, ``Qwen2_5_VLModel`` and
``Qwen3VLModel`` (transformers 5.x) for one sample. A packed sequence restarts positions at every
sample: call `rope_index` per sample and concatenate along ``T``.

`mrope_cos_sin` builds the rotary tables from those positions; `harmonia.model.layers.apply_rope`
applies them unchanged. Qwen2-VL and Qwen2.5-VL give the ``mrope_section`` frequencies to ``t``,
``h``, ``w`` in consecutive blocks; Qwen3-VL interleaves them (``t h w t h w ... t t``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from harmonia.errors import ConfigError, SampleError
from harmonia.model.layers import rope_inv_freq
from harmonia.model.spec import RopeScaling

Variant = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
VARIANTS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
Grid = tuple[int, int, int]
# ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w)) | ("video", (t, h, w), second_per_grid_t)
Segment = tuple[str, int] | tuple[str, Grid] | tuple[str, Grid, float]


def item_tokens(grid: Grid, spatial_merge_size: int) -> int:
    """LLM tokens of an image or video of ``grid = (t, h, w)`` patches: ``t * (h / m) * (w / m)``."""
    t, h, w = grid
    return t * (h // spatial_merge_size) * (w // spatial_merge_size)


def rope_index(
    segments: Sequence[Segment],
    spatial_merge_size: int,
    variant: Variant = "qwen2_vl",
    tokens_per_second: float | None = None,
) -> torch.Tensor:
    """The ``(t, h, w)`` rotary positions of one sample's tokens, as transformers' ``get_rope_index``.

    Args:
        segments: the sample's tokens in order, each ``("text", n)`` (any non-media tokens,
            ``<|vision_start|>`` and ``<|vision_end|>`` included), ``("image", (t, h, w))`` or
            ``("video", (t, h, w)[, second_per_grid_t])`` with the grid in patches (the processor's
            ``image_grid_thw`` / ``video_grid_thw`` rows; ``second_per_grid_t`` its
            ``second_per_grid_ts`` entry, default 1.0, read by Qwen2.5-VL only). With ``qwen3_vl``
            a video segment is one frame, ``t = 1``, as its processor writes them.
        spatial_merge_size: ``vision_config.spatial_merge_size`` (2 in every released model).
        variant: ``qwen2_vl``, ``qwen2_5_vl`` or ``qwen3_vl``.
        tokens_per_second: ``vision_config.tokens_per_second``; needed by ``qwen2_5_vl`` when the
            sample holds a video (2 in the released Qwen2.5-VL checkpoints).

    Returns:
        ``(3, T)`` int64 positions, rows ``t, h, w``. A packed sequence concatenates one per sample.
    """
    _check_variant(variant)
    if spatial_merge_size < 1:
        raise ConfigError(f"rope_index: spatial_merge_size={spatial_merge_size} must be a positive integer")
    pieces, current = [], 0
    for segment in segments:
        kind = segment[0]
        if kind == "text":
            n = _text_length(segment)
            pieces.append((torch.arange(n) + current).expand(3, n))  # (3, n)
            current += n
        elif kind in ("image", "video"):
            grid = _item_grid(segment, spatial_merge_size, variant)
            interval = _time_interval(segment, variant, tokens_per_second)
            pieces.append(_item_positions(current, grid, spatial_merge_size, interval))  # (3, n)
            current += max(grid[1], grid[2]) // spatial_merge_size
        else:
            raise SampleError(f"rope_index: segment kind {kind!r} is unknown; expected 'text', 'image' or 'video'")
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.int64)
    return torch.cat(pieces, dim=1)  # (3, T)


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ConfigError(f"M-RoPE variant {variant!r} is unknown; expected one of {', '.join(VARIANTS)}")


def _text_length(segment: Segment) -> int:
    if len(segment) != 2 or not isinstance(segment[1], int) or segment[1] < 0:
        raise SampleError(f"rope_index: text segment {segment!r} must be ('text', n) with an integer n >= 0")
    return segment[1]


def _item_grid(segment: Segment, merge: int, variant: str) -> Grid:
    """The ``(t, h, w)`` grid of an image or video segment, checked."""
    kind = segment[0]
    arity = (2,) if kind == "image" else (2, 3)
    if len(segment) not in arity or not isinstance(segment[1], (tuple, list, torch.Tensor)) or len(segment[1]) != 3:
        form = "('image', (t, h, w))" if kind == "image" else "('video', (t, h, w)[, second_per_grid_t])"
        raise SampleError(f"rope_index: {kind} segment {segment!r} must be {form}")
    t, h, w = (int(v) for v in segment[1])
    if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
        raise SampleError(f"rope_index: {kind} grid {(t, h, w)} must be positive with h and w multiples of the "
                          f"spatial merge size {merge}; pass the processor's grid_thw in patches")
    if kind == "video" and variant == "qwen3_vl" and t != 1:
        raise SampleError(f"rope_index: a qwen3_vl video segment is one frame, got grid {(t, h, w)}; give one "
                          f"('video', (1, {h}, {w})) segment per frame with the timestamp text between them, "
                          f"as the Qwen3-VL processor writes the prompt")
    return t, h, w


def _time_interval(segment: Segment, variant: str, tokens_per_second: float | None) -> int | torch.Tensor:
    """Temporal position step between frames: ``tokens_per_second * second_per_grid_t`` for a
    Qwen2.5-VL video, in float32 as transformers multiplies the processor's float32
    ``second_per_grid_ts``; 1 otherwise."""
    if segment[0] != "video" or variant != "qwen2_5_vl":
        return 1
    if tokens_per_second is None:
        raise ConfigError("rope_index: qwen2_5_vl videos need tokens_per_second; pass the checkpoint's "
                          "vision_config.tokens_per_second (2 for the released Qwen2.5-VL)")
    second_per_grid_t = segment[2] if len(segment) == 3 else 1.0
    return tokens_per_second * torch.as_tensor(second_per_grid_t, dtype=torch.float32)


def _item_positions(start: int, grid: Grid, merge: int, interval: int | torch.Tensor) -> torch.Tensor:
    """Positions ``(3, t * h/m * w/m)`` of one item's tokens in raster order, offset by ``start``
    (transformers' ``get_vision_position_ids``): frame index times ``interval``, truncated, for ``t``."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    frames = (torch.arange(t) * interval).long() + start  # (t,)
    rows = torch.arange(h) + start  # (h/m,)
    cols = torch.arange(w) + start  # (w/m,)
    tt, hh, ww = torch.meshgrid(frames, rows, cols, indexing="ij")  # each (t, h/m, w/m)
    return torch.stack([tt, hh, ww]).reshape(3, -1)


def mrope_axes(head_dim: int, mrope_section: Sequence[int], interleaved: bool) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) turns each rotary frequency: ``(head_dim / 2,)`` int64.

    Blocks (Qwen2-VL, Qwen2.5-VL: ``recomposition_frequencies`` splitting by ``mrope_section``): the
    first ``mrope_section[0]`` frequencies follow ``t``, the next ``mrope_section[1]`` ``h``, then
    ``w`` (section ``i`` follows row ``i % 3``). Interleaved (Qwen3-VL): frequency ``j`` follows
    ``h`` if ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, ``w`` if ``j % 3 == 2`` and
    ``j < 3 * mrope_section[2]``, else ``t``.
    """
    half = head_dim // 2
    if head_dim % 2 or sum(mrope_section) != half or min(mrope_section, default=-1) < 0:
        raise ConfigError(f"M-RoPE: mrope_section {list(mrope_section)} must be non-negative and sum to "
                          f"head_dim / 2 = {head_dim / 2} (an even head_dim)")
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(mrope_section)])
    if len(mrope_section) != 3:
        raise ConfigError(f"M-RoPE: interleaved mrope_section {list(mrope_section)} must have 3 entries (t, h, w)")
    axes = torch.zeros(half, dtype=torch.int64)
    for row in (1, 2):
        axes[row:3 * mrope_section[row]:3] = row
    return axes


def mrope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    mrope_section: Sequence[int],
    interleaved: bool,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for ``(t, h, w)`` positions, for `harmonia.model.layers.apply_rope`.

    Equal, bit for bit in float32, to the ``(cos, sin)`` of transformers' ``Qwen2VLRotaryEmbedding``
    / ``Qwen2_5_VLRotaryEmbedding`` (``interleaved=False``) and ``Qwen3VLTextRotaryEmbedding``
    (``interleaved=True``): each frequency ``j`` is turned by its row's position (`mrope_axes`), and
    the half-split layout repeats the ``head_dim / 2`` angles twice as in Llama.

    Args:
        position_ids: ``(3, T)`` or ``(3, B, T)`` integer positions from `rope_index`.
        head_dim: per-head width (even).
        theta: rotary base (``rope_parameters["rope_theta"]``).
        mrope_section: frequencies per row ``(t, h, w)``, summing to ``head_dim / 2``
            (``rope_parameters["mrope_section"]``).
        interleaved: Qwen3-VL's interleaved layout instead of Qwen2-VL's blocks.
        scaling: rescaled frequencies (`rope_inv_freq`); None = plain RoPE.

    Returns:
        ``(cos, sin)``, each ``(T, head_dim)`` or ``(B, T, head_dim)`` in float32.
    """
    if position_ids.dim() not in (2, 3) or position_ids.shape[0] != 3:
        raise ConfigError(f"mrope_cos_sin: position_ids of shape {tuple(position_ids.shape)} must be (3, T) or "
                          f"(3, B, T), rows t, h, w (from rope_index)")
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(position_ids.device, non_blocking=True)  # (hd/2,)
    axes = mrope_axes(head_dim, mrope_section, interleaved).to(position_ids.device, non_blocking=True)  # (hd/2,)
    positions = position_ids[axes].movedim(0, -1)  # (..., T, hd/2): each frequency's own row
    freqs = positions.float() * inv_freq  # (..., T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, hd)
    return emb.cos(), emb.sin()


def item_rope_positions(spec, segments: Sequence[tuple[str, int]], items: Sequence) -> torch.Tensor | None:
    """A decoded sample's ``(3, T)`` rotary positions under ``spec``'s multimodal RoPE (None without it).

    Args:
        spec: the `harmonia.model.spec.MLLMSpec`; its native-resolution tower gives the variant and
            merge size.
        segments: the sample's ``(kind, length)`` runs, kind ``text`` or ``item``.
        items: one `harmonia.model.batch.ItemInputs` per item run, each with its ``grid`` (a video's
            with its ``second_per_grid`` too).

    Raises:
        SampleError: an item without a grid, or an image of more than one temporal patch.
    """
    if not spec.llm.multimodal_rope:
        return None
    towers = [e.native for e in spec.encoders.values() if e.native is not None]
    if len(towers) != 1:
        raise ConfigError(f"MLLM {spec.name!r}: multimodal RoPE needs exactly one native-resolution tower")
    tower, out, it = towers[0], [], iter(items)
    for kind, n in segments:
        if kind == "text":
            out.append(("text", n))
            continue
        item = next(it)
        grid = item.grid
        if grid is None:
            raise SampleError("an item of a model with multimodal RoPE has no grid")
        thw = tuple(int(v) for v in grid[0])
        if item.second_per_grid is not None:  # a video
            out.append(("video", thw, item.second_per_grid))
        elif thw[0] != 1:
            raise SampleError(f"an image of grid {list(thw)}: images have one temporal patch; a video's item needs its "
                              "seconds per grid step")
        else:
            out.append(("image", thw))
    return rope_index(out, tower.merge_size, tower.family, tower.tokens_per_second)
