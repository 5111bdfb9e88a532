"""Vision encoder (SigLIP / CLIP / InternViT families) over fixed-size tiles.

Front end: a strided conv patch embedding, an optional class token, learned position embeddings and
an optional pre-norm (CLIP). Then pre-norm blocks, an optional post-norm, and on the output the
class token is dropped and ``token_merge`` neighbouring patches are concatenated (InternVL's pixel
shuffle 0.5 merges 2 x 2 patches into one token of 4x the width), ready for the projector.

An encoder whose spec selects several blocks' outputs (``feature_layers``, LLaVA's list-valued
``vision_feature_layer``) concatenates them on the feature dim. When the encoder is split into
pipeline stages, a stage whose blocks produce a selected output that a later stage needs carries it
forward: it sends ``(N, P, h * (1 + m))``, its last hidden state then the ``m`` selected outputs so
far in block order, and the next stage splits them off again.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.layers import build_blocks, build_norm, init_weights, layer_range
from harmonia.model.batch import MediaInputs
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

    param_init = {"cls_token": ("normal", 0.02), "pos_embed": ("normal", 0.02)}  # `harmonia.model.init`

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

    def hidden_shape(self, media: MediaInputs, block: int) -> tuple[int, int, int]:
        """``(N, P', h (1 + m))``: what crosses between stages before global block ``block`` for a
        (sub-)microbatch's ``N`` tiles (the hidden state and the ``m`` selected outputs before it);
        from its shape alone (a later stage's media hold no pixels)."""
        carried = sum(1 for k in self.spec.feature_layers if k < block)
        n_pos = self.spec.patches_per_tile() + int(self.spec.cls_token)
        return media.groups.numel(), n_pos, self.spec.body.hidden * (1 + carried)

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
        """Pixels ``(N, C, H, W)`` on the first stage, tokens ``(N, P', h (1 + m))`` otherwise.

        Returns:
            ``(N, P', h (1 + m))`` on inner stages (``m`` carried selected outputs, see the module
            docstring); on the last stage ``(N, P'' / token_merge, token_merge * out_dim)``.
        """
        selected = self.spec.feature_layers
        states: dict[int, torch.Tensor] = {}
        if self.is_first:
            x = self.embed(x)
        else:
            x, states = self._unpack(x)
        if self.indices.start in selected:
            states[self.indices.start] = x
        for i, block in self.layers.items():
            x = block(x)
            if int(i) + 1 in selected:
                states[int(i) + 1] = x
        if not self.is_last:
            return self._pack(x, states)
        if selected:
            x = torch.cat([states[k] for k in selected], dim=-1)  # (N, P', h * len(selected))
        return self.finish(x)

    def _pack(self, x: torch.Tensor, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """``x`` then the selected outputs a later stage needs, in block order: ``(N, P', h (1 + m))``."""
        carried = [states[k] for k in sorted(states) if k < self.indices.stop]
        return torch.cat([x, *carried], dim=-1) if carried else x

    def _unpack(self, y: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Split what the previous stage sent into its last hidden state and the carried outputs."""
        h = self.spec.body.hidden
        carried = sorted({k for k in self.spec.feature_layers if k < self.indices.start})
        if y.shape[-1] != h * (1 + len(carried)):
            raise ConfigError(
                f"encoder {self.spec.name!r} stage from block {self.indices.start}: got width {y.shape[-1]}, "
                f"expected {h * (1 + len(carried))} (hidden {h} plus {len(carried)} carried selected outputs)"
            )
        parts = y.split(h, dim=-1)
        return parts[0], dict(zip(carried, parts[1:]))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Post-norm, drop the leading tokens (class token), merge patches: what the projector receives."""
        if self.post_norm is not None:
            x = self.post_norm(x)
        x = x[:, self.spec.dropped:]
        return merge_patches(x, self.spec.token_merge)


def build_vision_encoder(spec: EncoderSpec, layers: tuple[int, int] | None = None) -> VisionEncoder:
    """A vision encoder, or the stage holding blocks ``[a, b)`` of it."""
    return VisionEncoder(spec, layers)
