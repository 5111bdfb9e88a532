"""Export LoRA adapters as a PEFT adapter directory, for the HF checkpoint training started from.

``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT writes them: each adapted linear's
``lora_A`` / ``lora_B`` under ``base_model.model.<module path>``, the module path being where
transformers loads its weight's checkpoint tensor (`module_paths`; the checkpoint names come from the
map loading and export use, `harmonia.model.hf.names`); ``target_modules`` lists those paths exactly, so PEFT adapts nothing
else; ``rank_pattern`` / ``alpha_pattern`` hold the modules whose rank or alpha differ from the
first's. ``peft.PeftModel.from_pretrained(base, DIR)`` then computes harmonia's logits.

A module trained fully beside the adapters (LLaVA's projector, as LoRA recipes train it) goes in the
adapter as PEFT's ``modules_to_save``: the transformers modules its tensors load into (the fewest
holding exactly them, `_saved_modules`) are listed, and its trained tensors are written under
``base_model.model.<its parameter path>``, as PEFT saves a ``ModulesToSaveWrapper``. A model trained
without LoRA, a fully trained module whose tensors fill no module of their own or load through a
conversion, and an adapted linear that is part of a fused checkpoint tensor (a Qwen-VL tower's
``qkv``) are refused; export the merged model instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from harmonia.errors import ConfigError
from harmonia.model.hf.lazy import load_many
from harmonia.model.hf.names import module_names
from harmonia.model.hf.source import parse_source
from harmonia.model.spec import MLLMSpec
from harmonia.model.training_mode import Trainability

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _adapted(state: Mapping[str, torch.Tensor], spec: MLLMSpec, source,
             loading: _Loading) -> dict[str, tuple[str, str]]:
    """Module path of the adapted linear in transformers' model -> (our ``lora_a`` key, our module
    name), for every adapter."""
    from harmonia.model.mllm import state_prefix

    src = parse_source(source)
    out = {}
    for module in [m for m in spec.module_names if spec.training_of(m).mode is Trainability.LORA]:
        located, prefix = module_names(src, spec, module), state_prefix(spec, module)
        for key in [k for k in state if k.startswith(prefix) and k.endswith(".lora_a.weight")]:
            merged = key[len(prefix):].removesuffix(".lora_a.weight") + ".weight"
            if merged in located.parts:
                raise ConfigError(f"{module}.{merged} is a block of rows of {located.names[merged]} in the checkpoint; "
                                  "PEFT cannot adapt part of a fused tensor: export the merged model instead")
            out[located.names[merged]] = (key, module)
    paths = module_paths(sorted(out), loading)
    return {paths[weight]: adapted for weight, adapted in out.items()}


def _check_trainable(spec: MLLMSpec, source) -> None:
    if parse_source(source).is_composition:
        raise ConfigError("an adapter export is for one HF checkpoint; a composition's parts are separate models "
                          "(export the merged model instead)")
    if not any(spec.training_of(m).mode is Trainability.LORA for m in spec.module_names):
        raise ConfigError("the model was trained without LoRA adapters: there is no adapter to export")


class _Loading:
    """How transformers loads the checkpoint ``root``: its model built on ``meta`` from the config, and
    each checkpoint tensor's name in that model (older checkpoints name tensors otherwise than today's
    modules: LLaVA's ``language_model.model.*`` is ``model.language_model.*``; PEFT finds modules by
    their path in the model)."""

    def __init__(self, root: Path) -> None:
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        config = transformers.AutoConfig.from_pretrained(str(root))
        self.arch = (config.architectures or [None])[0]
        cls = getattr(transformers, self.arch or "", None)
        if cls is None:
            raise ConfigError(f"{root}/config.json names no transformers architecture ({self.arch!r}) to put the "
                              "adapter on")
        with torch.device("meta"):
            self.model = cls._from_config(config)
        transforms = get_model_conversion_mapping(self.model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        self.meta = self.model.state_dict()
        self.modules = dict(self.model.named_modules())

    def loaded(self, weight: str) -> str:
        """The model's name of checkpoint tensor ``weight``."""
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(weight, self.renamings, self.converters, self.model.base_model_prefix, self.meta)[0]

    def converted(self, weight: str) -> bool:
        """Whether loading ``weight`` converts it (a fused or split tensor), beyond renaming it."""
        from transformers.core_model_loading import rename_source_key

        renamed = rename_source_key(weight, self.renamings, [], self.model.base_model_prefix, self.meta)[0]
        return renamed != self.loaded(weight) or renamed not in self.meta


def module_paths(weights: list[str], loading: _Loading) -> dict[str, str]:
    """Checkpoint weight name -> the module path of the linear transformers loads it into, in the model
    ``loading`` builds: PEFT adapts modules by their path.

    Raises:
        ConfigError: a weight that loads into no linear.
    """
    out = {}
    for weight in weights:
        loaded = loading.loaded(weight)
        path = loaded.removesuffix(".weight")
        if not isinstance(loading.modules.get(path), torch.nn.Linear):
            raise ConfigError(f"checkpoint tensor {weight!r} loads into {loaded!r}, which is not the weight of a linear "
                              f"of {loading.arch}: PEFT cannot adapt it; export the merged model instead")
        out[weight] = path
    return out


