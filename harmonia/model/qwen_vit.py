"""Native-resolution vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, on harmonia's blocks.

Input is what the Qwen processor emits: ``pixel_values`` ``(N, C * tp * p * p)``, one row per patch
(``tp`` frames of ``p x p`` pixels), and ``grid_thw`` ``(n_items, 3)``, each item's patch grid
``(t, h, w)``. Items of any size, images (``t = 1``) and videos, are packed in one call. Within an
item the patches come frame by frame, and within a frame block-major: each ``m x m`` square of
patches (``m = spatial_merge_size``) is contiguous, since those ``m * m`` patches become one LLM token.

The tower, as transformers computes it (``Qwen2VisionTransformerPretrainedModel``,
``Qwen2_5_VisionTransformerPretrainedModel``, ``Qwen3VLVisionModel``)::

    x = patch_embed(pixels)                       # (N, h): a linear map of each flattened patch
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
LoRA apply as to any block); `hf_key`, `state_from_hf` and `state_to_hf` map to transformers'
``model.visual`` names (fused ``attn.qkv``, a Conv3d patch embedding).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from harmonia.errors import ConfigError, SampleError
from harmonia.model.attention import PackedAttention
from harmonia.model.hf.io import Table, rename
from harmonia.model.layers import build_blocks, build_norm, init_weights, rope_inv_freq
from harmonia.model.spec import TransformerSpec

Family = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
NORM_EPS = 1e-6  # every norm of the three towers

# -- the spec and its config reader ---------------------------------------------------------------------


@dataclass(frozen=True)
class QwenVisionSpec:
    """A Qwen-VL vision tower.

    Attributes:
        family: ``qwen2_vl`` (LayerNorm, GELU-type MLP), ``qwen2_5_vl`` (RMSNorm, SwiGLU, windows)
            or ``qwen3_vl`` (LayerNorm, GELU-type MLP, learned positions, deepstack).
        body: the blocks (width ``h``, heads, MLP, norms).
        out_dim: width of the LLM tokens the merger emits.
        in_channels: colour channels ``C`` of a patch.
        patch_size: patch side ``p`` in pixels.
        temporal_patch_size: frames ``tp`` in one patch.
        merge_size: ``m``: each ``m x m`` square of patches becomes one LLM token.
        rope_theta: base of the 2D rotary embedding.
        window_size: Qwen2.5-VL's attention window side in pixels (windows of
            ``window_size // m // p`` merged tokens square); None = every block attends whole frames.
        full_attention_layers: with windows, the blocks that attend whole frames.
        num_position_embeddings: Qwen3-VL's learned position table (a square grid); None = none.
        deepstack_layers: Qwen3-VL's blocks whose outputs a deepstack merger turns into tokens.
    """

    family: Family
    body: TransformerSpec
    out_dim: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    rope_theta: float = 10000.0
    window_size: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    num_position_embeddings: int | None = None
    deepstack_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_attention_layers", tuple(self.full_attention_layers))
        object.__setattr__(self, "deepstack_layers", tuple(self.deepstack_layers))
        if self.family not in FAMILIES:
            raise ConfigError(f"QwenVisionSpec: family={self.family!r} is not one of {FAMILIES}")
        for name in ("out_dim", "in_channels", "patch_size", "temporal_patch_size", "merge_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"QwenVisionSpec: {name}={getattr(self, name)!r} must be a positive integer")
        if self.body.dim_head % 4:
            raise ConfigError(f"QwenVisionSpec: head width {self.body.dim_head} must be a multiple of 4 (the 2D "
                              "rotary embedding gives a quarter of it to each of rows and columns, twice)")
        self._check_windows()
        self._check_learned_positions()

    def _check_windows(self) -> None:
        """Qwen2.5-VL, and only it, has windows of at least one merged token."""
        if (self.window_size is not None) != (self.family == "qwen2_5_vl"):
            raise ConfigError(f"QwenVisionSpec: window_size={self.window_size} is for qwen2_5_vl only, "
                              "and needed there")
        if self.window_size is not None and self.window_tokens < 1:
            raise ConfigError(f"QwenVisionSpec: window_size={self.window_size} pixels must be at least "
                              f"merge_size * patch_size = {self.merge_size * self.patch_size}")
        _check_layers("full_attention_layers", self.full_attention_layers, self.body.n_layers,
                      self.window_size is not None)

    def _check_learned_positions(self) -> None:
        """Qwen3-VL, and only it, has a square learned position table and deepstack mergers."""
        n = self.num_position_embeddings
        if (n is not None) != (self.family == "qwen3_vl"):
            raise ConfigError(f"QwenVisionSpec: num_position_embeddings={n} is for qwen3_vl only, and needed there")
        if n is not None and math.isqrt(n) ** 2 != n:
            raise ConfigError(f"QwenVisionSpec: num_position_embeddings={n} must be a perfect square (a square "
                              "grid of learned positions)")
        _check_layers("deepstack_layers", self.deepstack_layers, self.body.n_layers, self.family == "qwen3_vl")

    @property
    def patch_dim(self) -> int:
        """Values in one patch row of ``pixel_values``: ``C * tp * p * p``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_tokens(self) -> int:
        """Side of an attention window in merged tokens (transformers floors, so do we)."""
        return (self.window_size or 0) // self.merge_size // self.patch_size


