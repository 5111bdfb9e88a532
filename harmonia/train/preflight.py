"""What can fail about a job's files, checked before any process starts.

`preflight` runs in the launcher (rank 0 under torchrun) before training:

- the plan file is read strictly (`harmonia.train.plan_file`);
- ``checkpoint.dir`` and ``log.dir`` are created and written to, with room for two checkpoints
  (one being written beside the previous) and the logs;
- ``checkpoint.dir`` is locked against a second job (`harmonia.runtime.dirlock`); what crashed
  saves left (``step-N.tmp``) is removed;
- a checkpoint to resume must be of the same job: its fingerprint (`run_fingerprint`: model,
  trained modules, parameter counts, tokenizer) must match, and its pickled files must hold only
  what harmonia writes; with ``checkpoint.resume=false`` a directory holding checkpoints is refused,
  or the run goes to a new directory, or (``replace``, what `harmonia demo` does) the checkpoints of
  a directory harmonia created are deleted, by ``checkpoint.on_existing``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from harmonia.config import Config
from harmonia.errors import ConfigError
from harmonia.runtime.checkpoint import (complete_steps, read_trainer_state, remove_partial, step_dir,
                                         verify_checkpoint)
from harmonia.runtime.dirlock import DirectoryLock
from harmonia.train.plan_file import check_plan_file
from harmonia.train.planning import model_spec

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
"""Beside the checkpoints: the run's fingerprint and whether harmonia created the directory."""
LOG_ROOM_BYTES = 64 * 2**20


def run_fingerprint(config: Config) -> dict:
    """What a checkpoint must share with the job that resumes it: the model, how each module trains,
    the parameter counts and the tokenizer. JSON-able; compared key by key."""
    from harmonia.model.resolve import source_identity, tokenizer_identity
    from harmonia.train.source_state import source_digest

    spec = model_spec(config)
    return {
        "model": source_identity(config.model.source),
        "model_files": source_digest(config.model.source if config.model.from_checkpoint else None),
        "training": {m: spec.training_of(m).mode.value for m in spec.module_names},
        "lora_rank": config.model.lora_rank if config.model.lora else None,
        "lora": {m: spec.training_of(m).lora_options() for m in config.model.lora} or None,
        "parameters": spec.n_params(),
        "tokenizer": {"vocab_size": spec.llm.vocab_size,
                      "files": tokenizer_identity(config.model.hf or config.model.llm),
                      "chat_template": _file_digest(config.data.chat_template)},
    }


def _file_digest(path: str) -> str | None:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else None


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """``key: saved vs current`` for every difference (one level into dicts). ``model_files`` is
    compared only where the checkpoint has it (older ones do not)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if key == "model_files" and key not in saved:
            continue
        if key == "model_files":
            if a != b:
                out.append(f"model_files: the source's weights or config changed since the checkpoint (digest {a} "
                           f"then, {b} now); the checkpoint holds only what training changed, so it needs the "
                           "source it was trained from")
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{k}: {a.get(k)!r} in the checkpoint, {b.get(k)!r} now"
                    for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{key}: {a!r} in the checkpoint, {b!r} now")
    return out


def checkpoint_bytes(config: Config) -> int:
    """About the size of one checkpoint: every weight as the job holds it (trained ones, LoRA adapters
    included, in fp32; frozen ones, a LoRA module's base included, in bf16 under mixed precision and
    fp32 otherwise, none when the source gives them), plus AdamW's two fp32 states of each trained
    weight."""
    from harmonia.model.training_mode import Trainability
    from harmonia.train.backend import backend_of, runs_mixed

    frozen = 2 if runs_mixed(config.train.precision, "cuda" if backend_of(config) == "nccl" else "cpu") else 4
    spec = model_spec(config)
    if any(spec.training_of(m).mode is Trainability.LORA for m in spec.module_names):
        from harmonia.model.mllm import trainable_counts  # the adapters' sizes: the modules built on meta

        counts = list(trainable_counts(spec).values())
    else:
        counts = [(n if spec.training_of(m).trains else 0, n) for m, n in spec.n_params().items()]
    if config.model.from_checkpoint:  # frozen tensors stay in the source (`harmonia.train.source_state`)
        frozen = 0
    return sum(12 * trained + frozen * (whole - trained) for trained, whole in counts)


def check_writable(path: Path, what: str, need_bytes: int) -> None:
    """Create ``path``, write and remove a file in it, and check it has ``need_bytes`` free."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".harmonia-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"probe")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"{what} {path} is not writable ({err.strerror or err}); choose a directory this user can "
                          f"write, e.g. --{what}=runs/job") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ConfigError(f"{what} {path} has {free / 2**20:,.0f} MiB free but the job needs about "
                          f"{need_bytes / 2**20:,.0f} MiB; free some space or choose another {what}")


