"""Native-resolution vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, on harmonia's blocks.

Input is what the Qwen processor emits: ``pixel_values`` ``(N, C * tp * p * p)``, one row per patch
(``tp`` frames of ``p x p`` pixels), and ``grid_thw`` ``(n_items, 3)``, each item's patch grid
``(t, h, w)``. Items of any size, images (``t = 1``) and videos, are packed in one call. Within an
item the patches come frame by frame, and within a frame block-major: each ``m x m`` square of
patches (``m = spatial_merge_size``) is contiguous, since those ``m * m`` patches become one LLM token.

The tower, as transformers computes it (``Qwen2VisionTransformerPretrainedModel``,
``Qwen2_5_VisionTransformerPretrainedModel``, ``Qwen3VLVisionModel``)::

    x = patch_embed(pixels)                       # (N, h): a Conv3d over each (tp, p, p) patch
    x += interpolated learned position table      # Qwen3-VL only (`plan_pos_interpolation`)
    rope = 2D rotary tables of (row, col)         # (N, hd): hd/2 angles of the row, hd/2 of the col
    x = blocks(x)                                 # each frame of h * w patches is one sequence
    tokens = merger(x)                            # (N / m^2, out): m^2 patches -> one LLM token

Qwen2.5-VL attends within windows of ``window_size`` pixels in every block except
``fullatt_block_indexes``: the patches are reordered window by window first (`plan_windows`), every
block runs in that order (a frame's patches stay contiguous, so its full-attention sequence is still
one run), and the output is put back in processor order before the merger. Qwen3-VL's deepstack
mergers turn the outputs of blocks ``deepstack_visual_indexes`` into extra token sets.

Attention runs through `PackedAttention.sequences` over the frames or windows: no ``(N, N)`` mask.
The blocks are `harmonia.model.layers.Block` (separate q, k, v projections, so tensor parallelism and
LoRA apply as to any block); `harmonia.model.hf.qwen_vision` maps to transformers' ``model.visual``
names (fused ``attn.qkv``).

In an MLLM the tower is two modules, as for every encoder: `QwenVisionEncoder` (the blocks, split
into pipeline stages like any encoder; its last stage returns each ``m x m`` square of patches as one
row of ``m * m * h``; an inner stage sends on, beside its output, the outputs of the deepstack blocks
it and the stages before it ran, ``(N, h (1 + k))``, `QwenVisionSpec.carried_taps`) and the merger
as the encoder's projector (a `harmonia.model.projector.Projector` whose input norm normalises each
patch apart, ``ProjectorSpec.norm_groups``). `QwenVisionTower` is
the whole tower of transformers (merger and Qwen3-VL's deepstack mergers included), the reference the
tests compare against.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from harmonia.errors import SampleError
from harmonia.model.attention import PackedAttention
from harmonia.model.batch import MediaInputs
from harmonia.model.layers import build_blocks, init_weights, layer_range, rope_inv_freq
from harmonia.model.projector import Projector
from harmonia.model.qwen_spec import QwenVisionSpec, merger_spec


# -- plans: data from grid_thw alone ------------------------------------------------------------------------


def frame_lengths(grid: list[tuple[int, int, int]]) -> list[int]:
    """Patches of each attention sequence: every frame of every item, ``h * w`` each."""
    return [h * w for t, h, w in grid for _ in range(t)]


def _block_major(a: torch.Tensor, m: int) -> torch.Tensor:
    """``(h, w, *F)`` per-patch values -> ``(h * w, *F)`` in the processor's order (``m x m`` squares)."""
    h, w = a.shape[:2]
    a = a.reshape(h // m, m, w // m, m, *a.shape[2:]).transpose(1, 2)  # (h/m, w/m, m, m, *F)
    return a.reshape(h * w, *a.shape[4:])


def plan_positions(grid: list[tuple[int, int, int]], merge_size: int) -> torch.Tensor:
    """``(N, 2)`` (row, column) of every patch in processor order (each frame repeats its item's)."""
    out = []
    for t, h, w in grid:
        rc = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)  # (h, w, 2)
        out.append(_block_major(rc, merge_size).repeat(t, 1))  # (t * h * w, 2)
    return torch.cat(out)