def _check_layers(name: str, layers: tuple[int, ...], n_layers: int, allowed: bool) -> None:
    if layers and not allowed:
        raise ConfigError(f"QwenVisionSpec: {name}={list(layers)} does not apply to this family")
    if any(not 0 <= i < n_layers for i in layers) or list(layers) != sorted(set(layers)):
        raise ConfigError(f"QwenVisionSpec: {name}={list(layers)} must be increasing block indices in "
                          f"0..{n_layers - 1}")


MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl", "qwen2_vl_vision": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl", "qwen2_5_vl_vision": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl", "qwen3_vl_vision": "qwen3_vl",
}
ACTS = {  # transformers' hidden_act -> the block MLP it runs
    "qwen2_vl": {"quick_gelu": "quick", "gelu": "none", "gelu_pytorch_tanh": "tanh"},
    "qwen2_5_vl": {"silu": "swiglu"},
    "qwen3_vl": {"gelu_pytorch_tanh": "tanh", "gelu": "none", "quick_gelu": "quick"},
}
DEFAULTS = {  # transformers' config class defaults, for fields a config.json leaves out
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu", mlp_ratio=4,
                     num_heads=16, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31)),
    "qwen3_vl": dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                     num_heads=16, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                     num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24)),
}


def spec_from_hf(config: dict, family: Family | None = None) -> QwenVisionSpec:
    """A `QwenVisionSpec` from a transformers config dict: a whole Qwen-VL ``config.json`` (its
    ``vision_config`` is read) or the vision config alone (``Qwen2VLVisionConfig.to_dict()``, ...).

    Args:
        config: the config dict; fields it leaves out take transformers' defaults.
        family: one of `FAMILIES`; None = from ``model_type``.

    Raises:
        ConfigError: naming the field whose value this module does not implement.
    """
    vc = config.get("vision_config", config)
    if family is None:
        kind = config.get("model_type") if "vision_config" in config else vc.get("model_type")
        if kind not in MODEL_TYPES:
            raise ConfigError(f"model_type={kind!r} is not a Qwen-VL vision tower (one of {sorted(MODEL_TYPES)}); "
                              "pass family= for a config without model_type")
        family = MODEL_TYPES[kind]
    if family not in FAMILIES:
        raise ConfigError(f"family={family!r} is not one of {FAMILIES}")
    vc = {**DEFAULTS[family], **{k: v for k, v in vc.items() if v is not None}}
    return QwenVisionSpec(
        family=family, body=_body_from_hf(vc, family),
        out_dim=vc["hidden_size"] if family == "qwen2_vl" else vc["out_hidden_size"],
        in_channels=vc.get("in_channels", vc.get("in_chans", 3)),
        patch_size=_int_field(vc, "patch_size"), temporal_patch_size=_int_field(vc, "temporal_patch_size"),
        merge_size=_int_field(vc, "spatial_merge_size"), rope_theta=_rope_theta(vc),
        window_size=vc.get("window_size") if family == "qwen2_5_vl" else None,
        full_attention_layers=_layer_list(vc, "fullatt_block_indexes") if family == "qwen2_5_vl" else (),
        num_position_embeddings=vc.get("num_position_embeddings") if family == "qwen3_vl" else None,
        deepstack_layers=_layer_list(vc, "deepstack_visual_indexes") if family == "qwen3_vl" else (),
    )


