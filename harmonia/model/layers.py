"""Building blocks of the reference models: norms, rotary embedding, attention (GQA), MLPs, blocks.

Every block reads a `TransformerSpec`. Tensors are ``(B, T, h)``: a batch of encoder sequences (tiles,
audio chunks) or one packed LLM sequence (``B = 1``). Attention heads are derived from the weight
shapes at run time, so a block whose projections were sharded by tensor parallelism (fewer local
heads) runs unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.attention import LayerAttention, PackedAttention
from harmonia.model.attention_mask import window_mask
from harmonia.model.lean_ops import rms_norm, silu_mul
from harmonia.model.spec import RopeScaling, TransformerSpec


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 (Llama's ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``layernorm`` (weight and bias) or ``rmsnorm`` (weight) over the last dimension."""
    return nn.LayerNorm(dim, eps=eps) if kind == "layernorm" else RMSNorm(dim, eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Inverse rotary frequencies ``(head_dim / 2,)`` in float32, computed as transformers does.

    Plain RoPE: ``theta ** (-2k / head_dim)``. ``linear`` divides them by ``factor``; ``llama3``
    (``transformers.modeling_rope_utils._compute_llama3_parameters``) divides those with a wavelength
    above ``original_max_positions / low_freq_factor`` by ``factor``, keeps those below
    ``original_max_positions / high_freq_factor`` and blends the band between.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    if scaling.kind == "linear":
        return inv_freq / factor
    low, high, old_len = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables for given token positions (half-split layout, as Llama in HF).

    Args:
        positions: ``(T,)`` or ``(B, T)`` integer positions of each token within its sample.
        head_dim: per-head width (even).
        theta: rotary base.
        scaling: rescaled frequencies (`rope_inv_freq`); None = plain RoPE.

    Returns:
        ``(cos, sin)``, each ``(..., T, head_dim)`` in float32.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(positions.device, non_blocking=True)
    freqs = positions.float()[..., None] * inv_freq  # (..., T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, hd)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, nh, T, hd)`` by tables of shape ``(T, hd)`` or ``(B, T, hd)``."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hd)
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


def restrict_to_window(mask, positions: torch.Tensor, window: int):
    """What a layer with sliding window ``window`` attends with, given what the stage attends with.

    Args:
        mask: a `PackedAttention` (the runtime's: the window travels with it, nothing is built), a
            dense boolean ``(T, T)`` / ``(B, 1, T, T)`` reference mask, or None (no other limit).
        positions: ``(T,)`` or ``(B, T)`` positions of the tokens (dense masks only).
        window: keys a query attends lie at ``query - key < window`` (`window_mask`).

    Returns a dense ``mask`` itself when no two positions lie ``window`` apart (the window hides nothing).
    """
    if isinstance(mask, PackedAttention):
        return mask.for_window(window)
    if mask is not None and int(positions.max()) - int(positions.min()) < window:
        return mask
    near = window_mask(positions, positions, window)  # (T, T) or (B, T, T)
    if near.dim() == 3:
        near = near[:, None]  # (B, 1, T, T)
    return near if mask is None else mask & near


class Attention(nn.Module):
    """Multi-head self-attention with grouped key/value heads, optional qk-norm and rotary embedding.

    A sliding window is not the block's business: it arrives with what the block attends with
    (`restrict_to_window`), so one attention serves windowed and full layers alike.
    """

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        h = spec.hidden
        self.head_dim = spec.dim_head
        self.q_proj = nn.Linear(h, spec.q_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.kv_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.kv_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_dim, h, bias=spec.out_bias)
        self.qk_norm_per_head = spec.qk_norm_per_head
        if spec.qk_norm:
            q_width, k_width = (self.head_dim, self.head_dim) if spec.qk_norm_per_head else (spec.q_dim, spec.kv_dim)
            self.q_norm = build_norm(spec.norm, q_width, spec.norm_eps)
            self.k_norm = build_norm(spec.norm, k_width, spec.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attend within ``x``.

        Args:
            x: ``(B, T, h)``.
            mask: a `LayerAttention` (one packed microbatch, any kernel, ``x`` possibly one
                context-parallel shard: `harmonia.model.attention`), a dense boolean ``(T, T)`` or
                ``(B, 1, T, T)`` reference mask (tests), or None: attend everything (an encoder sequence).
            rope: ``(cos, sin)`` tables from `rope_cos_sin`, or None for no rotary embedding.
        """
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)  # over all heads together
        q = q.view(B, T, -1, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, nkv, hd)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's hd channels
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        gqa = q.shape[1] != k.shape[1]
        if isinstance(mask, LayerAttention):
            y = mask.attend(q, k, v)  # (B, nh, T, hd)
        else:
            if mask is not None and mask.dim() == 2:
                mask = mask[None, None]  # (1, 1, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd)
        return self.o_proj(y)


class MLP(nn.Module):
    """``gelu``: fc2(gelu(fc1 x)); ``swiglu``: down(silu(gate x) * up x)."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        h, f, bias = spec.hidden, spec.ffn_hidden, spec.mlp_bias
        self.swiglu = spec.mlp == "swiglu"
        self.approximate = spec.gelu_approximate
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=bias)
            self.up_proj = nn.Linear(h, f, bias=bias)
            self.down_proj = nn.Linear(f, h, bias=bias)
        else:
            self.fc1 = nn.Linear(h, f, bias=bias)
            self.fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        if self.approximate == "quick":
            h = self.fc1(x)
            return self.fc2(h * torch.sigmoid(1.702 * h))  # CLIP's quick_gelu
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm x)``, then ``x + mlp(norm x)``, optional layer scale.

    Attributes:
        recompute: keep only the block's input for backward and run its forward again there
            (activation checkpointing, non-reentrant); set by `harmonia.runtime.parallelize`.
    """

    param_init = {"attn_scale": ("ones", 1.0), "mlp_scale": ("ones", 1.0)}  # `harmonia.model.init`

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.recompute = False
        self.attn_norm = build_norm(spec.norm, spec.hidden, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = build_norm(spec.norm, spec.hidden, spec.norm_eps)
        self.mlp = MLP(spec)
        if spec.layer_scale:
            self.attn_scale = nn.Parameter(torch.ones(spec.hidden))
            self.mlp_scale = nn.Parameter(torch.ones(spec.hidden))
        else:
            self.attn_scale = self.mlp_scale = None

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, x, mask, rope, use_reentrant=False)
        return self._forward(x, mask, rope)

    def _forward(self, x: torch.Tensor, mask, rope) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), mask, rope)
        x = x + (a if self.attn_scale is None else a * self.attn_scale)
        m = self.mlp(self.mlp_norm(x))
        return x + (m if self.mlp_scale is None else m * self.mlp_scale)


def layer_range(n_layers: int, layers: tuple[int, int] | None, owner: str) -> range:
    """Global indices of the blocks a (stage) module holds; ``None`` means all."""
    if layers is None:
        return range(n_layers)
    start, stop = layers
    if not 0 <= start <= stop <= n_layers:
        raise ConfigError(
            f"{owner}: layers [{start}, {stop}) out of range for {n_layers} layers; "
            f"pick 0 <= start <= stop <= {n_layers}"
        )
    return range(start, stop)


def build_blocks(spec: TransformerSpec, indices: range) -> nn.ModuleDict:
    """Blocks keyed by their global index, so parameter names are the same in every stage split."""
    return nn.ModuleDict({str(i): Block(spec) for i in indices})


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) linear/embedding weights, zero biases; norms and scales stay at one."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=std)
