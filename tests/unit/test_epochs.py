"""`train.epochs` instead of `train.steps`: the steps follow from the usable samples, said once."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from harmonia.config import load_config
from harmonia.data.synth import write_synthetic_dataset
from harmonia.errors import ConfigError
from harmonia.train.job import dataset_shapes, with_epochs


def _config(tmp_path, *extra: str):
    return load_config(None, ["--model.preset=tiny-vlm", f"--data.path={tmp_path / 'data' / 'train'}",
                              f"--checkpoint.dir={tmp_path / 'ck'}", *extra])


def test_steps_follow_from_epochs_over_the_usable_samples(tmp_path) -> None:
    write_synthetic_dataset(tmp_path / "data", 40, seed=0, heldout=0.2)  # 32 training samples, some with audio
    printed = io.StringIO()
    given = _config(tmp_path, "--train.epochs=2.5", "--train.global_batch=8", "--train.warmup=1")
    usable = len(dataset_shapes(given))
    assert 0 < usable < 32  # tiny-vlm has no audio encoder: those samples are not usable
    config = with_epochs(given, Console(file=printed, width=200))
    assert config.train.steps == math.ceil(2.5 * usable / 8)
    assert f"train.epochs=2.5 over {usable} usable samples at global batch 8: {config.train.steps} steps" in \
        printed.getvalue()
    same = _config(tmp_path, "--train.steps=7")
    assert with_epochs(same) is same  # no epochs: train.steps as given
    with pytest.raises(ConfigError, match="train.warmup"):  # a warm-up longer than the derived steps
        with_epochs(_config(tmp_path, "--train.epochs=1", "--train.global_batch=32", "--train.warmup=5"))


def test_epochs_must_be_a_non_negative_number(tmp_path) -> None:
    with pytest.raises(ConfigError, match="train.epochs"):
        _config(tmp_path, "--train.epochs=-1")
