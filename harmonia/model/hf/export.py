"""Export a trained MLLM as HF checkpoints in its source's format.

`export_hf` takes the whole model's state (names as `harmonia.model.mllm.MLLM` has them, LoRA
adapters allowed; a dict or a lazy `harmonia.model.hf.lazy.LazyTensors`), merges LoRA
(``W + scale * B A``, as `harmonia.model.lora.LoRALinear.merged_weight`), renames every tensor to the
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
from collections.abc import Mapping
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.hf.io import CheckpointFiles, read_config, write_shards
from harmonia.model.hf.lazy import LazyTensors, dtypes_of, load_many
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


def write_like_source(source: str | Path, out_dir: str | Path, tensors: Mapping[str, torch.Tensor],
                      dtype: torch.dtype, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a copy of checkpoint directory ``source`` with some tensors replaced.

    Args:
        source: the checkpoint directory whose format, config and other files are copied.
        out_dir: output directory (not ``source``).
        tensors: checkpoint name -> new value (read one output shard at a time); every other tensor of
            ``source`` is copied.
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

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    def load(keys: list[str]) -> dict[str, torch.Tensor]:  # one batch of an output file's tensors, only those
        new = load_many(tensors, [k for k in keys if k in tensors])
        copied = files.read([k for k in keys if k not in tensors])
        return {k: cast(fit(new[k], meta[k].shape, k) if k in new else copied[k]) for k in keys}

    out.mkdir(parents=True, exist_ok=True)
    layout = {k: (dtype if t.is_floating_point() else t.dtype, tuple(t.shape)) for k, t in meta.items()}
    write_shards(out, layout, load, max_shard_bytes)
    config = _set_dtype(read_config(source), dtype)
    config.setdefault("dtype", _dtype_name(dtype))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for f in source.iterdir():
        if f.is_file() and f.name != "config.json" and f.name not in WEIGHT_INDEXES and f.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(f, out / f.name)
    return out


def merged_state(state: Mapping[str, torch.Tensor], spec: MLLMSpec) -> LazyTensors:
    """The whole model's tensors with LoRA adapters folded into their base weights, computed as asked
    for (``W + scale * B A`` per adapted linear; the input is not changed).

    A tied LM head that a pipeline stage held as its own copy must equal the embedding; it is dropped.
    """
    from harmonia.model.mllm import state_prefix

    keys = list(state)
    if spec.llm.tie_embeddings and "llm.head.weight" in state:
        keys.remove("llm.head.weight")
        pair = load_many(state, ["llm.head.weight", "llm.embed.weight"] if "llm.embed.weight" in state
                         else ["llm.head.weight"])
        if not torch.equal(pair["llm.head.weight"], pair.get("llm.embed.weight", pair["llm.head.weight"])):
            raise ConfigError("the LLM ties its head to its embedding but the state holds two different matrices; "
                              "export the state the training kept tied")
    prefixes = tuple(state_prefix(spec, m) for m in spec.module_names)
    unknown = sorted(k for k in keys if not k.startswith(prefixes))
    if unknown:
        raise ConfigError(f"state has tensors of no module of {spec.name!r}: {unknown[:3]}")
    scales: dict[str, float] = {}  # merged weight name -> its adapter's scale
    for module in spec.module_names:
        prefix = state_prefix(spec, module)
        own = [k[len(prefix):] for k in keys if k.startswith(prefix)]
        if not own:
            raise ConfigError(f"state has no tensors of module {module!r} (prefix {prefix!r}); pass the whole model")
        if any(".lora_" in k for k in own):
            scales.update({prefix + k: s for k, s in _adapter_scales(spec, module, own).items()})
    parts = {}  # merged name -> the state's names it is computed from
    for key in keys:
        if ".lora_" in key:
            continue
        merged = key.replace(".base.", ".")
        if merged in scales:
            linear = key[: -len(".base.weight")]
            parts[merged] = [key, f"{linear}.lora_a.weight", f"{linear}.lora_b.weight"]
        else:
            parts[merged] = [key]

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        raw = load_many(state, [k for n in names for k in parts[n]])
        out = {}
        for n in names:
            if n in scales:
                base, a, b = (raw[k] for k in parts[n])
                out[n] = (base.float() + scales[n] * (b.float() @ a.float())).to(base.dtype)
            else:
                out[n] = raw[parts[n][0]]
        return out

    dtypes = dtypes_of(state)
    merged_dtypes = None if dtypes is None else {n: dtypes[p[0]] for n, p in parts.items()}
    return LazyTensors(parts, load, merged_dtypes)


def _adapter_scales(spec: MLLMSpec, module: str, own: list[str]) -> dict[str, float]:
    """Module-local merged weight name -> scale of each LoRA adapter, checking the state's names
    against the module's training mode."""
    from harmonia.model.lora import LoRALinear, apply_training
    from harmonia.model.mllm import build_module

    with torch.device("meta"):
        built = build_module(spec, module)
    apply_training(built, spec.training_of(module))
    wrong = sorted(set(built.state_dict()) ^ set(own))
    if wrong:
        raise ConfigError(f"module {module!r}: the state's LoRA adapters do not match its training mode "
                          f"{spec.training_of(module)} (e.g. {wrong[:3]}); pass the spec it trained with")
    return {f"{name}.weight": sub.scale for name, sub in built.named_modules() if isinstance(sub, LoRALinear)}


