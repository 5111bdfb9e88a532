"""Preflight in one process: directories, the lock, fingerprints, resume=false, the run directory."""

import json
import os
import subprocess
import sys

import pytest
import torch

from harmonia.config import load_config
from harmonia.errors import ConfigError
from harmonia.runtime.checkpoint import save_state
from harmonia.runtime.dirlock import DirectoryLock, DirectoryLocked
from harmonia.train.preflight import fingerprint_differences, preflight, run_fingerprint


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _config(tmp_path, *extra: str):
    return load_config(None, ["--model.preset=tiny-vlm", f"--log.dir={tmp_path / 'log'}",
                              f"--checkpoint.dir={tmp_path / 'ck'}", "--train.steps=4", *extra])


def _checkpoint(ck, step: int, fingerprint: dict) -> None:
    save_state(ck, step, {"model": {"w": torch.zeros(2)}}, {"fingerprint": fingerprint})


def test_lock_names_its_holder_and_a_dead_holder_is_taken_over(tmp_path) -> None:
    with DirectoryLock(tmp_path, "checkpoint.dir"):
        with pytest.raises(DirectoryLocked, match=rf"in use by another harmonia job \(pid {os.getpid()} on host"):
            DirectoryLock(tmp_path, "checkpoint.dir").acquire()
    assert not (tmp_path / "harmonia.lock").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "harmonia.lock").write_text(json.dumps({"pid": int(dead.stdout), "host": "h", "since": 0}))
    with DirectoryLock(tmp_path) as lock:
        assert lock.took_over["pid"] == int(dead.stdout)
        assert json.loads((tmp_path / "harmonia.lock").read_text())["pid"] == os.getpid()


def test_fingerprint_says_what_differs(tmp_path) -> None:
    vlm, omni = run_fingerprint(_config(tmp_path)), run_fingerprint(_config(tmp_path, "--model.preset=tiny-omni"))
    lines = fingerprint_differences(vlm, omni)
    assert "model: 'tiny-vlm' in the checkpoint, 'tiny-omni' now" in lines
    assert "training.audio: None in the checkpoint, 'full' now" in lines
    assert fingerprint_differences(vlm, run_fingerprint(_config(tmp_path, "--train.lr=0.1"))) == []


def test_resume_and_fresh_starts(tmp_path) -> None:
    config = _config(tmp_path)
    ck = tmp_path / "ck"
    with preflight(config) as checked:  # a new directory: harmonia created it
        assert checked.start_step == 0 and (ck / "harmonia.lock").exists()
    assert json.loads((ck / "run.json").read_text())["created_by_harmonia"] is True
    _checkpoint(ck, 2, run_fingerprint(config))
    (ck / "step-3.tmp").mkdir()
    with preflight(config) as checked:
        assert checked.start_step == 2 and not checked.finished and not (ck / "step-3.tmp").exists()
    with pytest.raises(ConfigError, match=r"cannot be resumed: model: 'tiny-vlm' in the checkpoint, 'tiny-omni'"):
        preflight(_config(tmp_path, "--model.preset=tiny-omni"))
    with pytest.raises(ConfigError, match=r"already holds checkpoints \[2\]; resume them"):
        preflight(_config(tmp_path, "--checkpoint.resume=false"))
    with preflight(_config(tmp_path, "--checkpoint.resume=false", "--checkpoint.on_existing=new_dir")) as checked:
        assert checked.config.checkpoint.dir == str(tmp_path / "ck-2") and checked.start_step == 0
    with preflight(_config(tmp_path, "--checkpoint.resume=false", "--checkpoint.on_existing=replace")) as checked:
        assert checked.start_step == 0 and not (ck / "step-2").exists()
    assert not (ck / "harmonia.lock").exists()


def test_directories_must_be_writable_with_room(tmp_path, monkeypatch) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"log.dir .* is not writable \(Not a directory\)"):
        preflight(_config(tmp_path, f"--log.dir={tmp_path / 'file' / 'log'}"))
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 2**20})())
    with pytest.raises(ConfigError, match=r"log.dir .* has 1 MiB free but the job needs about 64 MiB"):
        preflight(_config(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("training", [[], ["--model.lora=llm"], ["--model.lora=llm", "--train.precision=bf16"]])
def test_the_room_asked_for_a_checkpoint_is_about_what_the_job_writes(tmp_path, training) -> None:
    """The tensors a checkpoint stores, in full training and under LoRA (its frozen base stored as
    held, Adam states for the adapters only)."""
    from harmonia.train.preflight import checkpoint_bytes

    flags = ["--model.preset=tiny-vlm", f"--log.dir={tmp_path / 'log'}", f"--checkpoint.dir={tmp_path / 'ck'}",
             "--parallel.world_size=1", "--train.steps=1", "--train.global_batch=8", "--data.synthesize=16",
             "--data.heldout=0", f"--data.path={tmp_path / 'data'}", "--log.tensorboard=false", *training]
    run = subprocess.run([sys.executable, "-m", "harmonia", "train", *flags], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    import math

    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(tmp_path / "ck" / "step-1")).read_metadata().state_dict_metadata
    held = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in stored.values() if hasattr(m, "size"))
    estimate = checkpoint_bytes(load_config(None, flags))
    assert 0.98 * held <= estimate <= 1.02 * held, (estimate, held)  # files add a fixed few hundred KB


def test_lora_on_a_large_llm_asks_for_its_base_as_held_and_adam_states_for_its_adapters_only() -> None:
    from harmonia.train.preflight import checkpoint_bytes

    def size(*extra: str) -> int:
        return checkpoint_bytes(load_config(None, ["--model.preset=llava-siglip-8b", *extra]))

    full, lora = size("--train.precision=bf16"), size("--train.precision=bf16", "--model.lora=llm")
    # a bf16 base of 8.48B (16.96 GB) and about 0.5 GB of trained adapters, projector and their states
    assert full > 12 * 8.0e9 and 16.96e9 < lora < 18e9
    assert size("--train.precision=fp32", "--model.lora=llm") > 4 * 8.4e9
