"""HF checkpoints -> `MLLMSpec`: a whole checkpoint of a registered family
(`harmonia.model.families`: LLaVA, LLaVA-NeXT, an LLM alone), or a composition of an LLM checkpoint
with encoder checkpoints (CLIP / SigLIP vision, Whisper audio; fresh projectors).

Loading stage by stage and export live in `harmonia.model.hf.stages` and `harmonia.model.hf.export`
and are re-exported here: `mllm_spec_from_hf`, `load_module_state` and `export_hf` are the whole
interface a training job needs.
"""

from __future__ import annotations

from pathlib import Path

from harmonia.errors import ConfigError
from harmonia.model.families import FAMILIES
from harmonia.model.hf.clip import vision_spec_from_hf
from harmonia.model.hf.io import read_config, read_full_config
from harmonia.model.hf.llama_config import llm_spec_from_hf
from harmonia.model.hf.source import HFSource, parse_source
from harmonia.model.hf.whisper_config import whisper_spec_from_hf
from harmonia.model.presets import projector_for
from harmonia.model.spec import EncoderSpec, MLLMSpec

_LAZY = {"export_hf": "harmonia.model.hf.export", "load_module_state": "harmonia.model.hf.stages"}
__all__ = ["mllm_spec_from_hf", *_LAZY]


def __getattr__(name: str):
    """`export_hf` and `load_module_state` load torch with their modules, on first use: reading a spec
    (planning) does not."""
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'harmonia.model.hf.mllm' has no attribute {name!r}")


def mllm_spec_from_hf(source, token_merge: dict[str, int] | None = None) -> MLLMSpec:
    """The `MLLMSpec` of a whole HF checkpoint or of a composition (see `parse_source`).

    Args:
        source: a checkpoint directory of a registered family (`harmonia.model.families`: LLaVA,
            LLaVA-NeXT, or an LLM alone: an MLLM without encoders), or ``{"llm": DIR, "encoders":
            {"vision": DIR, "audio": DIR}}`` (CLIP / SigLIP vision, Whisper), or a directory
            `export_hf` wrote for a composition.
        token_merge: a composition's encoder name -> tokens merged into one LLM token (default 1).

    Raises:
        ConfigError: an unsupported ``model_type`` or a config field harmonia does not implement,
            named in the message.
    """
    src = parse_source(source)
    if src.is_composition:
        return composition_spec(src, token_merge or {})
    if token_merge:
        raise ConfigError("token_merge applies to a composition's fresh projectors, not to a whole checkpoint")
    family = FAMILIES.of(read_config(src.root).get("model_type"), src.root)
    spec = family.spec(read_full_config(src.root), src.root.name)
    return spec if family.processor_numbers is None else family.processor_numbers(spec, src.root)


def _encoder_spec(name: str, path: Path, token_merge: int) -> EncoderSpec:
    config = read_full_config(path)
    if config.get("model_type") == "whisper":
        return whisper_spec_from_hf(config, name=path.name, token_merge=token_merge)
    try:
        return vision_spec_from_hf(config, path.name, token_merge=token_merge)
    except ConfigError as e:
        raise ConfigError(f"composition encoder {name!r} at {path}: {e} (encoders: CLIP or SigLIP vision, "
                          "Whisper)") from e


def composition_spec(src: HFSource, token_merge: dict[str, int]) -> MLLMSpec:
    """LLM + encoders from their own checkpoints; InternVL-style projectors (`projector_for`)."""
    unknown = set(token_merge) - set(src.encoders)
    if unknown:
        raise ConfigError(f"token_merge for unknown encoders {sorted(unknown)}; encoders are {sorted(src.encoders)}")
    llm_config = read_full_config(src.llm)
    if FAMILIES.is_multimodal(llm_config.get("model_type")):
        raise ConfigError(f"composition llm {src.llm} is a {llm_config['model_type']!r} multimodal checkpoint; "
                          "give it as the whole source instead")
    llm = llm_spec_from_hf(llm_config, name=src.llm.name)
    encoders = {name: _encoder_spec(name, d, token_merge.get(name, 1)) for name, d in src.encoders.items()}
    projectors = {f"{n}_proj": projector_for(f"{n}_proj", e, llm) for n, e in encoders.items()}
    name = "+".join([src.llm.name, *(d.name for d in src.encoders.values())])
    return MLLMSpec(name, encoders, projectors, llm)


