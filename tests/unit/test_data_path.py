"""A data path is what the job trains on: a missing one, or one in no known format, is an error that
names it, before anything is written; synthetic data only where asked for, into a new directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harmonia.config import load_config
from harmonia.errors import ConfigError
from harmonia.train.data import SYNTHETIC_MARKER, check_data_path, prepare_data

ROOT = Path(__file__).resolve().parents[2]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "harmonia", "train", "--model.preset=tiny-vlm", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_mistyped_data_path_is_an_error_and_writes_nothing(tmp_path) -> None:
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "train.jsonl").write_text("")
    before = _files(tmp_path)
    for path in ("mydata/trian.jsonl", str(tmp_path / "nowhere" / "llava_665k")):
        run = _train(tmp_path, f"--data.path={path}")
        assert run.returncode == 2, run.stderr
        assert f"error: data.path={path!r} does not exist; point it at a dataset" in run.stdout
        assert "synthesized" not in run.stdout
    assert _files(tmp_path) == before


def test_records_in_no_known_format_stop_the_job_with_one_message(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "q", "answer": "a", "image": "x.png"}) + "\n")
    run = _train(tmp_path, f"--data.path={tmp_path / 'd.jsonl'}", f"--checkpoint.dir={tmp_path / 'ck'}",
                 f"--log.dir={tmp_path / 'log'}", "--parallel.world_size=1", "--parallel.cluster=cpu:1x1")
    assert run.returncode == 2
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "records match no format: keys found ['answer', 'image', 'question']" in lines[0]


def _config(tmp_path, *extra: str):
    return load_config(None, ["--model.preset=tiny-vlm", f"--checkpoint.dir={tmp_path / 'ck'}", *extra])


def test_synthetic_data_only_into_a_directory_harmonia_creates(tmp_path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="already exists and is not one harmonia wrote"):
        check_data_path(_config(tmp_path, f"--data.path={mine}", "--data.synthesize=8"))
    with pytest.raises(ConfigError, match="is an empty directory"):
        (tmp_path / "empty").mkdir()
        check_data_path(_config(tmp_path, f"--data.path={tmp_path / 'empty'}"))
    assert _files(mine) == ["notes.txt"]

    new = _config(tmp_path, f"--data.path={tmp_path / 'synth'}", "--data.synthesize=8", "--data.heldout=2")
    check_data_path(new)
    assert prepare_data(new) is True
    assert (tmp_path / "synth" / SYNTHETIC_MARKER).is_file() and (tmp_path / "synth" / "train").is_dir()
    assert not list(tmp_path.glob(".synth*"))  # written aside, then renamed into place
    check_data_path(new)
    assert prepare_data(new) is False  # the same request reads the set it wrote
    check_data_path(_config(tmp_path, f"--data.path={tmp_path / 'synth'}"))  # and a plain job trains on it
    with pytest.raises(ConfigError, match="holds a synthetic set written from"):
        check_data_path(_config(tmp_path, f"--data.path={tmp_path / 'synth'}", "--data.synthesize=16"))
