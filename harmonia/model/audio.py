"""Audio encoder (Whisper style): two 1-D convolutions over log-mel frames, then a transformer.

``conv1`` (kernel 3, stride 1) and ``conv2`` (kernel 3, stride ``conv_stride``), each followed by
GELU, turn ``F`` mel frames into ``ceil(F / conv_stride)`` tokens; learned (Whisper: sinusoidal,
stored) position embeddings are added, then pre-norm blocks and a final norm. ``token_merge``
consecutive tokens are concatenated on the output for the projector.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.layers import build_blocks, build_norm, init_weights, layer_range
from harmonia.model.batch import MediaInputs
from harmonia.model.spec import EncoderSpec


def merge_frames(x: torch.Tensor, token_merge: int) -> torch.Tensor:
    """``(N, T, D) -> (N, ceil(T / k), k * D)``: concatenate ``k`` consecutive tokens, zero-padding the tail."""
    if token_merge == 1:
        return x
    N, T, D = x.shape
    pad = -T % token_merge
    x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(N, (T + pad) // token_merge, token_merge * D)


class AudioEncoder(nn.Module):
    """Blocks ``[a, b)`` of a Whisper-style encoder; the first stage owns the convs and positions.

    Args:
        spec: the encoder's architecture (an audio encoder).
        layers: ``(a, b)`` global block range of this stage; None = all blocks.
    """

    param_init = {"pos_embed": ("normal", 0.02)}  # `harmonia.model.init`

    def __init__(self, spec: EncoderSpec, layers: tuple[int, int] | None = None) -> None:
        super().__init__()
        if not spec.is_audio:
            raise ConfigError(f"encoder {spec.name!r} is a vision encoder; build it with build_vision_encoder")
        if spec.chunk_seconds is not None and spec.token_merge > 1:
            per_chunk = math.ceil(mel_frames(spec.chunk_seconds, spec) / spec.conv_stride)
            if per_chunk % spec.token_merge:
                raise ConfigError(
                    f"encoder {spec.name!r}: {per_chunk} tokens per {spec.chunk_seconds} s chunk are not a "
                    f"multiple of token_merge={spec.token_merge}; pick a chunk length or merge that divides"
                )
        body = spec.body
        self.spec = spec
        self.indices = layer_range(body.n_layers, layers, f"encoder {spec.name!r}")
        self.is_first = self.indices.start == 0
        self.is_last = self.indices.stop == body.n_layers
        self.conv1 = self.conv2 = self.pos_embed = self.post_norm = None
        if self.is_first:
            self.conv1 = nn.Conv1d(spec.n_mels, body.hidden, 3, padding=1)
            self.conv2 = nn.Conv1d(body.hidden, body.hidden, 3, stride=spec.conv_stride, padding=1)
            if spec.pos_embed == "learned":
                self.pos_embed = nn.Parameter(torch.zeros(spec.max_positions, body.hidden))
        self.layers = build_blocks(body, self.indices)
        if self.is_last and spec.post_norm:
            self.post_norm = build_norm(body.norm, body.hidden, body.norm_eps)
        init_weights(self)
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)

    def hidden_shape(self, media: MediaInputs, block: int) -> tuple[int, int, int]:
        """``(N, T, h)``: what crosses between stages (before any block) for a (sub-)microbatch's ``N``
        mel chunks of ``F`` frames, ``T = ceil(F / conv_stride)`` (the strided conv's output, padding
        1, kernel 3); from its shape alone (a later stage's media hold no mel rows)."""
        return media.groups.numel(), -(-media.inputs.shape[-1] // self.spec.conv_stride), self.spec.body.hidden

    def embed(self, mel: torch.Tensor) -> torch.Tensor:
        """``(N, n_mels, F)`` log-mel chunks -> ``(N, ceil(F / conv_stride), h)`` tokens."""
        x = F.gelu(self.conv1(mel.to(self.conv1.weight.dtype)))  # (N, h, F)
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (N, T, h)
        if self.pos_embed is not None:
            if x.shape[1] > self.pos_embed.shape[0]:
                raise ConfigError(
                    f"encoder {self.spec.name!r}: {x.shape[1]} audio tokens exceed max_positions="
                    f"{self.pos_embed.shape[0]}; use shorter chunks (chunk_seconds) or raise max_positions"
                )
            x = x + self.pos_embed[: x.shape[1]]
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mel ``(N, n_mels, F)`` on the first stage, tokens ``(N, T, h)`` otherwise.

        Returns:
            ``(N, T, h)`` on inner stages; ``(N, ceil(T / token_merge), token_merge * h)`` on the last.
        """
        if self.is_first:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        if not self.is_last:
            return x
        if self.post_norm is not None:
            x = self.post_norm(x)
        return merge_frames(x, self.spec.token_merge)


def mel_frames(seconds: float, spec: EncoderSpec) -> int:
    """Mel frames of ``seconds`` of audio: ``floor(seconds * sample_rate / hop_length)``."""
    return max(1, math.floor(seconds * spec.sample_rate / spec.hop_length))


def build_audio_encoder(spec: EncoderSpec, layers: tuple[int, int] | None = None) -> AudioEncoder:
    """An audio encoder, or the stage holding blocks ``[a, b)`` of it."""
    return AudioEncoder(spec, layers)
