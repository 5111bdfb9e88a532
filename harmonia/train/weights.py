"""Where a rank's initial weights come from: the job's seed, or HF checkpoints.

From a preset, every rank builds the whole model's initial weights from the seed (small models,
identical everywhere) and keeps its chunks' (`initial_state`). From HF
checkpoints, each rank reads only the tensors of its own stage chunks and projectors
(`harmonia.model.hf.stages.load_module_state`, safetensors slices); tensors no checkpoint holds
(fresh projectors of a composition, LoRA adapters) are initialised per submodule from a seed derived
from the job's seed and the submodule's whole-model name, so every rank that holds a chunk, under
any layout, starts from the same values.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from harmonia.errors import ConfigError
from harmonia.model.lora import LoRALinear
from harmonia.model.spec import MLLMSpec


def initial_state(spec: MLLMSpec, seed: int) -> dict[str, torch.Tensor]:
    """The whole model's initial weights from the seed (LoRA adapters included), identical on every rank."""
    from harmonia.model.mllm import build_mllm_model

    torch.manual_seed(seed)
    return build_mllm_model(spec).state_dict()


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the job's seed and a whole-model submodule name (stable across runs)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _reset(sub: nn.Module, parent: nn.Module | None, name: str) -> None:
    if isinstance(parent, LoRALinear) and sub is parent.lora_b:
        nn.init.zeros_(sub.weight)  # a fresh adapter changes nothing
    elif hasattr(sub, "reset_parameters"):
        sub.reset_parameters()
    elif type(sub).__name__ == "RMSNorm":
        nn.init.ones_(sub.weight)
    else:
        raise ConfigError(f"{name}: no checkpoint tensor and no initialiser for a {type(sub).__name__}; "
                          "give a checkpoint that holds it")


@torch.no_grad()
def init_missing(module: nn.Module, prefix: str, loaded: set[str], seed: int) -> list[str]:
    """Initialise, in place, every submodule with a parameter that no checkpoint provided.

    Args:
        module: a stage chunk or projector, with its training mode applied.
        prefix: the module's whole-model name prefix (``projectors.vision_proj.``).
        loaded: module-local names of the tensors read from a checkpoint.
        seed: the job's seed.

    Returns:
        module-local names of the parameters initialised here.
    """
    parents = {id(child): mod for mod in module.modules() for child in mod.children()}
    fresh = []
    for name, sub in module.named_modules():
        own = [f"{name}.{n}" if name else n for n, _ in sub.named_parameters(recurse=False)]
        missing = [n for n in own if n not in loaded]
        if not missing:
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, prefix + name))
            _reset(sub, parents.get(id(sub)), prefix + name)
        fresh += missing
    return fresh


def load_checkpoint_chunk(module: nn.Module, spec: MLLMSpec, source: str | dict, name: str,
                          layers: tuple[int, int] | None, prefix: str, seed: int) -> list[str]:
    """Fill a chunk of module ``name`` (blocks ``layers``) from the checkpoint, the rest from the seed.

    Returns:
        the module-local names of the parameters that did not come from a checkpoint.
    """
    from harmonia.model.hf.stages import load_module_state

    own = module.state_dict()
    base = {k: v for k, v in own.items() if not is_adapter(k)}
    state = load_module_state(source, spec, name, layers, set(unwrapped(k) for k in base))
    rewrapped = {k: state[unwrapped(k)] for k in base if unwrapped(k) in state}
    for key, t in rewrapped.items():
        if t.shape != own[key].shape:
            raise ConfigError(f"{prefix}{key} has shape {tuple(t.shape)} in the checkpoint, "
                              f"{tuple(own[key].shape)} in the model built from its config.json")
    module.load_state_dict(rewrapped, strict=False)
    fresh_projector = name.endswith("_proj") and not rewrapped  # a composition's projector starts fresh
    lacking = [k for k in base if k not in rewrapped]
    if lacking and not fresh_projector:
        raise ConfigError(f"checkpoint lacks {len(lacking)} tensors of {name}, e.g. {lacking[:3]}; "
                          "check that config.json matches the weights")
    return init_missing(module, prefix, set(rewrapped), seed)


def unwrapped(key: str) -> str:
    """The plain-linear name of a LoRA-wrapped weight (``q_proj.base.weight`` -> ``q_proj.weight``)."""
    return key.replace(".base.", ".")


def is_adapter(key: str) -> bool:
    """Whether a module-local tensor name is a LoRA adapter's (not in any source checkpoint)."""
    return ".lora_a." in key or ".lora_b." in key


def initial_model(config, spec: MLLMSpec) -> nn.Module:
    """The whole MLLM with the job's initial weights, in one process (held-out evaluation, export):
    the seed's for presets, the checkpoints' (fresh tensors from the seed) for HF sources."""
    from harmonia.model.mllm import build_mllm_model, state_prefix

    model = build_mllm_model(spec)
    if not config.model.from_checkpoint:
        model.load_state_dict(initial_state(spec, config.train.seed))
        return model
    for name in spec.module_names:
        load_checkpoint_chunk(model.module(name), spec, config.model.source, name, None, state_prefix(spec, name),
                              config.train.seed)
    return model
