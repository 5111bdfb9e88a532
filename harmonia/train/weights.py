"""Where a rank's initial weights come from: the job's seed, or HF checkpoints, one tensor at a time.

A rank's chunks are built on ``meta`` and sharded there; `chunk_values` then gives each parameter's
whole value for `harmonia.runtime.materialize.materialize`, which keeps only the rank's shard. From
a preset, every value comes from a generator seeded by the job's seed and the tensor's whole-model
name (`harmonia.model.init.initial_value`), so every layout starts from the same parameters and no
rank builds anything it does not hold. From HF checkpoints, each value is read alone from the
safetensors file that holds it (`harmonia.model.hf.stages.ModuleReader`); tensors no checkpoint holds
(fresh projectors of a composition, LoRA adapters) come from the seed the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.init import initial_value
from harmonia.model.spec import MLLMSpec


def chunk_values(module: nn.Module, spec: MLLMSpec, name: str, seed: int,
                 source: str | dict | None = None) -> Callable[[str], torch.Tensor]:
    """``(module-local tensor name, box)`` -> that box of its initial value (None: the whole value), for a
    chunk of module ``name`` (`harmonia.runtime.materialize.materialize`).

    Args:
        module: the chunk (or projector), built on ``meta`` with its training mode applied.
        spec: the MLLM.
        name: ``llm``, an encoder or a projector.
        seed: the job's seed.
        source: the HF model source; None = every value from the seed.

    Raises:
        ConfigError: the checkpoint lacks a tensor of the chunk (before anything is allocated).
    """
    from harmonia.model.hf.stages import ModuleReader
    from harmonia.model.mllm import state_prefix

    prefix = state_prefix(spec, name)
    tensors = dict([*module.named_parameters(), *module.named_buffers()])
    reader = None if source is None else ModuleReader(source, spec, name)
    if reader is not None and not reader.fresh:
        lacking = reader.lacking(unwrapped(k) for k in tensors if not is_adapter(k))
        if lacking:
            raise ConfigError(f"checkpoint lacks {len(lacking)} tensors of {name}, e.g. {lacking[:3]}; "
                              "check that config.json matches the weights")

    def value_of(key: str, box: tuple[slice, ...] | None = None) -> torch.Tensor:
        if reader is None or reader.fresh or is_adapter(key):
            whole = initial_value(module, key, seed, prefix + key)  # the generator makes it whole
            return whole if box is None else whole[box]
        return reader.read(unwrapped(key), tensors[key].shape, None, box)  # the stored dtype: the fill converts

    return value_of


def unwrapped(key: str) -> str:
    """The plain-linear name of a LoRA-wrapped weight (``q_proj.base.weight`` -> ``q_proj.weight``)."""
    return key.replace(".base.", ".")


def is_adapter(key: str) -> bool:
    """Whether a module-local tensor name is a LoRA adapter's (not in any source checkpoint)."""
    return ".lora_a." in key or ".lora_b." in key


def initial_model(spec: MLLMSpec, seed: int, source: str | dict | None = None) -> nn.Module:
    """The whole MLLM with the job's initial weights, in one process (held-out evaluation, export,
    the tests' reference): the same values as every layout's ranks start from."""
    from harmonia.model.mllm import build_mllm_model
    from harmonia.runtime.materialize import materialize

    with torch.device("meta"):
        model = build_mllm_model(spec)
    for name in spec.module_names:
        module = model.module(name)
        materialize(module, torch.device("cpu"), chunk_values(module, spec, name, seed, source))
    return model


def initial_state(spec: MLLMSpec, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial weights from the seed (LoRA adapters included): `initial_model`'s."""
    return initial_model(spec, seed).state_dict()
