"""Vision encoder (SigLIP / CLIP / InternViT families) over fixed-size tiles.

Front end: a strided conv patch embedding, an optional class token, learned position embeddings and
an optional pre-norm (CLIP). Then pre-norm blocks, an optional post-norm, and on the output the
class token is dropped and ``token_merge`` neighbouring patches are concatenated (InternVL's pixel
shuffle 0.5 merges 2 x 2 patches into one token of 4x the width), ready for the projector.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.layers import build_blocks, build_norm, init_weights, layer_range
from harmonia.model.spec import EncoderSpec


def merge_patches(x: torch.Tensor, token_merge: int) -> torch.Tensor:
    """Concatenate each ``r x r`` square of patches into one token (``r * r = token_merge``).

    Args:
        x: ``(N, s * s, D)`` patch tokens of square tiles, row-major.
        token_merge: patches per merged token, a perfect square dividing the grid.

    Returns:
        ``(N, (s / r) ** 2, r * r * D)``, merged tokens row-major, each the r x r square row-major.
    """
    if token_merge == 1:
        return x
    N, P, D = x.shape
    s, r = math.isqrt(P), math.isqrt(token_merge)
    x = x.view(N, s // r, r, s // r, r, D).permute(0, 1, 3, 2, 4, 5)  # (N, s/r, s/r, r, r, D)
    return x.reshape(N, (s // r) ** 2, token_merge * D)


class VisionEncoder(nn.Module):
    """Blocks ``[a, b)`` of a ViT; the first stage owns the patch embedding, the last the post-norm.

    Args:
        spec: the encoder's architecture (a vision encoder).
        layers: ``(a, b)`` global block range of this stage; None = all blocks.
    """

    def __init__(self, spec: EncoderSpec, layers: tuple[int, int] | None = None) -> None:
        super().__init__()
        if not spec.is_vision:
            raise ConfigError(f"encoder {spec.name!r} is an audio encoder; build it with build_audio_encoder")
        if spec.native_resolution:
            raise ConfigError(
                f"encoder {spec.name!r}: native-resolution vision encoders are not implemented in the "
                "reference models; use fixed-size tiles (native_resolution=False)"
            )
        side = spec.image_size // spec.patch_size
        r = math.isqrt(spec.token_merge)
        if r * r != spec.token_merge or side % r:
            raise ConfigError(
                f"encoder {spec.name!r}: token_merge={spec.token_merge} must be a square r*r with r "
                f"dividing the {side}x{side} patch grid"
            )
        body = spec.body
        self.spec = spec
        self.indices = layer_range(body.n_layers, layers, f"encoder {spec.name!r}")
        self.is_first = self.indices.start == 0
        self.is_last = self.indices.stop == body.n_layers
        n_pos = spec.patches_per_tile() + int(spec.cls_token)
        self.patch_embed = self.cls_token = self.pos_embed = self.pre_norm = self.post_norm = None
        if self.is_first:
            self.patch_embed = nn.Conv2d(spec.channels, body.hidden, spec.patch_size, spec.patch_size,
                                         bias=spec.patch_bias)
            if spec.cls_token:
                self.cls_token = nn.Parameter(torch.zeros(1, 1, body.hidden))
            if spec.pos_embed == "learned":
                self.pos_embed = nn.Parameter(torch.zeros(n_pos, body.hidden))
            if spec.pre_norm:
                self.pre_norm = build_norm(body.norm, body.hidden, body.norm_eps)
        self.layers = build_blocks(body, self.indices)
        if self.is_last and spec.post_norm:
            self.post_norm = build_norm(body.norm, body.hidden, body.norm_eps)
        init_weights(self)
        for p in (self.cls_token, self.pos_embed):
            if p is not None:
                nn.init.normal_(p, std=0.02)

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(N, C, H, W)`` tiles of ``image_size`` pixels -> ``(N, P (+1), h)`` tokens."""
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))  # (N, h, s, s)
        x = x.flatten(2).transpose(1, 2)  # (N, s*s, h)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (N, 1 + s*s, h)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        return self.pre_norm(x) if self.pre_norm is not None else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pixels ``(N, C, H, W)`` on the first stage, tokens ``(N, P', h)`` otherwise.

        Returns:
            ``(N, P', h)`` on inner stages; on the last stage ``(N, P / token_merge, token_merge * h)``.
        """
        if self.is_first:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        if not self.is_last:
            return x
        return self.finish(x)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Post-norm, drop the class token, merge patches: what the projector receives."""
        if self.post_norm is not None:
            x = self.post_norm(x)
        if self.spec.cls_token:
            x = x[:, 1:]
        return merge_patches(x, self.spec.token_merge)


def build_vision_encoder(spec: EncoderSpec, layers: tuple[int, int] | None = None) -> VisionEncoder:
    """A vision encoder, or the stage holding blocks ``[a, b)`` of it."""
    return VisionEncoder(spec, layers)
