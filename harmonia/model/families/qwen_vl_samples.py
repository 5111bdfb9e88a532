"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL samples from what their processors return (`tokenized_sample`),
apart from the family's spec (`harmonia.model.families.qwen_vl`) so that reading a spec imports no
torch."""

from __future__ import annotations

import torch

from harmonia.errors import SampleError
from harmonia.model.batch import ItemInputs, TokenizedSample
from harmonia.model.llm import IGNORE_INDEX
from harmonia.model.mrope import item_tokens, rope_index
from harmonia.model.spec import MLLMSpec


def _items(spec: MLLMSpec, input_ids: torch.Tensor, pixels: dict[str, torch.Tensor | None],
           grids: dict[str, torch.Tensor | None], sample_id) -> tuple[list[tuple[str, object]], list[ItemInputs]]:
    """Segments for `rope_index` and one `ItemInputs` per image and video, in sequence order."""
    m = spec.encoders["vision"].native.merge_size
    ids = input_ids.tolist()
    runs, t = [], 0  # (modality, start, length) of each run of media tokens
    token_of = {tok: mod for mod, tok in spec.item_token_ids.items()}
    while t < len(ids):
        if ids[t] in token_of:
            start, mod = t, token_of[ids[t]]
            while t < len(ids) and ids[t] == spec.item_token_ids[mod]:
                t += 1
            runs.append((mod, start, t - start))
        else:
            t += 1
    queues = {mod: list(zip(_rows(pixels[mod], grids[mod]), (grids[mod] if grids[mod] is not None else [])))
              for mod in ("image", "video")}
    if spec.encoders["vision"].native.family == "qwen3_vl":  # a video is a run per temporal group
        queues["video"] = [(part, torch.tensor([1, h, w])) for rows, (t, h, w) in queues["video"]
                           for part in rows.split(int(h * w))]
    segments, items, pos = [], [], 0
    for mod, start, length in runs:
        if not queues[mod]:
            raise SampleError(f"sample {sample_id}: more {mod} token runs than {mod}s")
        rows, grid = queues[mod].pop(0)
        grid = tuple(int(v) for v in grid)
        if item_tokens(grid, m) != length:
            raise SampleError(f"sample {sample_id}: a {mod} of grid {grid} has {item_tokens(grid, m)} "
                              f"tokens but its run has {length}")
        if start > pos:
            segments.append(("text", start - pos))
        segments.append((mod, grid))
        items.append(ItemInputs("vision", rows, grid=torch.tensor([grid])))
        pos = start + length
    if pos < len(ids):
        segments.append(("text", len(ids) - pos))
    left = {mod: len(q) for mod, q in queues.items() if q}
    if left:
        raise SampleError(f"sample {sample_id}: {left} media without placeholder tokens")
    return segments, items


def _rows(pixels: torch.Tensor | None, grids: torch.Tensor | None) -> list[torch.Tensor]:
    """Each item's patch rows of the processor's packed ``pixel_values``."""
    if grids is None:
        return []
    counts = [int(t * h * w) for t, h, w in grids.tolist()]
    if pixels is None or pixels.shape[0] != sum(counts):
        raise SampleError(f"the grids hold {sum(counts)} patches but pixel_values has "
                          f"{None if pixels is None else pixels.shape[0]} rows")
    return list(pixels.split(counts))


def tokenized_sample(spec: MLLMSpec, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                     labels: torch.Tensor | None = None, sample_id=None, image_grid_thw: torch.Tensor | None = None,
                     pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                     second_per_grid_ts: list[float] | None = None,
                     tokens_per_second: float | None = None) -> TokenizedSample:
    """A `TokenizedSample` from what a Qwen-VL processor returns for one sample.

    Each run of the image (video) token is one image (video) of ``image_grid_thw``
    (``video_grid_thw``), in order; its patch rows are its share of ``pixel_values``
    (``pixel_values_videos``). Qwen3-VL writes a video one temporal group at a time: each group is a
    run and an item of grid ``(1, h, w)``. The rotary positions are `rope_index`'s; ``labels`` are
    transformers' (unshifted) and are shifted here.
    """
    pixels = {"image": pixel_values, "video": pixel_values_videos}
    grids = {"image": image_grid_thw, "video": video_grid_thw}
    segments, items = _items(spec, input_ids, pixels, grids, sample_id)
    tower = spec.encoders["vision"].native
    seconds = iter(second_per_grid_ts or [])
    rope_segments = [(s[0], s[1], next(seconds, 1.0)) if s[0] == "video" else s for s in segments]
    positions = rope_index(rope_segments, tower.merge_size, tower.family,
                           tokens_per_second=tokens_per_second or tower.tokens_per_second)
    shifted = torch.full_like(input_ids, IGNORE_INDEX)
    if labels is not None:
        shifted[:-1] = labels[1:]
    runs = [("text", v) if kind == "text" else ("item", item_tokens(v, tower.merge_size)) for kind, v in segments]
    return TokenizedSample(input_ids, shifted, runs, items, sample_id=sample_id, causal_items=True,
                           rope_positions=positions)
