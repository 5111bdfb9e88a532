"""Reading and writing HF-format checkpoint directories (``config.json`` + safetensors), offline.

A directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Key renaming is table-driven: a table is a list of
``(hf_prefix, our_prefix)`` templates where ``{i}`` stands for a layer index, applied to the part of
each key after the checkpoint's own prefix (``model.``, ``model.encoder.``, ``vision_model.``, ...).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from harmonia.errors import ConfigError

if TYPE_CHECKING:  # torch loads when a tensor is read or written, not when a config is (planning)
    import torch

Table = list[tuple[str, str]]


def read_config(path: str | Path) -> dict:
    """``config.json`` of a checkpoint directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{file} not found: an HF checkpoint directory needs config.json")
    return json.loads(file.read_text())


def read_full_config(path: str | Path) -> dict:
    """``config.json`` with every field transformers fills in by default (nested configs included).

    Hub configs often list only what differs from the defaults (LLaVA-1.5's text config has no
    ``hidden_size``); the adapters read the completed dict so nothing is guessed.
    """
    raw = read_config(path)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path)).to_dict()
    except Exception as e:  # transformers and huggingface_hub raise several kinds for a bad config
        raise ConfigError(f"{path}: transformers cannot read config.json (model_type="
                          f"{raw.get('model_type')!r}): {e}") from e


_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@cache
def safetensors_dtypes() -> dict:
    """torch dtype -> its safetensors name (``torch.bfloat16`` -> ``BF16``)."""
    import torch

    return {getattr(torch, name): code for code, name in _DTYPE_NAMES.items()}


def torch_dtype(code: str):
    """The torch dtype of a safetensors dtype name (float32 for one torch lacks)."""
    import torch

    return getattr(torch, _DTYPE_NAMES.get(code, "float32"))


