"""Reading and writing HF-format checkpoint directories (``config.json`` + safetensors), offline.

A directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Key renaming is table-driven: a table is a list of
``(hf_prefix, our_prefix)`` templates where ``{i}`` stands for a layer index, applied to the part of
each key after the checkpoint's own prefix (``model.``, ``model.encoder.``, ``vision_model.``, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from harmonia.errors import ConfigError

Table = list[tuple[str, str]]


def read_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{file} not found: an HF checkpoint directory needs config.json")
    return json.loads(file.read_text())


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or shards), on CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {path}: convert .bin checkpoints to safetensors first")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(path / name)))
    return out


def write_checkpoint(path: str | Path, state: dict[str, torch.Tensor], config: dict,
                     max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` and safetensors shards (with an index when more than one)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.detach().contiguous().cpu()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def find_prefix(state: dict[str, torch.Tensor], anchor: str, what: str) -> str:
    """The prefix of the checkpoint's keys, found from a key that must exist (``embed_tokens.weight``)."""
    for key in state:
        if key.endswith(anchor) and (key == anchor or key[-len(anchor) - 1] == "."):
            return key[: -len(anchor)]
    raise ConfigError(f"checkpoint has no key ending in {anchor!r}: it is not a {what} checkpoint")


def _compile(table: Table, hf_side: bool) -> list[tuple[re.Pattern, str]]:
    out = []
    for hf, ours in table:
        src, dst = (hf, ours) if hf_side else (ours, hf)
        pattern = re.compile("^" + re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)") + r"(?P<rest>.*)$")
        out.append((pattern, dst))
    return out


def rename(state: dict[str, torch.Tensor], table: Table, to_ours: bool, src_prefix: str = "",
           dst_prefix: str = "") -> dict[str, torch.Tensor]:
    """Rename keys by a table; keys that match no entry are dropped.

    Args:
        state: tensors keyed by source names.
        table: ``(hf_prefix, our_prefix)`` templates.
        to_ours: True renames HF -> ours, False ours -> HF.
        src_prefix: prefix stripped from source keys (keys without it are skipped).
        dst_prefix: prefix added to renamed keys.
    """
    rules = _compile(table, hf_side=to_ours)
    out = {}
    for key, t in state.items():
        if not key.startswith(src_prefix):
            continue
        rest_key = key[len(src_prefix):]
        for pattern, dst in rules:
            m = pattern.match(rest_key)
            if m:
                name = dst.replace("{i}", m.group("i")) if "i" in m.groupdict() else dst
                out[dst_prefix + name + m.group("rest")] = t
                break
    return out


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy the tensors a (stage) module owns from a converted state dict, checking nothing is missing."""
    own = module.state_dict()
    missing = sorted(k for k in own if k not in state)
    if missing:
        raise ConfigError(
            f"{what}: checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}; "
            "check that the config matches the weights"
        )
    for key, t in own.items():
        if state[key].shape != t.shape:
            raise ConfigError(f"{what}: {key} has shape {tuple(state[key].shape)} in the checkpoint, "
                              f"{tuple(t.shape)} in the model")
    module.load_state_dict({k: state[k] for k in own}, strict=True)
