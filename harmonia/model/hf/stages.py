"""Per-stage loading: a rank reads only the checkpoint tensors of the stage chunks it holds.

`load_module_state` maps the requested names of one module (or of its blocks ``[a, b)``) to the
checkpoint's names (`harmonia.model.hf.names`), reads exactly those tensors with
``safetensors.safe_open(...).get_tensor`` (shards located through ``model.safetensors.index.json``)
and returns them under harmonia's names, so no rank materialises the whole model.
"""

from __future__ import annotations

import torch

from harmonia.errors import ConfigError
from harmonia.model.hf.io import CheckpointFiles
from harmonia.model.hf.names import fit, module_names
from harmonia.model.hf.source import parse_source
from harmonia.model.spec import MLLMSpec


def stage_shapes(spec: MLLMSpec, module: str, layers: tuple[int, int] | None) -> dict[str, torch.Size]:
    """Names and shapes of ``build_module(spec, module, layers).state_dict()``, built on the meta device."""
    from harmonia.model.mllm import build_module

    with torch.device("meta"):
        stage = build_module(spec, module, layers)
    return {k: t.shape for k, t in stage.state_dict().items()}


def load_module_state(source, spec: MLLMSpec, module: str, layers: tuple[int, int] | None = None,
                      keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one module's stage, named as harmonia's module.

    Args:
        source: the model source `mllm_spec_from_hf` read ``spec`` from (a directory or a composition).
        spec: the MLLM spec.
        module: ``llm``, an encoder name or a projector name.
        layers: the stage's global block range ``[a, b)``; None = the whole module.
        keys: which of the stage's module-local names to read (``build_module(spec, module,
            layers).state_dict()`` keys, LoRA wrappers removed); None = all of them.

    Returns:
        name -> CPU tensor (the checkpoint's dtype), for every requested name. A composition's
        projector without a projector file has no checkpoint: the result is empty and the caller
        initialises it. Whisper's key biases, which the checkpoint lacks, come back as zeros.

    Raises:
        ConfigError: a requested name the stage does not have, or one the checkpoint lacks.
    """
    src = parse_source(source)
    located = module_names(src, spec, module)
    if located is None:
        return {}
    shapes = stage_shapes(spec, module, layers)
    wanted = set(shapes) if keys is None else set(keys)
    unknown = sorted(wanted - set(shapes))
    if unknown:
        raise ConfigError(f"{module} (layers {layers}) has no tensors {unknown[:3]}; its names are "
                          f"build_module(spec, {module!r}, {layers}).state_dict() keys")
    zeros = {k for k in wanted if k not in located.names and located.is_zero(k)}
    missing = sorted(wanted - zeros - set(located.names))
    if missing:
        raise ConfigError(f"{located.path} lacks {len(missing)} tensors of {module}, e.g. {missing[:3]}; check that "
                          "config.json matches the weights")
    read = CheckpointFiles(located.path).read(sorted({located.names[k] for k in wanted - zeros}))

    def part(k: str) -> torch.Tensor:
        t = read[located.names[k]]
        rows = located.rows(k, tuple(t.shape))
        return t if rows is None else t[rows]

    out = {k: fit(part(k), shapes[k], f"{module}.{k}") for k in wanted - zeros}
    dtype = next(iter(read.values())).dtype if read else torch.float32
    out.update({k: torch.zeros(shapes[k], dtype=dtype) for k in zeros})
    return out


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


class ModuleReader:
    """One module's checkpoint tensors, read one at a time (a rank reads only those it holds).

    Args:
        source: the model source `mllm_spec_from_hf` read ``spec`` from.
        spec: the MLLM spec.
        module: ``llm``, an encoder name or a projector name.

    Attributes:
        fresh: the module has no checkpoint (a composition's projector without a projector file).
    """

    def __init__(self, source, spec: MLLMSpec, module: str) -> None:
        self.module = module
        self.located = module_names(parse_source(source), spec, module)
        self.fresh = self.located is None
        self.files = None if self.fresh else CheckpointFiles(self.located.path)

    def holds(self, key: str) -> bool:
        """Whether the checkpoint gives module-local tensor ``key`` (zero by construction included)."""
        return not self.fresh and (key in self.located.names or self.located.is_zero(key))

    def lacking(self, keys) -> list[str]:
        """The names of ``keys`` the checkpoint does not give, sorted."""
        return sorted(k for k in keys if not self.holds(k))

    def read(self, key: str, shape: torch.Size, dtype: torch.dtype | None = None,
             index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``key`` as ``shape`` in ``dtype`` (None: as stored) on the CPU, or only its box
        ``index`` (a rank's shard: one slice per dim); only that part is read from disk.

        Raises:
            ConfigError: the checkpoint's tensor has another shape (naming the file and the tensor).
        """
        if key not in self.located.names:
            return torch.zeros(shape, dtype=dtype)[index if index is not None else ...]
        name = self.located.names[key]
        where = self.located.path / self.files.file_of[name] if self.located.path.is_dir() else self.located.path
        stored, kind = self.files.header(name)
        if kind not in FLOAT_DTYPES:
            raise ConfigError(f"{where}: tensor {name!r} ({self.module}.{key}) is stored as {kind}; harmonia trains "
                              f"from {', '.join(FLOAT_DTYPES)} weights (dequantize the checkpoint first)")
        rows = self.located.rows(key, stored)
        if rows is not None:  # a block of rows of a fused tensor: read only the box asked for
            box = index or tuple(slice(0, d) for d in shape)
            first = slice(rows.start + (box[0].start or 0), rows.start + (box[0].stop or shape[0]))
            t = self.files.read_part(name, (first, *box[1:]))
            return t if dtype is None else t.to(dtype)
        if index is not None and stored == tuple(shape):
            t = self.files.read_part(name, index)
        else:
            t = fit(self.files.read_part(name), shape, f"{where}: tensor {name!r} ({self.module}.{key})")
            t = t if index is None else t[index]
        return t if dtype is None else t.to(dtype)
