"""Where an MLLM's weights come from: one multimodal HF directory, or a composition of directories.

A source is given as

- a directory holding a whole multimodal checkpoint (``LlavaForConditionalGeneration`` or
  ``LlavaNextForConditionalGeneration``), or
- a composition ``{"llm": DIR, "encoders": {"vision": DIR, "audio": DIR}}`` (the flat form
  ``{"llm": DIR, "vision": DIR, ...}`` too) of an LLM checkpoint and encoder checkpoints, whose
  projectors start fresh unless ``"projectors": FILE`` names a projector file that
  `harmonia.model.hf.export.export_hf` wrote, or
- a directory that `export_hf` wrote for a composition (it holds ``composition.json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harmonia.errors import ConfigError

COMPOSITION_FILE = "composition.json"
PROJECTORS_FILE = "projectors.safetensors"


@dataclass(frozen=True)
class HFSource:
    """A parsed model source.

    Attributes:
        root: the multimodal directory; None for a composition.
        llm: the LLM's directory (the root for a whole checkpoint).
        encoders: encoder module name -> its directory (a composition's; empty for a whole checkpoint).
        projectors: a composition's projector file, or None (fresh projectors).
    """

    root: Path | None
    llm: Path
    encoders: dict[str, Path] = field(default_factory=dict)
    projectors: Path | None = None

    @property
    def is_composition(self) -> bool:
        return self.root is None

    def dir_of(self, module: str) -> Path:
        """The checkpoint directory holding a module's tensors (encoders and LLM)."""
        if not self.is_composition:
            return self.root
        if module == "llm":
            return self.llm
        if module in self.encoders:
            return self.encoders[module]
        raise ConfigError(f"module {module!r} has no checkpoint directory in this composition; "
                          f"encoders are {sorted(self.encoders)}")


def _dir(path, what: str) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{what} {path}: no config.json there; expected an HF checkpoint directory")
    return path


def parse_source(source) -> HFSource:
    """An `HFSource` from a directory or a composition mapping; `ConfigError` names what is wrong."""
    if isinstance(source, HFSource):
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        if (path / COMPOSITION_FILE).is_file():
            listed = json.loads((path / COMPOSITION_FILE).read_text())
            return parse_source({k: (path / v if isinstance(v, str) else {n: path / d for n, d in v.items()})
                                 for k, v in listed.items()})
        return HFSource(_dir(path, "model checkpoint"), _dir(path, "model checkpoint"))
    if not isinstance(source, dict) or "llm" not in source:
        raise ConfigError(f"model source {source!r}: expected a checkpoint directory or a composition "
                          "{'llm': DIR, 'encoders': {'vision': DIR, 'audio': DIR}}")
    encoders = dict(source.get("encoders") or {})
    encoders.update({k: v for k, v in source.items() if k not in ("llm", "encoders", "projectors")})
    if not encoders:
        raise ConfigError("composition has no encoders; give {'llm': DIR, 'encoders': {'vision': DIR, ...}}")
    for name in encoders:
        if name == "llm" or name.endswith("_proj"):
            raise ConfigError(f"composition encoder name {name!r} is reserved; name encoders 'vision', 'audio', ...")
    projectors = source.get("projectors")
    if projectors is not None and not Path(projectors).is_file():
        raise ConfigError(f"composition projectors file {projectors} does not exist")
    return HFSource(None, _dir(source["llm"], "composition llm"),
                    {name: _dir(d, f"composition encoder {name!r}") for name, d in encoders.items()},
                    Path(projectors) if projectors is not None else None)
