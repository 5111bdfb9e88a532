"""Architecture specs of an MLLM's modules: encoders, projectors and the decoder LLM.

A spec is pure data: layer counts and widths, enough for the cost model to count FLOPs, bytes and
parameters, for the planner to split layers into stages, and for the reference models to be built.
Token conversions (item -> encoder tokens -> LLM tokens) live in `harmonia.workload.shapes` and
read these specs; no size is a constant elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from harmonia.errors import ConfigError
from harmonia.model.projector_spec import ProjectorSpec, check_positive
from harmonia.model.training_mode import ModuleTraining, Trainability
from harmonia.model.video_spec import VideoNumbers

MODALITIES: tuple[str, ...] = ("image", "video", "audio")


@dataclass(frozen=True)
class TransformerSpec:
    """A stack of pre-norm transformer blocks.

    Attributes:
        n_layers: number of blocks.
        hidden: model width ``h``.
        n_heads: attention heads (queries).
        n_kv_heads: key/value heads (GQA); None = ``n_heads``.
        ffn_hidden: MLP inner width ``f``.
        mlp: ``gelu`` (two matrices) or ``swiglu`` (three matrices).
        norm: ``layernorm`` (weight + bias) or ``rmsnorm`` (weight).
        qkv_bias: q, k, v projections have biases.
        out_bias: attention output projection has a bias.
        mlp_bias: MLP matrices have biases.
        qk_norm: norms on q and k before the rotary embedding: over all heads together
            (InternViT-6B), or over each head with ``qk_norm_per_head`` (Qwen3).
        qk_norm_per_head: ``qk_norm`` normalises each head's ``head_dim`` channels with one
            ``head_dim``-wide weight shared by all heads.
        layer_scale: per-channel scales on both residual branches (InternViT, EVA).
        head_dim: per-head width; None = ``hidden // n_heads``.
        norm_eps: epsilon of every norm in the stack.
        gelu_approximate: ``none`` (exact erf GELU), ``tanh`` (SigLIP's ``gelu_pytorch_tanh``) or
            ``quick`` (CLIP's ``quick_gelu``, ``x * sigmoid(1.702 x)``).
        sliding_window: a query at position ``i`` attends only keys at positions ``j`` with
            ``i - j < sliding_window`` (Mistral, Qwen2); None = no limit.
        window_layers: the blocks that use ``sliding_window``; None = every block.
    """

    n_layers: int
    hidden: int
    n_heads: int
    ffn_hidden: int
    n_kv_heads: int | None = None
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool = True
    qk_norm: bool = False
    layer_scale: bool = False
    head_dim: int | None = None
    norm_eps: float = 1e-6
    gelu_approximate: Literal["none", "tanh", "quick"] = "none"
    qk_norm_per_head: bool = False
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_positive(
            "TransformerSpec", n_layers=self.n_layers, hidden=self.hidden, n_heads=self.n_heads,
            ffn_hidden=self.ffn_hidden, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            sliding_window=self.sliding_window,
        )
        if self.window_layers is not None:
            object.__setattr__(self, "window_layers", tuple(sorted(set(self.window_layers))))
            if self.sliding_window is None or any(not 0 <= i < self.n_layers for i in self.window_layers):
                raise ConfigError(
                    f"TransformerSpec: window_layers={self.window_layers} needs a sliding_window and block "
                    f"indices in 0..{self.n_layers - 1}"
                )
        if self.qk_norm_per_head and not self.qk_norm:
            raise ConfigError("TransformerSpec: qk_norm_per_head=True needs qk_norm=True")
        if self.head_dim is None and self.hidden % self.n_heads:
            raise ConfigError(
                f"TransformerSpec: hidden={self.hidden} is not divisible by n_heads={self.n_heads}; "
                "set head_dim explicitly"
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"TransformerSpec: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}"
            )
        if self.mlp not in ("gelu", "swiglu") or self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError(
                f"TransformerSpec: mlp={self.mlp!r} / norm={self.norm!r}: expected mlp in "
                "('gelu', 'swiglu') and norm in ('layernorm', 'rmsnorm')"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (global index), or None when it attends without one."""
        if self.sliding_window is None or (self.window_layers is not None and layer not in self.window_layers):
            return None
        return self.sliding_window

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (``n_heads * head_dim``)."""
        return self.n_heads * self.dim_head

    @property
    def kv_dim(self) -> int:
        """Width of all key heads together (``n_kv_heads * head_dim``)."""
        return self.kv_heads * self.dim_head

    @property
    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def attention_matmul_params(self) -> int:
        """Weights of q, k, v and output projections (no biases)."""
        return self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden

    def mlp_matmul_params(self) -> int:
        """Weights of the MLP matrices (no biases)."""
        return (3 if self.mlp == "swiglu" else 2) * self.hidden * self.ffn_hidden

    def block_params(self) -> int:
        """Parameters of one block: matrices, biases, norms, layer scales."""
        p = self.attention_matmul_params() + self.mlp_matmul_params() + 2 * self.norm_params
        if self.qkv_bias:
            p += self.q_dim + 2 * self.kv_dim
        if self.out_bias:
            p += self.hidden
        if self.mlp_bias:
            p += self.ffn_hidden * (2 if self.mlp == "swiglu" else 1) + self.hidden
        if self.qk_norm:
            width = 2 * self.dim_head if self.qk_norm_per_head else self.q_dim + self.kv_dim
            p += width * (1 if self.norm == "rmsnorm" else 2)
        if self.layer_scale:
            p += 2 * self.hidden
        return p


class NativeTower(Protocol):
    """What an encoder spec reads of a native-resolution tower's architecture
    (`harmonia.model.qwen_spec.QwenVisionSpec` is one)."""

    body: TransformerSpec
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    deepstack_layers: tuple[int, ...]

    def frontend_params(self) -> int: ...


@dataclass(frozen=True)
class EncoderSpec:
    """A modality encoder: a front end (patch embedding or conv stem) and a transformer.

    Vision (image and video frames): an image of ``image_size`` pixels square becomes
    ``(image_size // patch_size) ** 2`` patches (plus a class token when ``cls_token``); the
    projector merges ``token_merge`` patches into one LLM token (pixel shuffle 0.5 -> 4).
    ``native_resolution`` encoders (Qwen2-VL style) take any pixel size instead of fixed tiles;
    ``native`` holds the architecture of one harmonia builds (`harmonia.model.qwen_spec.QwenVisionSpec`,
    made by `harmonia.model.qwen_spec.native_encoder_spec`): the processor resizes an image to
    multiples of ``patch_size * sqrt(token_merge)`` pixels with between ``min_pixels`` and
    ``max_pixels`` pixels (`harmonia.workload.shapes.smart_resize`), and ``temporal_merge`` frames make
    one patch; ``video`` holds its video processor's frame sampling and frame sizes
    (`harmonia.model.video_spec.VideoNumbers`; None: videos sized as images).
    Video frames are merged ``temporal_merge`` at a time before the LLM.

    Audio (Whisper style): ``sample_rate / hop_length`` mel frames per second, two convolutions
    (kernel 3, the second with ``conv_stride``), so ``ceil(mel / conv_stride)`` encoder tokens; audio
    is processed in chunks of ``chunk_seconds`` (padded, as Whisper does) when set.

    Output (what the projector receives): the last block's output, post-normed when ``post_norm``.
    ``feature_layers`` instead concatenates, on the feature dim and in the given order, the outputs
    of blocks ``k`` (1-based: ``k`` blocks run; 0 is the embeddings after CLIP's pre-norm, transformers'
    ``hidden_states[0]``). A spec holds only the blocks its output uses: LLaVA's
    ``vision_feature_layer=-2`` on a 24-block tower is a 23-block encoder without post-norm, and
    ``[-2, -1]`` is 24 blocks with ``feature_layers=(23, 24)`` and twice the width at the output.
    ``dropped_tokens`` leading tokens never reach the projector: None drops the class token when
    there is one; LLaVA's ``default`` strategy drops the first token whatever it is (CLIP's class
    token, SigLIP's first patch), ``full`` drops none.

    ``grid_pinpoints`` (LLaVA-NeXT anyres, `harmonia.model.anyres`): the ``(height, width)``
    resolutions, multiples of ``image_size``, one of which an image is fitted into and cut into
    tiles after a base tile of the whole image; its LLM tokens are the base tile's, the grid's
    cropped to the image's aspect ratio, and one ``image_newline`` per feature row.
    """

    name: str
    modalities: tuple[str, ...]
    body: TransformerSpec
    patch_size: int = 14
    image_size: int = 448
    channels: int = 3
    patch_bias: bool = True
    cls_token: bool = False
    pre_norm: bool = False
    post_norm: bool = True
    pos_embed: Literal["learned", "none"] = "learned"
    token_merge: int = 1
    temporal_merge: int = 1
    native_resolution: bool = False
    max_tiles: int = 12
    head_params: int = 0
    n_mels: int = 128
    sample_rate: int = 16000
    hop_length: int = 160
    conv_stride: int = 2
    chunk_seconds: float | None = 30.0
    max_positions: int = 1500
    feature_layers: tuple[int, ...] = ()
    dropped_tokens: int | None = None
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    native: NativeTower | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video: VideoNumbers | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        object.__setattr__(self, "grid_pinpoints", tuple(tuple(int(v) for v in p) for p in self.grid_pinpoints))
        bad = [m for m in self.modalities if m not in MODALITIES]
        if not self.modalities or bad:
            raise ConfigError(
                f"encoder {self.name!r}: modalities {self.modalities} invalid; expected a non-empty "
                f"subset of {MODALITIES}"
            )
        if "audio" in self.modalities and len(self.modalities) > 1:
            raise ConfigError(f"encoder {self.name!r}: an audio encoder cannot also encode {self.modalities}")
        check_positive(
            f"encoder {self.name!r}", patch_size=self.patch_size, image_size=self.image_size,
            token_merge=self.token_merge, temporal_merge=self.temporal_merge, n_mels=self.n_mels,
            sample_rate=self.sample_rate, hop_length=self.hop_length, conv_stride=self.conv_stride,
            chunk_seconds=self.chunk_seconds, max_tiles=self.max_tiles,
        )
        if self.is_vision and self.image_size < self.patch_size:
            raise ConfigError(
                f"encoder {self.name!r}: image_size={self.image_size} is smaller than "
                f"patch_size={self.patch_size}"
            )
        self._check_output()
        if self.grid_pinpoints:
            self._check_grid()
        if self.native is not None or self.min_pixels is not None or self.max_pixels is not None \
                or self.video is not None:
            self._check_native()

    def _check_native(self) -> None:
        """A built native-resolution tower: the fields the cost model reads agree with its architecture."""
        n, owner = self.native, f"encoder {self.name!r}"
        if n is None or not self.native_resolution:
            raise ConfigError(f"{owner}: native (the tower's architecture), native_resolution=True, min_pixels, "
                              "max_pixels and video go together")
        want = dict(body=n.body, patch_size=n.patch_size, channels=n.in_channels, token_merge=n.merge_size ** 2,
                    temporal_merge=n.temporal_patch_size, cls_token=False, pre_norm=False, post_norm=False,
                    feature_layers=(), grid_pinpoints=())
        wrong = [f"{k}={getattr(self, k)!r} (the tower's: {v!r})" for k, v in want.items() if getattr(self, k) != v]
        if wrong:
            raise ConfigError(f"{owner}: {', '.join(wrong)}; build it with native_encoder_spec")
        if self.min_pixels is None or self.max_pixels is None or not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(f"{owner}: min_pixels={self.min_pixels} and max_pixels={self.max_pixels} must be "
                              "positive with min_pixels <= max_pixels (the processor's numbers)")

    def _check_output(self) -> None:
        owner, n = f"encoder {self.name!r}", self.body.n_layers
        if self.feature_layers:
            if self.is_audio or any(not 0 <= k <= n for k in self.feature_layers) or max(self.feature_layers) != n:
                raise ConfigError(
                    f"{owner}: feature_layers={self.feature_layers} must be block counts in 0..{n} of a vision "
                    f"encoder whose deepest one is its last block ({n}); the spec holds only the blocks used"
                )
            if self.post_norm:
                raise ConfigError(f"{owner}: feature_layers selects raw block outputs; set post_norm=False")
        if self.dropped_tokens is None:
            return
        tokens = self.patches_per_tile() + int(self.cls_token)
        if self.is_audio and self.dropped_tokens:
            raise ConfigError(f"{owner}: dropped_tokens={self.dropped_tokens} is for vision encoders only")
        if not 0 <= self.dropped_tokens < tokens:
            raise ConfigError(f"{owner}: dropped_tokens={self.dropped_tokens} must be in 0..{tokens - 1}")
        if self.token_merge > 1 and self.dropped_tokens != int(self.cls_token):
            raise ConfigError(
                f"{owner}: token_merge={self.token_merge} merges squares of the patch grid, so exactly the "
                f"class token must be dropped (dropped_tokens={int(self.cls_token)}), not {self.dropped_tokens}"
            )

    def _check_grid(self) -> None:
        """``grid_pinpoints`` must describe tiles this encoder runs and lays out as a feature grid."""
        owner, s = f"encoder {self.name!r}", self.image_size
        if self.is_audio or self.native_resolution or "video" in self.modalities:
            raise ConfigError(f"{owner}: grid_pinpoints (anyres tiling) are for fixed-size image encoders, not "
                              f"modalities={self.modalities} / native_resolution={self.native_resolution}")
        bad = [p for p in self.grid_pinpoints if len(p) != 2 or min(p) <= 0 or p[0] % s or p[1] % s]
        if bad:
            raise ConfigError(f"{owner}: grid_pinpoints {bad} are not (height, width) pairs of positive multiples "
                              f"of image_size={s}")
        side = s // self.patch_size
        if self.token_merge != 1 or self.llm_tokens_per_tile() != side * side:
            raise ConfigError(
                f"{owner}: anyres tiling lays each tile's {side}x{side} patch features out on a grid, but a tile "
                f"gives {self.llm_tokens_per_tile()} LLM tokens (token_merge={self.token_merge}, class token "
                f"{self.cls_token}, dropped {self.dropped}); a CLIP tower needs the 'default' feature select "
                "strategy, a SigLIP tower 'full'"
            )
        most = 1 + max(h // s * (w // s) for h, w in self.grid_pinpoints)
        if self.max_tiles < most:
            raise ConfigError(f"{owner}: max_tiles={self.max_tiles} but grid_pinpoints cut an image into up to "
                              f"{most} tiles (base tile included)")

    @property
    def dropped(self) -> int:
        """Leading output tokens removed before the projector (see ``dropped_tokens``)."""
        return int(self.cls_token) if self.dropped_tokens is None else self.dropped_tokens

    @property
    def is_audio(self) -> bool:
        return "audio" in self.modalities

    def carried_taps(self, start: int) -> tuple[int, ...]:
        """The earlier blocks' outputs a pipeline stage starting at block ``start`` receives beside the
        hidden state, one ``hidden`` wide each: a native tower's deepstack taps before it, or the
        ``feature_layers`` before it (`harmonia.model.vit.VisionEncoder`)."""
        if self.native is not None:
            return tuple(i for i in self.native.deepstack_layers if i < start)
        return tuple(k for k in self.feature_layers if k < start)

    @property
    def is_vision(self) -> bool:
        return not self.is_audio

    @property
    def out_dim(self) -> int:
        """Width of an output token before the merge: the hidden size times the selected layers (a
        native tower's: times one plus its DeepStack blocks, whose outputs follow the last block's)."""
        if self.native is not None:
            return self.body.hidden * (1 + len(self.native.deepstack_layers))
        return self.body.hidden * max(1, len(self.feature_layers))

    def patches_per_tile(self) -> int:
        """Patches of one ``image_size`` tile; a strided conv drops a partial last patch."""
        return (self.image_size // self.patch_size) ** 2

    def llm_tokens_per_tile(self) -> int:
        """LLM tokens of one tile: patches (+ class token) less the dropped ones, over ``token_merge``."""
        return (self.patches_per_tile() + int(self.cls_token) - self.dropped) // self.token_merge

    def frontend_params(self) -> int:
        """Patch embedding (conv as a matrix) + positions + class token, or Whisper's two convs."""
        h = self.body.hidden
        if self.native is not None:
            return self.native.frontend_params()
        if self.is_audio:
            conv = self.n_mels * h * 3 + h + h * h * 3 + h
            return conv + self.max_positions * h
        p = self.channels * self.patch_size**2 * h + (h if self.patch_bias else 0)
        if self.pos_embed == "learned":
            p += (self.patches_per_tile() + int(self.cls_token)) * h
        if self.cls_token:
            p += h
        return p

    def n_params(self) -> int:
        """All parameters of the encoder (front end, blocks, norms, head)."""
        norms = (int(self.pre_norm) + int(self.post_norm)) * self.body.norm_params
        return self.frontend_params() + self.body.n_layers * self.body.block_params() + norms + self.head_params


@dataclass(frozen=True)
class RopeScaling:
    """Rescaled rotary frequencies for long contexts, as transformers' ``rope_type``.

    ``linear`` divides every inverse frequency by ``factor``. ``llama3`` (Llama 3.1 / 3.2) divides
    the low frequencies (wavelength above ``original_max_positions / low_freq_factor``) by
    ``factor``, keeps the high ones (wavelength below ``original_max_positions / high_freq_factor``)
    and interpolates smoothly between them.

    Attributes:
        kind: ``linear`` or ``llama3``.
        factor: the context extension factor.
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_positions: ``llama3`` only, the pretraining context length.
    """

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ConfigError(f"RopeScaling: kind={self.kind!r} is not implemented; expected 'linear' or 'llama3'")
        check_positive("RopeScaling", factor=self.factor, low_freq_factor=self.low_freq_factor,
                        high_freq_factor=self.high_freq_factor, original_max_positions=self.original_max_positions)
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"RopeScaling: llama3 needs high_freq_factor ({self.high_freq_factor}) > "
                              f"low_freq_factor ({self.low_freq_factor})")


@dataclass(frozen=True)
class LLMSpec:
    """A decoder LLM (Llama / Qwen family): embedding, blocks, final norm, LM head.

    ``rope_theta`` is the base of the rotary position embedding (Llama 2: 1e4, Qwen2: 1e6);
    ``rope_scaling`` rescales its frequencies (Llama 3.1: ``llama3``), None = plain RoPE. With
    ``tie_embeddings`` the head is the embedding matrix; a pipeline stage that holds the head but not
    the embedding keeps its own copy of it, whose gradient the runtime sums with the embedding's.
    ``mrope_section`` (Qwen-VL's multimodal RoPE): how many of the ``head_dim / 2`` frequencies the
    temporal, height and width positions turn, in blocks or, with ``mrope_interleaved`` (Qwen3-VL),
    interleaved (`harmonia.model.mrope`); empty = one position per token. ``deepstack`` (Qwen3-VL):
    after each of its first ``deepstack`` blocks the LLM adds one more set of item features at the
    item positions (`harmonia.model.llm.DecoderLM`); its first pipeline stage holds those blocks.
    """

    name: str
    body: TransformerSpec
    vocab_size: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    deepstack: int = 0

    def __post_init__(self) -> None:
        check_positive(f"llm {self.name!r}", vocab_size=self.vocab_size, rope_theta=self.rope_theta)
        if not 0 <= self.deepstack <= self.body.n_layers:
            raise ConfigError(f"llm {self.name!r}: deepstack={self.deepstack} must be in 0..n_layers")
        if self.mrope_section:
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.body.dim_head // 2:
                raise ConfigError(f"llm {self.name!r}: mrope_section={list(self.mrope_section)} must be three counts "
                                  f"summing to head_dim / 2 = {self.body.dim_head // 2}")
            if self.body.sliding_window is not None:
                raise ConfigError(f"llm {self.name!r}: multimodal RoPE with a sliding window is not implemented")

    @property
    def multimodal_rope(self) -> bool:
        """Whether tokens carry three rotary positions (`harmonia.model.mrope`)."""
        return bool(self.mrope_section)

    @property
    def hidden(self) -> int:
        return self.body.hidden

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden

    def head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden

    def n_params(self) -> int:
        b = self.body
        return self.embedding_params() + b.n_layers * b.block_params() + b.norm_params + self.head_params()


@dataclass(frozen=True)
class MLLMSpec:
    """A whole MLLM: encoders (by module name), one projector per encoder, the LLM, training modes.

    Module names follow the vocabulary: an encoder ``vision`` has projector ``vision_proj``; the
    decoder is ``llm``. The graph is ``encoder -> projector -> llm`` for every encoder.

    Attributes:
        item_attention: how an item's LLM tokens attend: ``bidirectional`` within the item (and
            causally before it), or ``causal`` like text (LLaVA: one causal mask over all tokens).
        item_token_ids: modality -> the placeholder token id the checkpoint's tokenizer puts at item
            positions (LLaVA's ``image_token_id``); empty when the model has no such convention.
    """

    name: str
    encoders: dict[str, EncoderSpec]
    projectors: dict[str, ProjectorSpec]
    llm: LLMSpec
    training: dict[str, ModuleTraining] = field(default_factory=dict)
    item_attention: Literal["bidirectional", "causal"] = "bidirectional"
    item_token_ids: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.item_attention not in ("bidirectional", "causal"):
            raise ConfigError(f"MLLM {self.name!r}: item_attention={self.item_attention!r}; expected "
                              "'bidirectional' or 'causal'")
        for modality, token in self.item_token_ids.items():
            if modality not in MODALITIES or not 0 <= token < self.llm.vocab_size:
                raise ConfigError(f"MLLM {self.name!r}: item_token_ids[{modality!r}]={token} must name a modality "
                                  f"of {MODALITIES} and a token id below vocab_size={self.llm.vocab_size}")
        for enc in self.encoders:
            if f"{enc}_proj" not in self.projectors:
                raise ConfigError(
                    f"MLLM {self.name!r}: encoder {enc!r} has no projector; add projectors[{enc + '_proj'!r}]"
                )
        for proj, spec in self.projectors.items():
            enc = proj.removesuffix("_proj")
            if enc not in self.encoders:
                raise ConfigError(f"MLLM {self.name!r}: projector {proj!r} has no encoder {enc!r}")
            want = self.encoders[enc].out_dim * self.encoders[enc].token_merge
            if spec.deepstack and spec.deepstack != self.llm.deepstack:
                raise ConfigError(f"MLLM {self.name!r}: projector {proj!r} emits {spec.deepstack} DeepStack feature "
                                  f"sets but the LLM adds {self.llm.deepstack}")
            if spec.in_dim != want or spec.out_dim != self.llm.hidden:
                raise ConfigError(
                    f"MLLM {self.name!r}: projector {proj!r} maps {spec.in_dim}->{spec.out_dim}, expected "
                    f"{want} (encoder width x token_merge) -> {self.llm.hidden} (LLM width)"
                )
        seen: dict[str, str] = {}
        for name, enc in self.encoders.items():
            for m in enc.modalities:
                if m in seen:
                    raise ConfigError(f"MLLM {self.name!r}: modality {m!r} has two encoders ({seen[m]}, {name})")
                seen[m] = name
        unknown = set(self.training) - set(self.module_names)
        if unknown:
            raise ConfigError(
                f"MLLM {self.name!r}: training modes for unknown modules {sorted(unknown)}; "
                f"modules are {self.module_names}"
            )

    @property
    def module_names(self) -> list[str]:
        """Modules in graph order: encoders, projectors, llm."""
        return [*self.encoders, *self.projectors, "llm"]

    def encoder_for(self, modality: str) -> str:
        """Name of the encoder module that handles a modality."""
        for name, enc in self.encoders.items():
            if modality in enc.modalities:
                return name
        raise ConfigError(
            f"MLLM {self.name!r} has no encoder for modality {modality!r}; it encodes "
            f"{sorted(m for e in self.encoders.values() for m in e.modalities)}"
        )

    def training_of(self, module: str) -> ModuleTraining:
        return self.training.get(module, ModuleTraining())

    def upstream(self, module: str) -> list[str]:
        """Modules strictly upstream of ``module`` in the graph."""
        if module == "llm":
            return [*self.encoders, *self.projectors]
        if module in self.projectors:
            return [module.removesuffix("_proj")]
        if module in self.encoders:
            return []
        raise ConfigError(f"unknown module {module!r}; modules are {self.module_names}")

    def with_training(self, **modes: str | Trainability | ModuleTraining) -> MLLMSpec:
        """A copy with some modules' training modes changed (``vision="frozen"``)."""
        training = dict(self.training)
        for module, mode in modes.items():
            training[module] = mode if isinstance(mode, ModuleTraining) else ModuleTraining(Trainability(mode))
        return replace(self, training=training)

    def n_params(self) -> dict[str, int]:
        out = {name: enc.n_params() for name, enc in self.encoders.items()}
        out.update({name: p.n_params() for name, p in self.projectors.items()})
        out["llm"] = self.llm.n_params()
        return out