def checkpoint_tensors(state: Mapping[str, torch.Tensor], src: HFSource, spec: MLLMSpec,
                       modules: list[str]) -> LazyTensors:
    """Merged whole-model tensors of ``modules`` under their names in the source checkpoint."""
    from harmonia.model.mllm import state_prefix

    ours_of: dict[str, list[str]] = {}  # checkpoint name -> our names (tied tensors, or row blocks: several)
    blocks: set[str] = set()  # checkpoint names made of our tensors' rows, in block order
    for module in modules:
        located, prefix = module_names(src, spec, module), state_prefix(spec, module)
        for key in [k for k in state if k.startswith(prefix)]:
            ours = key[len(prefix):]
            if ours not in located.names:
                if located.is_zero(ours):
                    continue  # Whisper's key bias: no such tensor, no effect on outputs
                raise ConfigError(f"{key} has no tensor in {located.path} to go to")
            ours_of.setdefault(located.names[ours], []).append(key)
            if ours in located.parts:
                blocks.add(located.names[ours])
                ours_of[located.names[ours]].sort(key=lambda k: located.parts[k[len(prefix):]][0])

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        raw = load_many(state, [k for n in names for k in ours_of[n]])
        out = {}
        for n in names:
            if n in blocks:
                out[n] = torch.cat([raw[k] for k in ours_of[n]])  # (n * rows, ...) in block order
                continue
            first, *others = ours_of[n]
            for other in others:
                if not torch.equal(raw[first], raw[other]):
                    raise ConfigError(f"{first} and {other} both map to {n} but differ")
            out[n] = raw[first]
        return out

    dtypes = dtypes_of(state)
    return LazyTensors(ours_of, load, None if dtypes is None else {n: dtypes[k[0]] for n, k in ours_of.items()})


def _state_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    dtypes = dtypes_of(state)
    if dtypes is None:
        raise ConfigError("the state's dtypes are not known before reading it; pass export_hf a dtype")
    floating = {d for d in dtypes.values() if d.is_floating_point}
    if len(floating) != 1:
        raise ConfigError(f"the state mixes dtypes {sorted(map(str, floating))}; pass export_hf a dtype")
    return floating.pop()


def export_hf(state: Mapping[str, torch.Tensor], spec: MLLMSpec, source, out_dir: str | Path,
              dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a trained MLLM as HF checkpoints in its source's format.

    Args:
        state: the whole model's tensors, keyed as `MLLM.state_dict` (``llm.``, ``encoders.<name>.``,
            ``projectors.<name>_proj.``), LoRA adapters included or merged: a dict, or a
            `LazyTensors` read one output shard at a time (then peak memory is about one shard).
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
        own = load_many(state, [k for k in state if k.startswith(prefix)])
        tensors.update({f"{name}.{k[len(prefix):]}": v.detach().to(dtype).contiguous().cpu() for k, v in own.items()})
    specs = {name: dataclasses.asdict(p) for name, p in spec.projectors.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "harmonia.projectors": json.dumps(specs)})