def _body_from_hf(vc: dict, family: Family) -> TransformerSpec:
    """The blocks' `TransformerSpec` (Qwen2-VL's width is ``embed_dim``, its MLP ``mlp_ratio`` times it)."""
    act = vc["hidden_act"]
    if act not in ACTS[family]:
        raise ConfigError(f"{family} vision config: hidden_act={act!r} is not implemented; use one of "
                          f"{sorted(ACTS[family])}")
    width = vc["embed_dim"] if family == "qwen2_vl" else vc["hidden_size"]
    ffn = int(width * vc["mlp_ratio"]) if family == "qwen2_vl" else vc["intermediate_size"]
    heads = vc["num_heads"]
    if width % heads or vc.get("head_dim", width // heads) != width // heads:
        raise ConfigError(f"{family} vision config: num_heads={heads} must divide the width {width} "
                          f"(head_dim={vc.get('head_dim')} must be width // num_heads when given)")
    kind = ACTS[family][act]
    return TransformerSpec(
        vc["depth"], width, heads, ffn, mlp="swiglu" if kind == "swiglu" else "gelu",
        norm="rmsnorm" if family == "qwen2_5_vl" else "layernorm", norm_eps=NORM_EPS,
        gelu_approximate="none" if kind == "swiglu" else kind,
    )


def _int_field(vc: dict, name: str) -> int:
    if not isinstance(vc[name], int):
        raise ConfigError(f"Qwen-VL vision config: {name}={vc[name]!r} is not implemented; it must be one integer")
    return vc[name]


def _layer_list(vc: dict, name: str) -> tuple[int, ...]:
    layers = tuple(vc[name])
    if any(not 0 <= i < vc["depth"] for i in layers) or list(layers) != sorted(set(layers)):
        raise ConfigError(f"Qwen-VL vision config: {name}={list(layers)} is not implemented; give increasing "
                          f"block indices in 0..{vc['depth'] - 1} (depth={vc['depth']})")
    return layers


def _rope_theta(vc: dict) -> float:
    rope = vc.get("rope_parameters") or {}
    kind = rope.get("rope_type", "axial")
    if kind != "axial":
        raise ConfigError(f"Qwen-VL vision config: rope_parameters.rope_type={kind!r} is not implemented; "
                          "the vision towers use 'axial'")
    return float(rope.get("rope_theta", 10000.0))


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
    inv_freq = rope_inv_freq(head_dim // 2, theta).to(positions.device)  # (hd/4,)
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


class PatchMerger(nn.Module):
    """``m * m`` neighbouring patches -> one LLM token: norm, concatenate, ``Linear-GELU-Linear``.

    ``post_shuffle`` norms the concatenated ``m * m * h`` vector (Qwen3-VL's deepstack mergers)
    instead of each patch.
    """

    def __init__(self, hidden: int, merge_size: int, out_dim: int, norm: str, post_shuffle: bool = False) -> None:
        super().__init__()
        self.width = hidden * merge_size ** 2
        self.post_shuffle = post_shuffle
        self.norm = build_norm(norm, self.width if post_shuffle else hidden, NORM_EPS)
        self.linears = nn.ModuleList([nn.Linear(self.width, self.width), nn.Linear(self.width, out_dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, h)`` patches in processor order -> ``(N / m^2, out)``."""
        if self.post_shuffle:
            x = self.norm(x.reshape(-1, self.width))  # (N/m^2, m^2 h)
        else:
            x = self.norm(x).reshape(-1, self.width)  # (N/m^2, m^2 h)
        return self.linears[1](F.gelu(self.linears[0](x)))


class QwenVisionOutput(NamedTuple):
    """What the tower returns: the LLM tokens, and Qwen3-VL's deepstack tokens (one per deepstack block)."""

    tokens: torch.Tensor  # (N / m^2, out)
    deepstack: tuple[torch.Tensor, ...]  # each (N / m^2, out), in block order


class QwenVisionTower(nn.Module):
    """A Qwen-VL vision tower over packed patches of any number of images and videos.

    Args:
        spec: the architecture (`spec_from_hf` reads it from a transformers config).
        attention: the `PackedAttention` kernel (`harmonia.model.attention.BACKENDS`); ``auto`` =
            ``segments`` on CPU, FlashAttention's varlen kernel on CUDA (bf16 / fp16).
    """

    def __init__(self, spec: QwenVisionSpec, attention: str = "auto") -> None:
        super().__init__()
        body = spec.body
        self.spec = spec
        self.attention = attention
        self.patch_embed = nn.Linear(spec.patch_dim, body.hidden, bias=spec.family == "qwen3_vl")
        self.pos_embed = None
        if spec.num_position_embeddings is not None:
            self.pos_embed = nn.Embedding(spec.num_position_embeddings, body.hidden)
        self.layers = build_blocks(body, range(body.n_layers))
        norm = "rmsnorm" if spec.family == "qwen2_5_vl" else "layernorm"
        self.merger = PatchMerger(body.hidden, spec.merge_size, spec.out_dim, norm)
        self.deepstack = nn.ModuleList(
            PatchMerger(body.hidden, spec.merge_size, spec.out_dim, norm, post_shuffle=True)
            for _ in spec.deepstack_layers)
        init_weights(self)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> QwenVisionOutput:
        """``(N, C * tp * p * p)`` patches and ``(n_items, 3)`` grids -> the items' LLM tokens, in order."""
        spec = self.spec
        if pixel_values.dim() != 2 or pixel_values.shape[1] != spec.patch_dim:
            raise SampleError(f"pixel_values must be (N, {spec.patch_dim}) patches, got {tuple(pixel_values.shape)}")
        grid = read_grid(grid_thw, pixel_values.shape[0], spec)
        device = pixel_values.device
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))  # (N, h)
        if self.pos_embed is not None:
            x = x + self._positions_learned(grid, device).to(x.dtype)
        positions = plan_positions(grid, spec.merge_size).to(device)  # (N, 2)
        frames = PackedAttention.sequences(frame_lengths(grid), self.attention, device).for_window(None)
        windows = order = None
        if spec.window_size is not None:
            order, lengths = plan_windows(grid, spec.merge_size, spec.window_tokens)
            order = order.to(device)
            windows = PackedAttention.sequences(lengths, self.attention, device).for_window(None)
            x, positions = x[order], positions[order]  # window order
        rope = rope_tables(positions, spec.body.dim_head, spec.rope_theta)  # (N, hd) each
        x, deepstack = self._blocks(x[None], frames, windows, rope)
        x = x[0]  # (N, h)
        if order is not None:
            x = x[torch.argsort(order)]  # processor order
        return QwenVisionOutput(self.merger(x), deepstack)

    def _positions_learned(self, grid: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """``(N, h)`` Qwen3-VL's learned positions, resampled to each grid."""
        rows, weights = plan_pos_interpolation(grid, self.spec.merge_size, math.isqrt(self.pos_embed.num_embeddings))
        return (self.pos_embed(rows.to(device)) * weights.to(device)[..., None]).sum(1)  # (N, 4, h) -> (N, h)

    def _blocks(self, x: torch.Tensor, frames, windows, rope) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Run every block on ``(1, N, h)``: window blocks on ``windows``, the others on ``frames``."""
        full, taps = self.spec.full_attention_layers, self.spec.deepstack_layers
        deepstack = []
        for i, block in self.layers.items():
            x = block(x, windows if windows is not None and int(i) not in full else frames, rope)
            if int(i) in taps:
                deepstack.append(self.deepstack[taps.index(int(i))](x[0]))  # (N/m^2, out)
        return x, tuple(deepstack)


def build_qwen_vision_tower(spec: QwenVisionSpec, attention: str = "auto") -> QwenVisionTower:
    """A Qwen-VL vision tower (random weights; load a checkpoint with `state_from_hf`)."""
    return QwenVisionTower(spec, attention)


# -- transformers' names ------------------------------------------------------------------------------------

def _blocks_table(mlp: dict[str, str]) -> Table:
    """Block names: ``mlp`` maps HF's MLP linears to ours."""
    return [
        ("blocks.{i}.norm1.", "layers.{i}.attn_norm."),
        ("blocks.{i}.norm2.", "layers.{i}.mlp_norm."),
        ("blocks.{i}.attn.qkv.", "layers.{i}.attn.qkv."),  # fused in HF, split in `state_from_hf`
        ("blocks.{i}.attn.proj.", "layers.{i}.attn.o_proj."),
        *[(f"blocks.{{i}}.mlp.{hf}.", f"layers.{{i}}.mlp.{ours}.") for hf, ours in mlp.items()],
    ]


def _merger_table(hf: str, ours: str, parts: dict[str, str]) -> Table:
    return [(f"{hf}.{p}.", f"{ours}.{q}.") for p, q in parts.items()]


_QWEN2_MERGER = {"ln_q": "norm", "mlp.0": "linears.0", "mlp.2": "linears.1"}
_QWEN3_MERGER = {"norm": "norm", "linear_fc1": "linears.0", "linear_fc2": "linears.1"}
TABLES: dict[str, Table] = {  # (HF prefix, our prefix) per family, for `harmonia.model.hf.io.rename`
    "qwen2_vl": [("patch_embed.proj.", "patch_embed."), *_blocks_table({"fc1": "fc1", "fc2": "fc2"}),
                 *_merger_table("merger", "merger", _QWEN2_MERGER)],
    "qwen2_5_vl": [("patch_embed.proj.", "patch_embed."),
                   *_blocks_table({p: p for p in ("gate_proj", "up_proj", "down_proj")}),
                   *_merger_table("merger", "merger", _QWEN2_MERGER)],
    "qwen3_vl": [("patch_embed.proj.", "patch_embed."), ("pos_embed.", "pos_embed."),
                 *_blocks_table({"linear_fc1": "fc1", "linear_fc2": "fc2"}),
                 *_merger_table("merger", "merger", _QWEN3_MERGER),
                 *_merger_table("deepstack_merger_list.{i}", "deepstack.{i}", _QWEN3_MERGER)],
}
_QKV = re.compile(r"\.attn\.[qkv]_proj\.")


def hf_key(name: str, family: Family) -> str:
    """The transformers key (``model.visual``'s ``state_dict``) holding our tensor ``name``.

    ``layers.{i}.attn.{q,k,v}_proj.*`` are the first, second and third thirds (rows) of
    ``blocks.{i}.attn.qkv.*``; our ``patch_embed.weight`` ``(h, C * tp * p * p)`` is
    ``patch_embed.proj.weight`` ``(h, C, tp, p, p)`` flattened. Everything else is a rename.
    """
    fused = _QKV.sub(".attn.qkv.", name)
    out = rename({fused: None}, TABLES[family], to_ours=False)
    if len(out) != 1:
        raise ConfigError(f"{name!r} is not a tensor of a {family} vision tower")
    return next(iter(out))


def state_from_hf(state: dict[str, torch.Tensor], spec: QwenVisionSpec) -> dict[str, torch.Tensor]:
    """transformers' ``model.visual`` state dict -> ours (qkv split, patch embedding flattened)."""
    ours = rename(state, TABLES[spec.family], to_ours=True)
    out = {}
    for key, t in ours.items():
        if ".attn.qkv." in key:
            for proj, part in zip("qkv", t.chunk(3, dim=0)):
                out[key.replace(".attn.qkv.", f".attn.{proj}_proj.")] = part
        elif key == "patch_embed.weight":
            out[key] = t.reshape(t.shape[0], -1)
        else:
            out[key] = t
    return out


def state_to_hf(state: dict[str, torch.Tensor], spec: QwenVisionSpec) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' ``model.visual`` names and shapes (qkv fused, Conv3d weight)."""
    shape = (spec.in_channels, spec.temporal_patch_size, spec.patch_size, spec.patch_size)
    out = {}
    for key, t in state.items():
        if _QKV.search(key):
            if ".attn.q_proj." in key:
                parts = [state[key.replace(".attn.q_proj.", f".attn.{p}_proj.")] for p in "qkv"]
                out[hf_key(key, spec.family)] = torch.cat(parts, dim=0)
        elif key == "patch_embed.weight":
            out[hf_key(key, spec.family)] = t.reshape(t.shape[0], *shape)
        else:
            out[hf_key(key, spec.family)] = t
    return out
