"""Checkpoint files in one process: RNG state as plain tensors, pickles refused, atomic saves, retention."""

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch

from harmonia.runtime.checkpoint import (CheckpointError, complete_steps, load_rng_file, prune_checkpoints,
                                         remove_partial, rng_state, save_state, set_rng_state, verify_checkpoint)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Planted:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


def _save(directory, step: int) -> None:
    torch.manual_seed(step)
    save_state(directory, step, {"model": {"w": torch.randn(3, 4)}}, {"data_position": step})


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path) -> None:
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    set_rng_state(load_rng_file(tmp_path / "rng.pt"))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]


def test_planted_pickles_are_refused_unrun(tmp_path) -> None:
    _save(tmp_path, 1)
    verify_checkpoint(tmp_path, 1)
    sentinel = tmp_path / "ran"
    (tmp_path / "step-1" / "rng-0.pt").write_bytes(pickle.dumps(_Planted(sentinel), protocol=2))
    with pytest.raises(CheckpointError, match=r"rng-0.pt is not an RNG state harmonia wrote"):
        verify_checkpoint(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "step-2" / ".metadata").write_bytes(pickle.dumps(_Planted(sentinel)))
    with pytest.raises(CheckpointError, match=r"\.metadata is not a checkpoint index .*posix.system"):
        verify_checkpoint(tmp_path, 2, rng=False)
    assert not sentinel.exists()


def test_a_finished_checkpoint_is_never_rewritten_and_retention_keeps_the_newest(tmp_path) -> None:
    _save(tmp_path, 2)
    trainer = tmp_path / "step-2" / "trainer.json"
    before = trainer.stat().st_mtime_ns
    _save(tmp_path, 2)  # a re-run of a finished job
    assert trainer.stat().st_mtime_ns == before and json.loads(trainer.read_text())["data_position"] == 2
    for step in (3, 4, 5):
        _save(tmp_path, step)
    assert prune_checkpoints(tmp_path, keep=2) == [2, 3] and complete_steps(tmp_path) == [4, 5]
    (tmp_path / "step-6.tmp").mkdir()
    (tmp_path / "step-1.deleting").mkdir()
    assert remove_partial(tmp_path) == ["step-6.tmp", "step-1.deleting"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]