def _saved_modules(state: Mapping[str, torch.Tensor], spec: MLLMSpec, source,
                   loading: _Loading) -> tuple[list[str], dict[str, torch.Tensor]]:
    """PEFT's ``modules_to_save`` for the modules trained fully beside the adapters, and their trained
    tensors under the names PEFT saves them with (``base_model.model.<parameter path>``): per module,
    the transformers modules holding exactly its tensors (`_covering_modules`).

    Raises:
        ConfigError: a module whose tensors load through a conversion, or share their module with
            tensors it did not train.
    """
    from harmonia.model.hf.export import checkpoint_tensors

    full = [m for m in spec.module_names if spec.training_of(m).mode is Trainability.FULL]
    if not full:
        return [], {}
    src = parse_source(source)
    paths, tensors = [], {}
    for module in full:
        named = checkpoint_tensors(state, src, spec, [module])
        converted = [w for w in named if loading.converted(w)]
        if converted:
            raise ConfigError(f"{module} trains fully and its tensor {converted[0]!r} loads through a conversion: an "
                              "adapter cannot hold it; freeze the module, give it LoRA, or export the merged model")
        loaded = {w: loading.loaded(w) for w in named}
        covering = _covering_modules(set(loaded.values()), loading.meta)
        if covering is None:
            raise ConfigError(f"{module} trains fully but its tensors fill no modules of {loading.arch} of their own "
                              "(a module holds some of them beside tensors it did not train): an adapter cannot save "
                              "it; freeze it, give it LoRA, or export the merged model instead")
        paths += covering
        values = named.load(list(named))
        tensors.update({f"base_model.model.{loaded[w]}": values[w] for w in named})
    return sorted(paths), tensors


def export_peft_adapter(state: Mapping[str, torch.Tensor], spec: MLLMSpec, source, out_dir: str | Path,
                        dtype: torch.dtype | None = None) -> Path:
    """Write the LoRA adapters of a trained model as a PEFT adapter directory.

    Args:
        state: the whole model's tensors as `harmonia.model.mllm.MLLM` names them, adapters included.
        spec: the spec the model trained with (its LoRA settings).
        source: the HF checkpoint directory training started from (the adapter's base model).
        out_dir: a new or empty directory.
        dtype: dtype of the written adapters; None = as held.

    Raises:
        ConfigError: see the module docstring.
    """
    from safetensors.torch import save_file

    _check_trainable(spec, source)
    loading = _Loading(parse_source(source).root)  # transformers' model on meta: built once
    adapted = _adapted(state, spec, source, loading)
    saved, full = _saved_modules(state, spec, source, loading)
    raw = load_many(state, [k for key, _ in adapted.values() for k in (key, key.replace(".lora_a.", ".lora_b."))])
    tensors = {}
    for path, (key, _) in adapted.items():
        for ours, theirs in ((key, "lora_A"), (key.replace(".lora_a.", ".lora_b."), "lora_B")):
            tensors[f"base_model.model.{path}.{theirs}.weight"] = raw[ours]
    tensors = {k: (t.detach().cpu() if dtype is None else t.detach().cpu().to(dtype)).contiguous()
               for k, t in {**tensors, **full}.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = _adapter_config(spec, adapted, source, saved)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def _covering_modules(trained: set[str], meta: Mapping[str, torch.Tensor]) -> list[str] | None:
    """The fewest module paths whose tensors (``meta``'s keys under them) are exactly ``trained``: each
    trained tensor's highest ancestor module holding nothing else (LLaVA's LLM: ``model.language_model``
    and ``lm_head``); None where a trained tensor's own module holds an untrained one too."""
    held: dict[str, set[str]] = {}  # module path -> the tensors under it
    for k in meta:
        parts = k.split(".")[:-1]
        for depth in range(1, len(parts) + 1):
            held.setdefault(".".join(parts[:depth]), set()).add(k)
    out = set()
    for key in trained:
        parts = key.split(".")[:-1]
        best = None
        for depth in range(len(parts), 0, -1):  # from the tensor's own module up
            path = ".".join(parts[:depth])
            if not held.get(path, set()) <= trained:
                break
            best = path
        if best is None:
            return None
        out.add(best)
    return sorted(out)


def _adapter_config(spec: MLLMSpec, adapted: dict[str, tuple[str, str]], source, saved: list[str]) -> dict:
    """PEFT's ``LoraConfig`` as JSON: the first adapter's rank and alpha, the others' where they differ,
    and the fully trained modules' paths (``saved``) as ``modules_to_save``."""
    settings = {path: spec.training_of(module) for path, (_, module) in adapted.items()}
    first = next(iter(settings.values()))
    alpha = lambda t: t.lora_rank if t.lora_alpha is None else t.lora_alpha  # noqa: E731
    return {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": str(Path(parse_source(source).root).resolve()),
        "r": first.lora_rank, "lora_alpha": alpha(first),
        "lora_dropout": max(t.lora_dropout for t in settings.values()),
        "target_modules": sorted(adapted), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": saved or None, "use_rslora": False, "use_dora": False,
        "rank_pattern": {p: t.lora_rank for p, t in settings.items() if t.lora_rank != first.lora_rank},
        "alpha_pattern": {p: alpha(t) for p, t in settings.items() if alpha(t) != alpha(first)},
    }
