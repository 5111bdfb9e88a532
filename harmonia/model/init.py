"""Initial values of parameters one tensor at a time, identical under every layout.

A model built on the ``meta`` device and sharded there holds no values; each rank then fills only
its local shards. `initial_value` gives one parameter's whole value from a generator seeded by its
whole-model name (`name_seed`), so a rank needs no other tensor, and every rank that holds a piece
of a parameter, under any layout, holds a piece of the same tensor.

The rules are those of the modules' constructors (`harmonia.model.layers.init_weights` and the
parameters the encoders, blocks and projectors create themselves; LoRA's as `LoRALinear` sets
them); a unit test compares both for every parameter of every preset.

Rules by owner, parameter:
- ``Linear``, ``Conv1d``, ``Conv2d``, ``Conv3d``, ``Embedding`` weight: normal, std 0.02; their bias: zeros.
- ``LayerNorm`` weight and ``RMSNorm`` weight: ones; ``LayerNorm`` bias: zeros.
- a `LoRALinear`'s ``lora_a``: kaiming-uniform with ``a = sqrt(5)`` (uniform within
  ``1 / sqrt(in_features)``); ``lora_b``: zeros (a fresh adapter changes nothing).
- a module's own parameters (class token, position embeddings, layer scales, ``image_newline``):
  its class's ``param_init`` table.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from harmonia.errors import ConfigError

STD = 0.02


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the job's seed and a whole-model tensor name (stable across runs)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _normal(shape: torch.Size, std: float, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g) * std


def _rule(owner: nn.Module, parent: nn.Module | None, leaf: str, shape: torch.Size) -> tuple[str, float]:
    """``(kind, scale)``: kind ``normal`` (std ``scale``), ``uniform`` (within ``scale``), ``ones``, ``zeros``."""
    from harmonia.model.lora import LoRALinear

    if isinstance(parent, LoRALinear) and owner is parent.lora_a:
        return "uniform", 1.0 / math.sqrt(shape[1])
    if isinstance(parent, LoRALinear) and owner is parent.lora_b:
        return "zeros", 0.0
    if isinstance(owner, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)):
        return ("normal", STD) if leaf == "weight" else ("zeros", 0.0)
    if isinstance(owner, nn.LayerNorm) or any(c.__name__ == "RMSNorm" for c in type(owner).__mro__):
        return ("ones", 1.0) if leaf == "weight" else ("zeros", 0.0)
    table = getattr(owner, "param_init", {})
    if leaf in table:
        kind, scale = table[leaf]
        return kind, scale(shape) if callable(scale) else scale
    raise ConfigError(f"no initial value rule for parameter {leaf!r} of a {type(owner).__name__}; give it a "
                      "param_init entry or a checkpoint that holds it")


def initial_value(module: nn.Module, name: str, seed: int, full_name: str) -> torch.Tensor:
    """The whole initial value of ``module``'s parameter ``name``, fp32 on the CPU.

    Args:
        module: a (stage) module, possibly on ``meta`` and sharded; only its structure is read.
        name: the parameter's module-local name (``layers.3.attn.q_proj.weight``).
        seed: the job's seed.
        full_name: the parameter's whole-model name, which seeds its generator.
    """
    path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(path)
    parent = module.get_submodule(path.rpartition(".")[0]) if path else None
    shape = getattr(owner, leaf).shape  # the global shape, also of a DTensor
    kind, scale = _rule(owner, parent, leaf, shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(name_seed(seed, full_name))
    if kind == "uniform":
        return (torch.rand(shape, generator=g) * 2 - 1) * scale
    return _normal(shape, scale, g)
