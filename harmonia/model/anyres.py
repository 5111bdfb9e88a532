"""LLaVA-NeXT "anyres" images: tiles, LLM token counts and the order of an image's LLM tokens.

An image of ``(height, width)`` pixels is fitted into the ``grid_pinpoints`` resolution that keeps
the most of its pixels (transformers' ``select_best_resolution``), resized and padded to it and cut
into ``rows x cols`` tiles of ``image_size``; a base tile of the whole image comes first. Each tile
gives ``side x side`` features (``side = image_size // patch_size``). transformers' LLaVA-NeXT
(``pack_image_features``) then lays the grid tiles' features out as one ``(rows * side, cols * side)``
map, crops the padding back off (``unpad_image``: to the image's aspect ratio, evenly from both
sides), ends every remaining row with the ``image_newline`` vector and puts the base tile's features
first::

    tokens = side**2  +  kept_rows * kept_cols  +  kept_rows

which is LlavaNextProcessor's ``_get_number_of_features`` (less the class token under the
``default`` strategy). `anyres_order` writes the same layout as an index, so the projector stage
gathers an image's LLM tokens from its tiles' projected features (`harmonia.model.projector`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from harmonia.model.spec import EncoderSpec

NEWLINE = -1
"""`anyres_order`'s index of the projector's ``image_newline``."""


@lru_cache(maxsize=4096)
def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The ``(height, width)`` pinpoint an image is fitted into (transformers' ``select_best_resolution``)."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(select_best_resolution((height, width), [list(p) for p in pinpoints]))


def pinpoint_grid(height: int, width: int, pinpoints: tuple[tuple[int, int], ...], tile: int) -> tuple[int, int]:
    """``(rows, cols)`` of ``tile``-pixel grid tiles of an image fitted into its best pinpoint."""
    h, w = best_resolution(height, width, pinpoints)
    return h // tile, w // tile


def anyres_grid(height: int, width: int, encoder: EncoderSpec) -> tuple[int, int]:
    """``(rows, cols)`` of grid tiles of an image (the base tile not counted)."""
    return pinpoint_grid(height, width, encoder.grid_pinpoints, encoder.image_size)


def kept_features(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of the feature map ``(rows, cols)`` kept for an image of
    ``(height, width)`` pixels: transformers' ``unpad_image`` (the padding of the fitted image, cropped
    evenly from both sides of the padded dimension)."""
    if width / height > cols / rows:
        new = int(round(height * (cols / width), 7))
        pad = (rows - new) // 2
        return pad, rows - pad, 0, cols
    new = int(round(width * (rows / height), 7))
    pad = (cols - new) // 2
    return 0, rows, pad, cols - pad


def anyres_tiles(height: int, width: int, encoder: EncoderSpec) -> int:
    """Tiles of an image: the base tile and the grid's."""
    rows, cols = anyres_grid(height, width, encoder)
    return 1 + rows * cols


def _side(encoder: EncoderSpec) -> int:
    return encoder.image_size // encoder.patch_size


def anyres_tokens(height: int, width: int, encoder: EncoderSpec) -> int:
    """LLM tokens of an image: base tile, the grid's kept features, one newline per kept row."""
    rows, cols = anyres_grid(height, width, encoder)
    side = _side(encoder)
    top, bottom, left, right = kept_features(height, width, rows * side, cols * side)
    return side * side + (bottom - top) * (right - left + 1)


def unsized_grid(tiles: int, encoder: EncoderSpec) -> tuple[int, int]:
    """``(rows, cols)`` of ``tiles - 1`` grid tiles when only the tile count is known (a trace without
    image sizes): the tallest pinpoint grid of that many tiles, else a column of them."""
    grids = sorted((h // encoder.image_size, w // encoder.image_size) for h, w in encoder.grid_pinpoints)
    fits = [(r, c) for r, c in grids if r * c == tiles - 1]
    return fits[-1] if fits else (tiles - 1, 1)


def unsized_tokens(tiles: int, encoder: EncoderSpec) -> int:
    """LLM tokens of an image known only by its tile count: the most any image of ``tiles`` tiles gives
    (its grid of `unsized_grid` filled, nothing cropped). One tile is the base tile and one newline, as
    transformers packs a single tile."""
    side = _side(encoder)
    if tiles == 1:
        return side * side + 1
    rows, cols = unsized_grid(tiles, encoder)
    return side * side + rows * side * (cols * side + 1)


def anyres_order(height: int, width: int, encoder: EncoderSpec) -> torch.Tensor:
    """The LLM tokens of an image as the tile features they are (`harmonia.model.batch.ItemInputs.order`).

    Returns:
        ``(anyres_tokens, 2)`` long: token ``k`` is feature ``order[k, 1]`` (row by row within its tile)
        of tile ``order[k, 0]`` (the base tile 0, then the grid row by row), or ``(-1, 0)``, the
        projector's ``image_newline``.
    """
    import torch  # (the planner prices anyres items without torch)

    rows, cols = anyres_grid(height, width, encoder)
    side = _side(encoder)
    top, bottom, left, right = kept_features(height, width, rows * side, cols * side)
    y = torch.arange(top, bottom)[:, None]  # (kept_rows, 1) feature row on the grid map
    x = torch.arange(left, right)[None, :]  # (1, kept_cols)
    tile = 1 + (y // side) * cols + x // side  # (kept_rows, kept_cols)
    feature = (y % side) * side + x % side  # (kept_rows, kept_cols)
    grid = torch.stack(torch.broadcast_tensors(tile, feature), dim=-1)  # (kept_rows, kept_cols, 2)
    newline = torch.tensor([NEWLINE, 0]).expand(grid.shape[0], 1, 2)
    base = torch.stack([torch.zeros(side * side, dtype=torch.long), torch.arange(side * side)], dim=1)
    return torch.cat([base, torch.cat([grid, newline], dim=1).flatten(0, 1)])
