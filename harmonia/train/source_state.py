"""What a training checkpoint need not hold: the frozen tensors its HF source already gives.

A job trained from HF checkpoints with frozen modules, or with LoRA adapters on a frozen base, never
changes those weights: every rank reads them from the source when it builds
(`harmonia.train.rank.build_rank_model`), the export reads them from there too
(`harmonia.train.export.with_source_frozen`). So a checkpoint holds only what training changes —
trained weights, adapters, optimizer states — and a 70B LoRA run saves megabytes per checkpoint,
not the base model again (`source_provided`).

That makes the checkpoint depend on the source's content, not only its path: `source_digest` is
part of the run's fingerprint (`harmonia.train.preflight.run_fingerprint`), so a resume or an export
against a source whose files changed is refused instead of combining adapters with another base.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from harmonia.errors import ConfigError

DIGEST_BLOCKS = 16  # 64 KiB blocks sampled across each safetensors file, beside its header
BLOCK = 64 * 1024


def source_provided(spec, source: str | dict | None, names: Iterable[str], trained: Iterable[str]) -> set[str]:
    """The whole-model names of ``names`` that the HF ``source`` gives and training never changes.

    Args:
        spec: the `harmonia.model.spec.MLLMSpec` built from ``source``.
        source: the model source (an HF directory or a composition); None: a preset, nothing given.
        names: whole-model tensor names (``llm.blocks.0.attn.q.base.weight``).
        trained: the names that train (their values are the checkpoint's).
    """
    from harmonia.model.hf.stages import ModuleReader
    from harmonia.model.mllm import state_prefix
    from harmonia.model.training_mode import Trainability
    from harmonia.train.weights import is_adapter, unwrapped

    if source is None:
        return set()
    readers = [(state_prefix(spec, m), ModuleReader(source, spec, m)) for m in spec.module_names
               if spec.training_of(m).mode is not Trainability.FULL]
    trained, out = set(trained), set()
    for name in names:
        if name in trained or is_adapter(name):
            continue
        for prefix, reader in readers:
            if name.startswith(prefix) and reader.holds(unwrapped(name[len(prefix):])):
                out.add(name)
    return out


def _directories(source: str | dict) -> list[Path]:
    if isinstance(source, dict):
        return [Path(source["llm"]), *(Path(v) for _, v in sorted(source.get("encoders", {}).items()))]
    return [Path(source)]


def _file_digest(path: Path, digest) -> None:
    """A safetensors file's size, header (names, dtypes, shapes, offsets) and ``DIGEST_BLOCKS`` blocks
    spread over its data: a re-save with other values changes the blocks, a copy changes nothing."""
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path} is truncated ({size} bytes): not a safetensors file")
        n = int.from_bytes(head, "little")
        digest.update(f.read(min(n, size)))
        for k in range(DIGEST_BLOCKS):
            f.seek(8 + n + (size - 8 - n) * k // DIGEST_BLOCKS)
            digest.update(f.read(BLOCK))


def source_digest(source: str | dict | None) -> str | None:
    """A digest of an HF source's weights and config (None for a preset): every ``config.json`` and
    ``*.safetensors`` of its directories (`_file_digest`). Reads a few MB whatever the model size."""
    if source is None or (isinstance(source, str) and not Path(source).is_dir()):
        return None
    digest = hashlib.sha256()
    for directory in _directories(source):
        config = directory / "config.json"
        if config.is_file():
            digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
        for path in sorted(directory.glob("*.safetensors")) if directory.is_dir() else [directory]:
            _file_digest(path, digest)
    return digest.hexdigest()[:16]
