"""The architecture of a Qwen-VL native-resolution vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and
its reader from a transformers config.

`QwenVisionSpec` is pure data, like every spec of `harmonia.model.spec`: an `EncoderSpec` whose
``native`` field holds one is a native-resolution encoder (`harmonia.model.qwen_vit` builds it), and
the cost model reads its blocks from the `EncoderSpec` as for any other tower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from harmonia.errors import ConfigError
from harmonia.model.projector_spec import ProjectorSpec
from harmonia.model.spec import EncoderSpec, TransformerSpec
from harmonia.model.video_spec import VideoNumbers

Family = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
NORM_EPS = 1e-6  # every norm of the three towers

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
        tokens_per_second: Qwen2.5-VL's temporal rotary positions per second of video
            (`harmonia.model.mrope.rope_index`); None in the others.
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
    tokens_per_second: float | None = None

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

    def carried_taps(self, start: int) -> tuple[int, ...]:
        """The deepstack blocks before block ``start``, whose outputs a pipeline stage starting there
        receives beside the hidden state (each block's output is tapped after it runs)."""
        return tuple(i for i in self.deepstack_layers if i < start)

    @property
    def patch_dim(self) -> int:
        """Values in one patch row of ``pixel_values``: ``C * tp * p * p``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merger_norm(self) -> str:
        """The mergers' norm: RMSNorm in Qwen2.5-VL, LayerNorm in the others."""
        return "rmsnorm" if self.family == "qwen2_5_vl" else "layernorm"

    def frontend_params(self) -> int:
        """The patch embedding (a bias in Qwen3-VL) and Qwen3-VL's learned position table."""
        h = self.body.hidden
        return self.patch_dim * h + (h if self.family == "qwen3_vl" else 0) + (self.num_position_embeddings or 0) * h

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
        tokens_per_second=float(vc.get("tokens_per_second", 2)) if family == "qwen2_5_vl" else None,
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


MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2VLImageProcessor's defaults
TRACE_TILE = 448  # the side of a tile of a trace that counts images in tiles (InternVL's, `harmonia.workload.traces`)


def native_encoder_spec(native: QwenVisionSpec, name: str, min_pixels: int = MIN_PIXELS,
                        max_pixels: int = MAX_PIXELS, modalities: tuple[str, ...] = ("image", "video"),
                        video: VideoNumbers | None = None) -> EncoderSpec:
    """The `EncoderSpec` of a Qwen-VL tower: its blocks, patch and merge sizes as the cost model reads
    them, the processor's pixel bounds (its video processor's: ``video``, transformers' defaults when
    None), and ``native`` for building it. Its ``image_size`` is only the
    side of a tile when a trace counts images in tiles (`harmonia.workload.shapes.native_grid`)."""
    return EncoderSpec(
        name, modalities, native.body, patch_size=native.patch_size, image_size=TRACE_TILE,
        channels=native.in_channels, patch_bias=native.family == "qwen3_vl", post_norm=False,
        pos_embed="learned" if native.num_position_embeddings else "none", token_merge=native.merge_size ** 2,
        temporal_merge=native.temporal_patch_size, native_resolution=True, max_tiles=1, native=native,
        min_pixels=min_pixels, max_pixels=max_pixels,
        video=video if video is not None else VideoNumbers.qwen3() if native.family == "qwen3_vl" else VideoNumbers(),
    )


def merger_spec(spec: QwenVisionSpec, name: str = "merger", deepstack: bool = False) -> ProjectorSpec:
    """The merger as a projector: norm (each patch apart, or the concatenation for Qwen3-VL's deepstack
    mergers), ``Linear(m^2 h, m^2 h)``, exact GELU, ``Linear(m^2 h, out)``."""
    width = spec.body.hidden * spec.merge_size ** 2
    return ProjectorSpec(name, in_dim=width, out_dim=spec.out_dim, hidden=width, n_layers=2, input_norm=True,
                         act="gelu", bias=True, norm=spec.merger_norm, norm_eps=NORM_EPS,
                         norm_groups=1 if deepstack else spec.merge_size ** 2)


def projector_spec(spec: QwenVisionSpec, name: str) -> ProjectorSpec:
    """An MLLM's projector for the tower: the merger, and Qwen3-VL's DeepStack mergers after it."""
    main = merger_spec(spec, name)
    k = len(spec.deepstack_layers)
    return replace(main, in_dim=main.in_dim * (1 + k), deepstack=k) if k else main