def _keys(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{file}: not a readable safetensors file ({e}); it is truncated or corrupt") from e


class CheckpointFiles:
    """The tensors of a checkpoint directory, read one by one: headers first, data only when asked.

    Args:
        path: directory with ``model.safetensors`` or shards listed in ``model.safetensors.index.json``,
            or one ``.safetensors`` file.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path.parent if path.is_file() else path
        self._handles: dict[Path, object] = {}
        index = self.path / "model.safetensors.index.json"
        if path.is_dir() and index.is_file():
            self.file_of = dict(json.loads(index.read_text())["weight_map"])
        else:
            self.file_of = {}
            files = [path.name] if path.is_file() else sorted(p.name for p in self.path.glob("*.safetensors"))
            for file in files:
                self.file_of.update({k: file for k in _keys(self.path / file)})
        if not self.file_of:
            raise ConfigError(f"no *.safetensors in {self.path}: convert .bin checkpoints to safetensors first")

    def keys(self) -> list[str]:
        return list(self.file_of)

    def check(self) -> None:
        """Read every file's header (sizes checked against the file): a truncated or corrupt file is
        a `ConfigError` naming it, before anything is built."""
        for file in sorted(set(self.file_of.values())):
            _keys(self.path / file)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a ``meta`` tensor of its shape and dtype (headers only, no data read)."""
        import torch
        from safetensors import safe_open

        out = {}
        for file in sorted(set(self.file_of.values())):
            with safe_open(str(self.path / file), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    out[key] = torch.empty(sl.get_shape(), dtype=torch_dtype(sl.get_dtype()),
                                           device="meta")
        return out

    def read(self, keys) -> dict[str, torch.Tensor]:
        """The named tensors, on CPU; only these are read from disk."""
        return {key: self.read_part(key) for key in keys}

    def read_part(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``key``, or only its box ``index`` (one slice per dim), on CPU; only that part is read.

        Raises:
            ConfigError: no such tensor, or its file cannot be read (truncated, corrupt), naming both.
        """
        from safetensors import SafetensorError

        if key not in self.file_of:
            raise ConfigError(f"{self.path} has no tensor {key!r}; check that config.json matches the weights")
        file = self.path / self.file_of[key]
        try:
            f = self._open(file)
            return f.get_tensor(key) if index is None else f.get_slice(key)[index]
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{file}: cannot read tensor {key!r} ({e}); the file is truncated or corrupt") from e

    def _open(self, file: Path):
        """The file's reader, opened once (its header parsed once) for all the tensors read from it."""
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def header(self, key: str) -> tuple[tuple[int, ...], str]:
        """The stored shape and safetensors dtype (``BF16``, ``F32``, ...) of tensor ``key``."""
        from safetensors import SafetensorError

        file = self.path / self.file_of[key]
        try:
            sl = self._open(file).get_slice(key)
            return tuple(sl.get_shape()), sl.get_dtype()
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{file}: cannot read the header of {key!r} ({e}); the file is truncated or corrupt") from e


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or shards), on CPU."""
    files = CheckpointFiles(path)
    return files.read(files.keys())


def write_checkpoint(path: str | Path, state: dict[str, torch.Tensor], config: dict,
                     max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` and safetensors shards (with an index when more than one)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    layout = {k: (t.dtype, tuple(t.shape)) for k, t in state.items()}
    write_shards(path, layout, lambda keys: {k: state[k] for k in keys}, max_shard_bytes)


WRITE_BATCH_BYTES = 256 * 2**20
"""Bytes of tensors asked for at once while a safetensors file is written: a writer holds one batch
(and what its ``load`` computes for it), never a whole file."""

Layout = dict[str, tuple["torch.dtype", tuple[int, ...]]]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def write_shards(path: Path, layout: Layout, load, max_shard_bytes: int = 5 * 2**30,
                 batch_bytes: int = WRITE_BATCH_BYTES) -> None:
    """Write tensors as ``model.safetensors``, or shards with ``model.safetensors.index.json``.

    Args:
        path: output directory (stale safetensors files there are removed first).
        layout: tensor name -> (dtype, shape) as written, in the order to write; shards are cut at
            ``max_shard_bytes``.
        load: names -> their tensors, asked for ``batch_bytes`` at a time (`write_safetensors`).
        max_shard_bytes: the largest shard, unless one tensor is larger.
        batch_bytes: bytes of tensors asked for at once.
    """
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    sizes = {k: _nbytes(*v) for k, v in layout.items()}
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))])
    for name, keys in zip(names, shards):
        write_safetensors(path / name, {k: layout[k] for k in keys}, load, batch_bytes)
    if len(shards) > 1:
        weight_map = {k: name for name, keys in zip(names, shards) for k in keys}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_safetensors(file: Path, layout: Layout, load, batch_bytes: int = WRITE_BATCH_BYTES) -> None:
    """One safetensors file, written tensor by tensor: the header from ``layout``, then each batch's
    bytes as ``load`` gives it, so at most one batch is in memory. The file appears complete or not
    at all (written beside, then renamed).

    Raises:
        ConfigError: a loaded tensor whose dtype or shape is not its ``layout`` entry.
    """
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, (dtype, shape) in layout.items():
        if dtype not in safetensors_dtypes():
            raise ConfigError(f"{file}: tensor {key!r} of dtype {dtype} cannot be written to safetensors")
        n = _nbytes(dtype, shape)
        header[key] = {"dtype": safetensors_dtypes()[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    partial = file.with_name(file.name + ".partial")
    try:
        with open(partial, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            for batch in _batches(list(layout), {k: _nbytes(*v) for k, v in layout.items()}, batch_bytes):
                tensors = load(batch)
                for key in batch:
                    out.write(_tensor_bytes(tensors[key], key, layout[key], file))
                del tensors
        partial.replace(file)
    finally:
        partial.unlink(missing_ok=True)


def _tensor_bytes(t: torch.Tensor, key: str, want: tuple[torch.dtype, tuple[int, ...]], file: Path) -> memoryview:
    """A tensor's bytes as safetensors stores them (little-endian, row-major), without a copy where
    it is already contiguous on the CPU."""
    import torch

    if (t.dtype, tuple(t.shape)) != want:
        raise ConfigError(f"{file}: tensor {key!r} is {t.dtype} {tuple(t.shape)}, expected {want[0]} {want[1]}")
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _batches(keys: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """``keys`` in order, cut into batches of at most ``limit`` bytes (a larger tensor alone)."""
    batches: list[list[str]] = [[]]
    total = 0
    for key in keys:
        if batches[-1] and total + sizes[key] > limit:
            batches.append([])
            total = 0
        batches[-1].append(key)
        total += sizes[key]
    return [b for b in batches if b]


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