@dataclass
class Preflight:
    """The checked job: its config (``checkpoint.dir`` may have moved), the step it starts at, and the
    lock on its checkpoint directory, held until `close` (use as a context manager)."""

    config: Config
    start_step: int
    lock: DirectoryLock

    @property
    def finished(self) -> bool:
        return self.start_step >= self.config.train.steps

    def close(self) -> None:
        self.lock.release()

    def __enter__(self) -> Preflight:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def preflight(config: Config) -> Preflight:
    """Check and lock the job's files (see the module doc); raise ConfigError on what would fail later."""
    check_plan_file(config)
    check_writable(Path(config.log.dir), "log.dir", LOG_ROOM_BYTES)
    need = 2 * checkpoint_bytes(config)
    directory = Path(config.checkpoint.dir)
    created = not directory.exists()
    check_writable(directory, "checkpoint.dir", need)
    lock = DirectoryLock(directory, "checkpoint.dir")
    lock.acquire()
    try:
        removed = remove_partial(directory)
        if removed:
            log.warning("checkpoint.dir %s: removed %s left by an interrupted save", directory, ", ".join(removed))
        fingerprint = run_fingerprint(config)
        steps = complete_steps(directory)
        if steps and not config.checkpoint.resume:
            moved = _existing_checkpoints(config, directory)
            if moved is not None:
                lock.release()
                config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=str(moved)))
                return preflight(config)
            steps = []
        if steps:
            _check_resumable(directory, steps[-1], fingerprint)
        _write_run_file(directory, fingerprint, created)
        return Preflight(config, steps[-1] if steps else 0, lock)
    except BaseException:
        lock.release()
        raise


def _check_resumable(directory: Path, step: int, fingerprint: dict) -> None:
    saved = read_trainer_state(directory, step).get("fingerprint") or _read_run_file(directory).get("fingerprint")
    if saved is None:
        log.warning("checkpoint %s has no fingerprint (an older harmonia wrote it): resuming without checking "
                    "that it is of the same model", step_dir(directory, step))
    else:
        differences = fingerprint_differences(saved, json.loads(json.dumps(fingerprint)))
        if differences:
            raise ConfigError(f"checkpoint.dir {directory} holds a run of another model or training setup, so it "
                              f"cannot be resumed: {'; '.join(differences)}. Resume with the config that wrote it, "
                              "or give this job another checkpoint.dir")
    verify_checkpoint(directory, step)


def _existing_checkpoints(config: Config, directory: Path) -> Path | None:
    """``resume=false`` into a directory holding checkpoints, by ``checkpoint.on_existing``: raise,
    return a new directory to use, or delete the checkpoints (None)."""
    policy, steps = config.checkpoint.on_existing, complete_steps(directory)
    if policy == "new_dir":
        n = 2
        while (moved := directory.with_name(f"{directory.name}-{n}")).exists() and complete_steps(moved):
            n += 1
        log.warning("checkpoint.dir %s already holds checkpoints and checkpoint.resume=false: this run writes to %s",
                    directory, moved)
        return moved
    if policy == "replace" and _read_run_file(directory).get("created_by_harmonia"):
        for step in steps:
            doomed = directory / f"step-{step}.deleting"
            step_dir(directory, step).rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        log.info("checkpoint.dir %s: removed the previous run's checkpoints %s", directory, steps)
        return None
    why = (" and harmonia did not create it, so it deletes nothing there" if policy == "replace" else "")
    raise ConfigError(f"checkpoint.dir {directory} already holds checkpoints {steps}{why}; resume them "
                      "(checkpoint.resume=true), give this run another checkpoint.dir, or set "
                      "checkpoint.on_existing=new_dir to write beside them")


def _read_run_file(directory: Path) -> dict:
    try:
        return json.loads((directory / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_run_file(directory: Path, fingerprint: dict, created: bool) -> None:
    previous = _read_run_file(directory)
    record = {"fingerprint": fingerprint, "created_by_harmonia": bool(previous.get("created_by_harmonia", created))}
    tmp = directory / f"{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.rename(directory / RUN_FILE)
