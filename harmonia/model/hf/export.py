"""Export a trained MLLM as HF checkpoints in its source's format.

`export_hf` takes the whole model's state dict (names as `harmonia.model.mllm.MLLM` has them, LoRA
adapters allowed), merges LoRA (`harmonia.model.lora.merge_lora`), renames every tensor to the
name the source checkpoint gives it (`harmonia.model.hf.names`, the same map loading uses) and
writes a copy of the source: its ``config.json`` with the written dtype, every tensor the source
has (trained ones replaced, the rest, such as a vision tower's unused last block or Whisper's
decoder, copied unchanged), shards with an index when more than one, and its tokenizer,
processor, chat template and generation files.

A composition is written as its parts: ``OUT/llm``, ``OUT/<encoder>`` (each in its source's
format), ``OUT/projectors.safetensors`` (keys ``<projector>.<name>``, e.g.
``vision_proj.linears.0.weight``, with the projector specs as JSON in the file's metadata) and
``OUT/composition.json``, so ``OUT`` is itself a model source.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.hf.io import CheckpointFiles, read_config, write_shards
from harmonia.model.hf.names import fit, module_names
from harmonia.model.hf.source import COMPOSITION_FILE, PROJECTORS_FILE, HFSource, parse_source
from harmonia.model.spec import MLLMSpec

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _set_dtype(config: dict, dtype: torch.dtype) -> dict:
    """A copy of a config with every ``dtype`` / ``torch_dtype`` field (nested configs too) set to ``dtype``."""
    out = {}
    for key, value in config.items():
        if key in ("dtype", "torch_dtype"):
            value = _dtype_name(dtype)
        elif isinstance(value, dict):
            value = _set_dtype(value, dtype)
        out[key] = value
    return out


def write_like_source(source: str | Path, out_dir: str | Path, tensors: dict[str, torch.Tensor],
                      dtype: torch.dtype, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a copy of checkpoint directory ``source`` with some tensors replaced.

    Args:
        source: the checkpoint directory whose format, config and other files are copied.
        out_dir: output directory (not ``source``).
        tensors: checkpoint name -> new value; every other tensor of ``source`` is copied.
        dtype: dtype of every floating tensor written, and the config's ``dtype``.
        max_shard_bytes: shard size.

    Returns:
        ``out_dir``.
    """
    source, out = Path(source), Path(out_dir)
    if out.resolve() == source.resolve():
        raise ConfigError(f"export directory {out} is the source checkpoint; write to a new directory")
    files = CheckpointFiles(source)
    meta = files.meta()
    unknown = sorted(set(tensors) - set(meta))
    if unknown:
        raise ConfigError(f"{source} has no tensors {unknown[:3]}: the export does not match the source's format")
    new = {k: fit(t, meta[k].shape, k) for k, t in tensors.items()}

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    def load(keys: list[str]) -> dict[str, torch.Tensor]:
        copied = files.read([k for k in keys if k not in new])
        return {k: cast(new[k] if k in new else copied[k]) for k in keys}

    out.mkdir(parents=True, exist_ok=True)
    sizes = {k: t.numel() * (dtype if t.is_floating_point() else t.dtype).itemsize for k, t in meta.items()}
    write_shards(out, sizes, load, max_shard_bytes)
    config = _set_dtype(read_config(source), dtype)
    config.setdefault("dtype", _dtype_name(dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json" and f.name not in WEIGHT_INDEXES and f.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(f, out / f.name)
    return out


def merged_state(state: dict[str, torch.Tensor], spec: MLLMSpec) -> dict[str, torch.Tensor]:
    """The whole model's state with LoRA adapters folded into their base weights (the input is not changed).

    A tied LM head that a pipeline stage held as its own copy must equal the embedding; it is dropped.
    """
    from harmonia.model.lora import apply_training, merge_lora
    from harmonia.model.mllm import build_module, state_prefix

    state = dict(state)
    if spec.llm.tie_embeddings and "llm.head.weight" in state:
        head = state.pop("llm.head.weight")
        if not torch.equal(head, state.get("llm.embed.weight", head)):
            raise ConfigError("the LLM ties its head to its embedding but the state holds two different matrices; "
                              "export the state the training kept tied")
    out = {}
    for module in spec.module_names:
        prefix = state_prefix(spec, module)
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not own:
            raise ConfigError(f"state has no tensors of module {module!r} (prefix {prefix!r}); pass the whole model")
        if any(".lora_" in k for k in own):
            with torch.device("meta"):
                built = build_module(spec, module)
            apply_training(built, spec.training_of(module))
            want = built.state_dict()
            wrong = sorted(set(want) ^ set(own)) or sorted(k for k in own if own[k].shape != want[k].shape)
            if wrong:
                raise ConfigError(f"module {module!r}: the state's LoRA adapters do not match its training mode "
                                  f"{spec.training_of(module)} (e.g. {wrong[:3]}); pass the spec it trained with")
            own = {k: v.detach().clone() if k.endswith(".base.weight") else v.detach() for k, v in own.items()}
            built.load_state_dict(own, strict=True, assign=True)
            merge_lora(built)
            own = built.state_dict()
        out.update({prefix + k: v for k, v in own.items()})
    prefixes = tuple(state_prefix(spec, m) for m in spec.module_names)
    unknown = sorted(k for k in state if not k.startswith(prefixes))
    if unknown:
        raise ConfigError(f"state has tensors of no module of {spec.name!r}: {unknown[:3]}")
    return out


def checkpoint_tensors(state: dict[str, torch.Tensor], src: HFSource, spec: MLLMSpec,
                       modules: list[str]) -> dict[str, torch.Tensor]:
    """Merged whole-model tensors of ``modules`` under their names in the source checkpoint."""
    from harmonia.model.mllm import state_prefix

    out: dict[str, torch.Tensor] = {}
    for module in modules:
        located, prefix = module_names(src, spec, module), state_prefix(spec, module)
        for key in [k for k in state if k.startswith(prefix)]:
            ours = key[len(prefix):]
            if ours not in located.names:
                if located.is_zero(ours):
                    continue  # Whisper's key bias: no such tensor, no effect on outputs
                raise ConfigError(f"{key} has no tensor in {located.path} to go to")
            name = located.names[ours]
            if name in out and not torch.equal(out[name], state[key]):
                raise ConfigError(f"{key} and another tensor both map to {name} in {located.path} but differ")
            out[name] = state[key]
    return out


def _state_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise ConfigError(f"the state mixes dtypes {sorted(map(str, dtypes))}; pass export_hf a dtype")
    return dtypes.pop()


def export_hf(state: dict[str, torch.Tensor], spec: MLLMSpec, source, out_dir: str | Path,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a trained MLLM as HF checkpoints in its source's format.

    Args:
        state: the whole model's tensors, keyed as `MLLM.state_dict` (``llm.``, ``encoders.<name>.``,
            ``projectors.<name>_proj.``), LoRA adapters included or merged.
        spec: the spec `mllm_spec_from_hf` read from ``source``.
        source: the model source training started from.
        out_dir: the output directory: the HF checkpoint of a whole multimodal source, or a
            directory of parts for a composition (see the module docstring).
        dtype: dtype of the written tensors and the configs' ``dtype``; None = the state's.
        max_shard_bytes: safetensors shard size; more than one shard gets an index file.

    Returns:
        ``out_dir``, loadable by transformers (a whole checkpoint) or by `mllm_spec_from_hf` (both).
    """
    src = parse_source(source)
    merged = merged_state(state, spec)
    dtype = dtype or _state_dtype(merged)
    out = Path(out_dir)
    if not src.is_composition:
        tensors = checkpoint_tensors(merged, src, spec, spec.module_names)
        return write_like_source(src.root, out, tensors, dtype, max_shard_bytes)
    write_like_source(src.llm, out / "llm", checkpoint_tensors(merged, src, spec, ["llm"]), dtype, max_shard_bytes)
    for name in spec.encoders:
        tensors = checkpoint_tensors(merged, src, spec, [name])
        write_like_source(src.encoders[name], out / name, tensors, dtype, max_shard_bytes)
    _write_projectors(merged, spec, out / PROJECTORS_FILE, dtype)
    listing = {"llm": "llm", "encoders": {n: n for n in spec.encoders}, "projectors": PROJECTORS_FILE}
    (out / COMPOSITION_FILE).write_text(json.dumps(listing, indent=2))
    return out


def _write_projectors(state: dict[str, torch.Tensor], spec: MLLMSpec, path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    from harmonia.model.mllm import state_prefix

    tensors = {}
    for name in spec.projectors:
        prefix = state_prefix(spec, name)
        tensors.update({f"{name}.{k[len(prefix):]}": v.detach().to(dtype).contiguous().cpu()
                        for k, v in state.items() if k.startswith(prefix)})
    specs = {name: dataclasses.asdict(p) for name, p in spec.projectors.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "harmonia.projectors": json.dumps(specs)})
