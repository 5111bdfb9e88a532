"""What a model family is, and the registry that finds one from a checkpoint's ``model_type``.

A family is everything harmonia knows of one kind of HF checkpoint, held in one module: how its
completed ``config.json`` becomes an `MLLMSpec`, which of its checkpoint tensors are not the LLM's,
where its projector's tensors are, and how its processor's outputs become a training sample.
Everything else (loading stage by stage, export, planning, data) works from the spec and these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harmonia.errors import ConfigError
from harmonia.model.spec import MLLMSpec


@dataclass(frozen=True)
class Family:
    """One family of HF checkpoints.

    Attributes:
        name: what messages call it (``LLaVA``).
        model_types: the ``config.json`` ``model_type`` values it reads.
        spec: completed ``config.json`` (`harmonia.model.hf.io.read_full_config`) and a name ->
            its `MLLMSpec`; raises `ConfigError` naming any field it does not implement.
        non_llm_parts: fragments of checkpoint keys that belong to its encoders and projectors (the
            rest is the LLM's, read by the LLM adapter).
        projector_names: checkpoint keys and a projector module's name -> our projector-local names
            -> checkpoint names (`harmonia.model.hf.names.ModuleNames`); None: no projector.
        tokenized_sample: what its processor returns for one sample -> a `TokenizedSample`
            (``(spec, input_ids, pixel_values, labels, sample_id, **extra)``); None: text only.
        processor_numbers: the spec and the checkpoint directory -> the spec with the numbers of
            the checkpoint's processor files (pixel bounds); None: the config holds them all.
    """

    name: str
    model_types: tuple[str, ...]
    spec: Callable[[dict, str], MLLMSpec]
    non_llm_parts: tuple[str, ...] = ()
    projector_names: Callable[[list[str], str], dict[str, str]] | None = None
    tokenized_sample: Callable | None = None
    processor_numbers: Callable[[MLLMSpec, Path], MLLMSpec] | None = None

    @property
    def multimodal(self) -> bool:
        return self.projector_names is not None


class FamilyRegistry:
    """The families harmonia reads, by ``model_type``, and the types it refuses with a reason."""

    def __init__(self) -> None:
        self._by_type: dict[str, Family] = {}
        self._refused: dict[str, str] = {}

    def register(self, family: Family) -> None:
        """Make ``family`` known to every command (plan, train, export, data inspect, hf)."""
        for kind in family.model_types:
            if kind in self._by_type or kind in self._refused:
                raise ValueError(f"model_type {kind!r} is registered twice")
            self._by_type[kind] = family

    def refuse(self, model_type: str, what: str) -> None:
        """A ``model_type`` known not to be implemented, refused with ``what`` it is."""
        if model_type in self._by_type:
            raise ValueError(f"model_type {model_type!r} is registered and refused")
        self._refused[model_type] = what

    def is_multimodal(self, model_type: str | None) -> bool:
        """A whole multimodal checkpoint's type: a registered multimodal family's, or a refused one."""
        family = self._by_type.get(model_type)
        return model_type in self._refused or (family is not None and family.multimodal)

    def supported(self, multimodal: bool | None = None) -> tuple[str, ...]:
        """The registered ``model_type`` values (only the multimodal or only the LLM ones if asked)."""
        return tuple(sorted(k for k, f in self._by_type.items() if multimodal is None or f.multimodal == multimodal))

    def of(self, model_type: str | None, where: object) -> Family:
        """The family reading ``model_type``.

        Raises:
            ConfigError: a refused type (named, with what it is) or one no family reads.
        """
        if model_type in self._refused:
            raise ConfigError(f"{where}: model_type={model_type!r} ({self._refused[model_type]}) is not implemented; "
                              f"supported multimodal checkpoints: {self.supported(True)}")
        family = self._by_type.get(model_type)
        if family is None:
            raise ConfigError(
                f"{where}: model_type={model_type!r} is neither a supported multimodal checkpoint "
                f"{self.supported(True)} nor an LLM {self.supported(False)}; an encoder alone goes into a "
                "composition {'llm': DIR, 'encoders': {'vision': DIR}}")
        return family
