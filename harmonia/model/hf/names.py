"""Which checkpoint tensor each of a module's tensors is, from the key lists alone (no data read).

For every module of an `MLLMSpec` built from a source (`harmonia.model.hf.source`), `module_names`
maps harmonia's module-local names (``build_module(spec, module).state_dict()`` keys, blocks by
global index) to the names in the checkpoint directory that holds them. Loading inverts nothing
and export inverts this one map, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.hf.clip import vision_names
from harmonia.model.families import FAMILIES, Family
from harmonia.model.hf.io import CheckpointFiles, read_config
from harmonia.model.hf.llama import llm_state_from_hf
from harmonia.model.hf.qwen_vision import encoder_names as qwen_encoder_names
from harmonia.model.hf.source import HFSource
from harmonia.model.hf.whisper import ZERO_KEYS, whisper_names
from harmonia.model.spec import MLLMSpec


@dataclass(frozen=True)
class ModuleNames:
    """A module's tensors in one checkpoint file set.

    Attributes:
        path: the checkpoint directory, or the projector file of a composition.
        names: our module-local name -> the checkpoint's name (tied tensors share one).
        zeros: patterns of our names with no checkpoint tensor that are zero by construction.
        parts: our names that are a block of rows of their checkpoint tensor -> ``(k, n)``: the
            ``k``-th of ``n`` equal blocks of dim 0 (q, k, v of a fused ``qkv``).
    """

    path: Path
    names: dict[str, str]
    zeros: tuple = field(default_factory=tuple)
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)

    def is_zero(self, key: str) -> bool:
        return any(p.match(key) for p in self.zeros)

    def rows(self, key: str, stored: tuple[int, ...]) -> slice | None:
        """The rows of the checkpoint tensor (of ``stored`` shape) our ``key`` is; None = all of it."""
        if key not in self.parts:
            return None
        k, n = self.parts[key]
        if stored[0] % n:
            raise ConfigError(f"{self.path}: {self.names[key]} has {stored[0]} rows, not {n} equal blocks ({key})")
        size = stored[0] // n
        return slice(k * size, (k + 1) * size)


def family_of(path: Path) -> Family:
    """The registered family of the checkpoint directory ``path`` (`harmonia.model.families`)."""
    return FAMILIES.of(read_config(path).get("model_type"), path)


def llm_names(files: CheckpointFiles, spec: MLLMSpec, family: Family) -> dict[str, str]:
    """Our LLM names -> checkpoint names, through the LLM adapter run on ``meta`` tensors (the keys
    of ``family``'s encoders and projectors left out)."""
    parts = family.non_llm_parts
    meta = {k: t for k, t in files.meta().items() if not any(part in k for part in parts)}
    source_of = {id(t): k for k, t in meta.items()}
    out = {}
    for ours, t in llm_state_from_hf(meta, spec.llm).items():
        if id(t) not in source_of:
            raise ConfigError(f"LLM tensor {ours!r} is computed from several checkpoint tensors; it cannot be read "
                              "alone (the LLM adapter transforms tensors)")
        out[ours] = source_of[id(t)]
    return out


def composition_projector_names(path: Path, module: str) -> dict[str, str]:
    """A projector file `export_hf` wrote: keys ``<module>.<our name>``."""
    keys = CheckpointFiles(path).keys()
    return {k[len(module) + 1:]: k for k in keys if k.startswith(module + ".")}


def module_names(src: HFSource, spec: MLLMSpec, module: str) -> ModuleNames | None:
    """Where module ``module``'s tensors are; None for a composition's projector without a file (fresh)."""
    if module not in spec.module_names:
        raise ConfigError(f"unknown module {module!r}; modules of {spec.name!r} are {spec.module_names}")
    if module in spec.projectors:
        if not src.is_composition:
            family = family_of(src.root)
            if family.projector_names is None:
                raise ConfigError(f"{src.root}: a {family.name} checkpoint has no projector {module!r}")
            return ModuleNames(src.root, family.projector_names(CheckpointFiles(src.root).keys(), module))
        if src.projectors is None:
            return None
        return ModuleNames(src.projectors, composition_projector_names(src.projectors, module))
    path = src.dir_of(module)
    files = CheckpointFiles(path)
    if module == "llm":
        return ModuleNames(path, llm_names(files, spec, family_of(path)))
    if spec.encoders[module].is_audio:
        return ModuleNames(path, whisper_names(files.keys()), (ZERO_KEYS,))
    if spec.encoders[module].native is not None:
        names, parts = qwen_encoder_names(files.keys(), spec.encoders[module].native)
        return ModuleNames(path, names, parts=parts)
    family = "clip" if spec.encoders[module].cls_token else "siglip"
    return ModuleNames(path, vision_names(files.keys(), family))


def fit(t: torch.Tensor, shape: torch.Size, what: str) -> torch.Tensor:
    """``t`` viewed as ``shape`` when they differ only by size-1 dims (CLIP's class embedding); else an error."""
    if t.shape == shape:
        return t
    if [d for d in t.shape if d != 1] == [d for d in shape if d != 1]:
        return t.reshape(shape)
    raise ConfigError(f"{what} has shape {tuple(t.shape)} in the checkpoint, {tuple(shape)} in the model built "
                      "from its config.json")
