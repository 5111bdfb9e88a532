"""Which attention kernel runs a packed microbatch: by device, mask kind and head width.

The kernels are `harmonia.model.attention`'s; a microbatch's mask is one of three kinds
(`mask_kind`): causal packed documents (text, and items that attend causally), bidirectional packed
sequences (an encoder's images or frames, each attending its whole self), or bidirectional items
inside causal text. `choose_backend` picks a kernel that can run the kind on the device with the
model's head width (`takes_head_dim`), or refuses the one asked for, naming what it cannot run.
"""

from __future__ import annotations

import torch

from harmonia.errors import ConfigError
from harmonia.model.attention_mask import TokenLayout

BACKENDS = ("auto", "segments", "varlen", "flex", "dense")

CAUSAL = "causal packed documents"
SEQUENCES = "bidirectional packed sequences"
MIXED = "bidirectional items in causal text"
MASK_KINDS = (CAUSAL, SEQUENCES, MIXED)


def mask_kind(layout: TokenLayout) -> str:
    """`CAUSAL` where no token attends ahead (text, causal items), `SEQUENCES` where every sample is
    one item attending its whole self (an encoder's packed sequences), `MIXED` otherwise."""
    if not bool(layout.is_item.any()):
        return CAUSAL
    if bool(layout.is_item.all()) and torch.equal(layout.sample, layout.segment - layout.segment[0]):
        return SEQUENCES
    return MIXED


def takes_head_dim(kernel: str, head_dim: int) -> bool:
    """Whether a kernel runs heads of ``head_dim`` channels: FlashAttention (``varlen``) a multiple
    of 8 up to 256, compiled ``flex`` at least 16; the others any."""
    if kernel == "varlen":
        return head_dim % 8 == 0 and head_dim <= 256
    if kernel == "flex":
        return head_dim >= 16
    return True


def choose_backend(requested: str, device: torch.device | str, kind: str, head_dim: int | None = None) -> str:
    """The kernel for a mask on a device.

    Args:
        requested: one of `BACKENDS`; ``auto`` = ``varlen`` on CUDA for `CAUSAL` and `SEQUENCES`
            masks, ``flex`` on CUDA for `MIXED` ones (each where it takes ``head_dim``, else the
            other where it can express the mask, else ``segments``), ``segments`` elsewhere.
        device: where attention runs.
        kind: the mask's kind, one of `MASK_KINDS` (`mask_kind`).
        head_dim: channels per head (`takes_head_dim`); None = not checked.

    Raises:
        ConfigError: ``requested`` cannot run this mask or these heads on this device.
    """
    device_type = torch.device(device).type
    if requested not in BACKENDS:
        raise ConfigError(f"attention backend {requested!r} is not one of {BACKENDS}")
    if kind not in MASK_KINDS:
        raise ConfigError(f"attention mask kind {kind!r} is not one of {MASK_KINDS}")
    takes = (lambda kernel: True) if head_dim is None else (lambda kernel: takes_head_dim(kernel, head_dim))
    if requested == "auto":
        if device_type != "cuda":
            return "segments"
        fits = [k for k in (("flex",) if kind == MIXED else ("varlen", "flex")) if takes(k)]
        return fits[0] if fits else "segments"
    if requested in ("varlen", "flex") and device_type != "cuda":
        raise ConfigError(f"attention backend {requested!r} runs on CUDA only, not on {device_type} ({kind}); "
                          "use 'segments' or 'auto'")
    if requested == "varlen" and kind == MIXED:
        raise ConfigError(f"attention backend 'varlen' cannot express {kind} on {device_type}; use 'flex' or 'auto'")
    if not takes(requested):
        raise ConfigError(f"attention backend {requested!r} cannot run heads of {head_dim} channels "
                          "(varlen: a multiple of 8 up to 256; flex: at least 16); use 'segments' or 'auto'")
    return requested