def plan_windows(grid: list[tuple[int, int, int]], merge_size: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window order (transformers' ``get_vision_window_index``, at patch level).

    Each frame's grid of merged tokens is cut into ``window x window`` squares from the top left (the
    last row and column of squares may be smaller); windows follow item, frame, window row, window
    column; inside a window the merged tokens go row-major, each keeping its ``m * m`` patches.

    Returns:
        ``order``: ``(N,)`` the processor-order patch at each window-order position;
        ``lengths``: patches of each window, in window order.
    """
    unit = merge_size * merge_size
    order, lengths, offset = [], [], 0
    for t, h, w in grid:
        gh, gw = h // merge_size, w // merge_size  # merged-token grid of a frame
        n_rows, n_cols = -(-gh // window), -(-gw // window)  # windows down and across a frame
        f, r, c = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        key = ((f * n_rows + r // window) * n_cols + c // window).flatten()  # (t * gh * gw,) window of each
        order.append(torch.argsort(key, stable=True) + offset)  # merged tokens, window by window
        lengths += (torch.bincount(key) * unit).tolist()
        offset += t * gh * gw
    tokens = torch.cat(order)  # (N / unit,)
    return (tokens[:, None] * unit + torch.arange(unit)).flatten(), lengths  # (N,)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """2D rotary tables: ``(cos, sin)``, each ``(N, head_dim)`` float32, half-split layout.

    A head's first half holds ``head_dim / 4`` row angles then ``head_dim / 4`` column angles, with
    frequencies ``theta ** (-4k / head_dim)``; the second half repeats them (transformers'
    ``VisionRotaryEmbedding`` with ``apply_rotary_pos_emb_vision``, i.e. `apply_rope`).
    """
    inv_freq = rope_inv_freq(head_dim // 2, theta).to(positions.device, non_blocking=True)  # (hd/4,)
    freqs = (positions.float()[..., None] * inv_freq).flatten(1)  # (N, hd/2): rows' angles, then columns'
    emb = torch.cat((freqs, freqs), dim=-1)  # (N, hd)
    return emb.cos(), emb.sin()


def _taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps ``(n, 2)`` and weights ``(n, 2)`` resampling ``side`` table rows to ``n`` (corners aligned)."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)  # (n,)
    low = src.floor()
    frac = src - low
    taps = torch.stack((low, low + 1), dim=-1).long().clamp(max=side - 1)
    return taps, torch.stack((1 - frac, frac), dim=-1)


def plan_pos_interpolation(grid: list[tuple[int, int, int]], merge_size: int,
                           side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL's learned positions resampled to each grid: bilinear with aligned corners over the
    ``side x side`` table, as ``F.interpolate`` would (transformers'
    ``get_vision_interpolation_indices_and_weights``).

    Returns:
        ``(N, 4)`` table rows and ``(N, 4)`` weights of each patch, in processor order.
    """
    rows, weights = [], []
    for t, h, w in grid:
        (ri, rw), (ci, cw) = _taps(h, side), _taps(w, side)
        idx = (ri[:, None, :, None] * side + ci[None, :, None, :]).reshape(h, w, 4)  # (h, w, 4)
        wt = (rw[:, None, :, None] * cw[None, :, None, :]).reshape(h, w, 4)
        rows.append(_block_major(idx, merge_size).repeat(t, 1))  # (t * h * w, 4)
        weights.append(_block_major(wt, merge_size).repeat(t, 1))
    return torch.cat(rows), torch.cat(weights)


def read_grid(grid_thw: torch.Tensor, n_patches: int, spec: QwenVisionSpec) -> list[tuple[int, int, int]]:
    """``grid_thw`` as a list of ``(t, h, w)``, checked against the patches and the merge size.

    Read on the host: the grids are kept on the CPU (`harmonia.model.batch.MediaInputs.grid`), so
    the step reads nothing back from the device (a grid given on a device is read back here, a wait).

    Raises:
        SampleError: the grids do not hold ``n_patches`` patches, or a side is not a multiple of ``m``.
    """
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise SampleError(f"grid_thw must be (n_items, 3), got {tuple(grid_thw.shape)}")
    grid = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    m = spec.merge_size
    bad = [g for g in grid if min(g) <= 0 or g[1] % m or g[2] % m]
    if bad:
        raise SampleError(f"grid_thw rows {bad}: t, h, w must be positive and h, w multiples of merge_size={m}")
    total = sum(t * h * w for t, h, w in grid)
    if total != n_patches:
        raise SampleError(f"grid_thw holds {total} patches but pixel_values has {n_patches} rows")
    return grid


# -- the modules ----------------------------------------------------------------------------------------------


PLAN_CACHE_PATCHES = 1 << 17
"""Patches over the items' plans a tower keeps (each item's window order and rotary tables, by its
grid), the least recently used dropped first: a batch's plan is put together from its items' rather
than built patch by patch, so images of one size (resized to it, or one camera's) and videos of one
shape plan once. An item larger than this alone is not kept. The rotary tables are the bulk, ``2 * 4
* head_dim`` bytes per patch (80 MiB at the bound with ``head_dim`` 80); a batch's own plan (its
attention sequences) is built again each time, as the batch's tensors are."""


class StagePlan(NamedTuple):
    """What every stage derives from ``grid_thw`` alone: the attention sequences and the rotary tables."""

    frames: PackedAttention  # whole frames
    windows: PackedAttention | None  # Qwen2.5-VL's windows, in window order
    order: torch.Tensor | None  # (N,) the processor-order patch at each window-order position
    back: torch.Tensor | None  # (N,) the window-order position of each processor-order patch
    rope: tuple[torch.Tensor, torch.Tensor]  # (N, hd) cos and sin, in the blocks' order


class ItemPlan(NamedTuple):
    """One item's share of a `StagePlan` (its grid alone decides it)."""

    order: torch.Tensor | None  # (n,) the item's processor-order patch at each window-order position
    windows: list[int]  # patches of each of its windows, in window order (none without windows)
    rope: tuple[torch.Tensor, torch.Tensor]  # (n, hd) cos and sin, in the blocks' order


class PatchCache:
    """Values by key, each counted as some patches; past ``budget`` patches in all, the least
    recently used are dropped (the newest too, when it alone exceeds the budget)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._values: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self._patches = 0

    def get(self, key: tuple, patches: int, build: Callable[[], object]):
        """The value of ``key``, built by ``build()`` when not kept."""
        kept = self._values.get(key)
        if kept is not None:
            self._values.move_to_end(key)
            return kept[0]
        value = build()
        self._values[key] = (value, patches)
        self._patches += patches
        while self._patches > self.budget:
            _, (_, n) = self._values.popitem(last=False)
            self._patches -= n
        return value

    def __len__(self) -> int:
        return len(self._values)


class QwenVisionEncoder(nn.Module):
    """Blocks ``[a, b)`` of a Qwen-VL tower over packed patches of any number of images and videos.

    The first stage owns the patch embedding (and Qwen3-VL's learned positions); inner stages pass
    ``(N, h)`` in the blocks' order (window order under Qwen2.5-VL's windows); the last stage returns
    the patches in processor order, each ``m x m`` square as one row: ``(N / m^2, m^2 h)``.

    Args:
        spec: the tower's architecture.
        layers: ``(a, b)`` global block range of this stage; None = all blocks.
        attention: the `PackedAttention` kernel (`harmonia.model.attention_backend.BACKENDS`); ``auto`` =
            ``segments`` on CPU, FlashAttention's varlen kernel on CUDA (bf16 / fp16).
    """

    def __init__(self, spec: QwenVisionSpec, layers: tuple[int, int] | None = None, attention: str = "auto") -> None:
        super().__init__()
        body = spec.body
        self.spec = spec
        self.attention = attention
        self.indices = layer_range(body.n_layers, layers, f"{spec.family} vision tower")
        self.is_first = self.indices.start == 0
        self.is_last = self.indices.stop == body.n_layers
        self.patch_embed = self.pos_embed = None
        if self.is_first:
            kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
            self.patch_embed = nn.Conv3d(spec.in_channels, body.hidden, kernel, kernel, bias=spec.family == "qwen3_vl")
            if spec.num_position_embeddings is not None:
                self.pos_embed = nn.Embedding(spec.num_position_embeddings, body.hidden)
        self.layers = build_blocks(body, self.indices)
        self._item_plans = PatchCache(PLAN_CACHE_PATCHES)  # (item's grid, device) -> ItemPlan
        init_weights(self)

    def hidden_shape(self, media: MediaInputs, block: int) -> tuple[int, int]:
        """``(N, h (1 + k))``: what crosses between stages before global block ``block`` for the
        ``N`` patches of a (sub-)microbatch's item grids (the hidden state and the ``k`` deepstack
        outputs tapped before it); from the grids alone (a later stage's media hold no pixels)."""
        n = int(media.grid.prod(-1).sum())
        return n, self.spec.body.hidden * (1 + len(self.spec.carried_taps(block)))

    def forward(self, x: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Pixels ``(N, C * tp * p * p)`` on the first stage, ``(N, h)`` otherwise; ``grid_thw``
        ``(n_items, 3)`` on every stage.

        Returns:
            ``(N, h)`` in the blocks' order on inner stages; ``(N / m^2, m^2 h)`` on the last, with
            Qwen3-VL's DeepStack blocks' outputs after it, ``(N / m^2, m^2 h (1 + k))``.
        """
        x, plan = self._enter(x, grid_thw)
        x, carried = self._unpack(x)
        x, tapped = self._blocks(x[None], plan)
        tapped = {**carried, **tapped}  # (N, h) each, in the blocks' order
        if not self.is_last:  # the deepstack outputs so far travel with the hidden state
            return torch.cat([x[0], *(tapped[i] for i in sorted(tapped))], dim=-1)  # (N, h (1 + k))
        out = self._leave(x[0], plan)
        if not tapped:
            return out
        return torch.cat([out, *(self._leave(tapped[i], plan) for i in self.spec.deepstack_layers)], dim=-1)

    def _unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """An inner stage's input: the previous stage's output, and the deepstack outputs it carries."""
        if self.is_first:
            return x, {}
        h, carried = self.spec.body.hidden, self.spec.carried_taps(self.indices.start)
        if x.dim() != 2 or x.shape[1] != h * (1 + len(carried)):
            raise SampleError(f"{self.spec.family} vision stage from block {self.indices.start}: got "
                              f"{tuple(x.shape)}, expected (N, {h * (1 + len(carried))}): hidden {h} plus "
                              f"{len(carried)} carried deepstack outputs")
        parts = x.split(h, dim=-1)
        return parts[0], dict(zip(carried, parts[1:]))

    def _enter(self, x: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, StagePlan]:
        """The stage's plan, and its input in the blocks' order (embedded on the first stage)."""
        spec = self.spec
        if self.is_first and (x.dim() != 2 or x.shape[1] != spec.patch_dim):
            raise SampleError(f"pixel_values must be (N, {spec.patch_dim}) patches, got {tuple(x.shape)}")
        grid = read_grid(grid_thw, x.shape[0], spec)
        plan = self.plan(grid, x.device)
        if self.is_first:
            x = self.embed(x, grid)
            if plan.order is not None:
                x = x[plan.order]  # window order
        return x, plan

    def _leave(self, x: torch.Tensor, plan: StagePlan) -> torch.Tensor:
        if not self.is_last:
            return x
        if plan.back is not None:
            x = x[plan.back]  # processor order
        return x.reshape(-1, self.spec.merge_size ** 2 * x.shape[-1])  # (N/m^2, m^2 h)

    def plan(self, grid: list[tuple[int, int, int]], device: torch.device) -> StagePlan:
        """Attention sequences and rotary tables of the grids (the same on every stage), from the
        items' plans (each the same whatever the batch; kept: `PLAN_CACHE_PATCHES`)."""
        spec, head_dim = self.spec, self.spec.body.dim_head
        items = [self._item_plans.get((g, str(device)), g[0] * g[1] * g[2], lambda g=g: self._item_plan(g, device))
                 for g in grid]
        rope = tuple(torch.cat(tables) for tables in zip(*(p.rope for p in items)))  # (N, hd) each
        frames = PackedAttention.sequences(frame_lengths(grid), self.attention, device, head_dim).for_window(None)
        if spec.window_size is None:
            return StagePlan(frames, None, None, None, rope)
        offsets = itertools.accumulate((t * h * w for t, h, w in grid[:-1]), initial=0)
        order = torch.cat([p.order + at for p, at in zip(items, offsets)])  # (N,)
        lengths = [n for p in items for n in p.windows]
        windows = PackedAttention.sequences(lengths, self.attention, device, head_dim).for_window(None)
        return StagePlan(frames, windows, order, torch.argsort(order), rope)

    def _item_plan(self, item: tuple[int, int, int], device: torch.device) -> ItemPlan:
        spec = self.spec
        positions = plan_positions([item], spec.merge_size).to(device, non_blocking=True)  # (n, 2)
        order, lengths = None, []
        if spec.window_size is not None:
            order, lengths = plan_windows([item], spec.merge_size, spec.window_tokens)
            order = order.to(device, non_blocking=True)
            positions = positions[order]
        return ItemPlan(order, lengths, rope_tables(positions, spec.body.dim_head, spec.rope_theta))

    def embed(self, pixels: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """``(N, C * tp * p * p)`` patches -> ``(N, h)``, Qwen3-VL's learned positions added."""
        spec = self.spec
        w = self.patch_embed.weight
        x = pixels.to(w.dtype).view(-1, spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        x = self.patch_embed(x).view(-1, spec.body.hidden)  # (N, h)
        if self.pos_embed is not None:
            rows, weights = plan_pos_interpolation(grid, spec.merge_size, math.isqrt(self.pos_embed.num_embeddings))
            rows, weights = rows.to(x.device, non_blocking=True), weights.to(x.device, non_blocking=True)
            table = self.pos_embed(rows) * weights[..., None]  # (N, 4, h)
            x = x + table.sum(1).to(x.dtype)
        return x

    def _blocks(self, x: torch.Tensor, plan: StagePlan) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the stage's blocks on ``(1, N, h)``: window blocks on the windows, the others on whole
        frames. Returns the output and the outputs of Qwen3-VL's deepstack blocks, ``(N, h)`` each."""
        full, taps = self.spec.full_attention_layers, self.spec.deepstack_layers
        tapped = {}
        for i, block in self.layers.items():
            x = block(x, plan.windows if plan.windows is not None and int(i) not in full else plan.frames, plan.rope)
            if int(i) in taps:
                tapped[int(i)] = x[0]
        return x, tapped


class QwenVisionOutput(NamedTuple):
    """What the tower returns: the LLM tokens, and Qwen3-VL's deepstack tokens (one per deepstack block)."""

    tokens: torch.Tensor  # (N / m^2, out)
    deepstack: tuple[torch.Tensor, ...]  # each (N / m^2, out), in block order


class QwenVisionTower(QwenVisionEncoder):
    """A whole Qwen-VL vision tower as transformers has it: the blocks, the merger and Qwen3-VL's
    deepstack mergers (`QwenVisionEncoder` with the projector it feeds in an MLLM)."""

    def __init__(self, spec: QwenVisionSpec, attention: str = "auto") -> None:
        super().__init__(spec, None, attention)
        self.merger = Projector(merger_spec(spec))
        self.deepstack = nn.ModuleList(Projector(merger_spec(spec, f"deepstack{i}", deepstack=True))
                                       for i in range(len(spec.deepstack_layers)))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> QwenVisionOutput:
        """``(N, C * tp * p * p)`` patches and ``(n_items, 3)`` grids -> the items' LLM tokens, in order."""
        x, plan = self._enter(pixel_values, grid_thw)
        x, tapped = self._blocks(x[None], plan)
        deepstack = tuple(merge(self._leave(tapped[i], plan)) for i, merge in zip(self.spec.deepstack_layers,
                                                                                     self.deepstack))
        return QwenVisionOutput(self.merger(self._leave(x[0], plan)), deepstack)


def build_qwen_vision_tower(spec: QwenVisionSpec, attention: str = "auto") -> QwenVisionTower:
    """A whole Qwen-VL vision tower (random weights; load a checkpoint with
    `harmonia.model.hf.qwen_vision.state_from_hf`)."""
    return QwenVisionTower(spec, attention)


def build_qwen_vision_encoder(spec: QwenVisionSpec, layers: tuple[int, int] | None = None) -> QwenVisionEncoder:
    """A Qwen-VL tower's blocks as an MLLM encoder, or the stage holding blocks ``[a, b)`` of it."""
    return QwenVisionEncoder(spec, layers)
