"""LLaVA and LLaVA-NeXT samples from what their processors return (`tokenized_sample`), apart from
the family's spec (`harmonia.model.families.llava`) so that reading a spec imports no torch."""

from __future__ import annotations

import torch

from harmonia.errors import ConfigError, SampleError
from harmonia.model.anyres import anyres_order, anyres_tiles, anyres_tokens
from harmonia.model.batch import ItemInputs, TokenizedSample
from harmonia.model.llm import IGNORE_INDEX
from harmonia.model.spec import MLLMSpec


def _image_items(spec: MLLMSpec, pixel_values, image_sizes, sample_id) -> tuple[list[ItemInputs], list[int]]:
    """One `ItemInputs` per image and its LLM token count (LLaVA: one tile; LLaVA-NeXT: its anyres tiles)."""
    module = spec.encoder_for("image")
    enc = spec.encoders[module]
    if not enc.grid_pinpoints:
        if image_sizes is not None:
            raise ConfigError(f"MLLM {spec.name!r} takes one tile per image; image_sizes are for LLaVA-NeXT")
        return [ItemInputs(module, pixel_values[i: i + 1]) for i in range(pixel_values.shape[0])], \
            [enc.llm_tokens_per_tile()] * pixel_values.shape[0]
    if image_sizes is None or len(image_sizes) != len(pixel_values):
        raise SampleError(f"sample {sample_id}: LLaVA-NeXT needs image_sizes, one (height, width) per image of "
                          f"pixel_values, as its processor returns them")
    items, counts = [], []
    for tiles, (height, width) in zip(pixel_values, [tuple(int(v) for v in s) for s in image_sizes]):
        n = anyres_tiles(height, width, enc)
        if tiles.shape[0] < n:
            raise SampleError(f"sample {sample_id}: an image of {height}x{width} has {n} anyres tiles but "
                              f"pixel_values holds {tiles.shape[0]}")
        items.append(ItemInputs(module, tiles[:n], order=anyres_order(height, width, enc)))
        counts.append(anyres_tokens(height, width, enc))
    return items, counts


def _segments(is_image: list[bool], counts: list[int], sample_id) -> list[tuple[str, int]]:
    """Text runs and one item run per image of ``counts[k]`` image tokens, in order."""
    segments: list[tuple[str, int]] = []
    t, k = 0, 0
    while t < len(is_image):
        if not is_image[t]:
            start = t
            while t < len(is_image) and not is_image[t]:
                t += 1
            segments.append(("text", t - start))
            continue
        if k == len(counts) or is_image[t: t + counts[k]] != [True] * counts[k]:
            break
        segments.append(("item", counts[k]))
        t, k = t + counts[k], k + 1
    if t < len(is_image) or k != len(counts):
        raise SampleError(f"sample {sample_id}: {sum(is_image)} image tokens for {len(counts)} images of {counts} "
                          "tokens each; expand each image to its count of placeholder tokens, in order")
    return segments


def tokenized_sample(spec: MLLMSpec, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                     labels: torch.Tensor | None = None, sample_id=None,
                     image_sizes: torch.Tensor | None = None) -> TokenizedSample:
    """A `TokenizedSample` from what a LLaVA or LLaVA-NeXT processor returns for one sample.

    Runs of the image token become item segments, one per image of ``pixel_values``: of
    `EncoderSpec.llm_tokens_per_tile` tokens (LLaVA), or of the image's anyres count with its token
    order (LLaVA-NeXT). ``labels`` are transformers' (unshifted: the model shifts them); harmonia's
    are aligned with the logits, so they are shifted here.

    Args:
        spec: a LLaVA spec (``item_token_ids["image"]``).
        input_ids: ``(T,)`` with the image token repeated at each image's positions.
        pixel_values: ``(n_images, C, H, W)`` (LLaVA), or ``(n_images, max_tiles, C, H, W)`` padded
            tiles (LLaVA-NeXT; each image's first tiles are read).
        labels: ``(T,)`` transformers-style targets, or None for no loss.
        sample_id: carried for messages.
        image_sizes: ``(n_images, 2)`` original ``(height, width)`` (LLaVA-NeXT only).
    """
    token = spec.item_token_ids.get("image")
    if token is None:
        raise ConfigError(f"MLLM {spec.name!r} names no image placeholder token (item_token_ids)")
    items, counts = _image_items(spec, pixel_values, image_sizes, sample_id)
    segments = _segments((input_ids == token).tolist(), counts, sample_id)
    shifted = torch.full_like(input_ids, IGNORE_INDEX)
    if labels is not None:
        shifted[:-1] = labels[1:]
    return TokenizedSample(input_ids, shifted, segments, items, sample_id=sample_id,
                           causal_items=spec.item_attention == "causal")
