"""Safetensors files written a batch of tensors at a time read back as the library writes them."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from harmonia.errors import ConfigError
from harmonia.model.hf.io import write_safetensors, write_shards


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(3, generator=g),
        "c.ids": torch.arange(11, dtype=torch.int64),
        "d.mask": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5, dtype=torch.float16),
        "f.empty": torch.zeros(0, 4),
        "g.strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }


def test_a_file_written_batch_by_batch_reads_back_exactly(tmp_path) -> None:
    state = tensors()
    asked: list[list[str]] = []

    def load(keys):
        asked.append(keys)
        return {k: state[k] for k in keys}

    layout = {k: (t.dtype, tuple(t.shape)) for k, t in state.items()}
    write_safetensors(tmp_path / "m.safetensors", layout, load, batch_bytes=40)
    back = load_file(str(tmp_path / "m.safetensors"))
    assert set(back) == set(state)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert len(asked) > 2 and [k for b in asked for k in b] == list(state)  # batches, each tensor once, in order
    assert all(sum(state[k].numel() * state[k].element_size() for k in b) <= 40 or len(b) == 1 for b in asked)


def test_shards_with_an_index_and_no_file_left_behind_on_a_wrong_tensor(tmp_path) -> None:
    state = tensors()
    layout = {k: (t.dtype, tuple(t.shape)) for k, t in state.items()}
    write_shards(tmp_path, layout, lambda keys: {k: state[k] for k in keys}, max_shard_bytes=64)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    back = {}
    for f in files:
        back.update(load_file(str(tmp_path / f)))
    assert all(torch.equal(back[k], t) for k, t in state.items())
    wrong = {**layout, "b.bias": (torch.float16, (3,))}
    with pytest.raises(ConfigError, match=r"'b.bias' is torch.float32 \(3,\), expected torch.float16"):
        write_safetensors(tmp_path / "bad.safetensors", wrong, lambda keys: {k: state[k] for k in keys})
    assert not list(tmp_path.glob("bad.safetensors*"))
