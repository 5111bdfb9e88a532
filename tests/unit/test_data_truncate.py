"""`data.truncation`: a sample longer than `data.max_tokens` is skipped (counted, too_long) or cut to
its first max_tokens tokens, items after the cut dropped; a cut inside an item, or one that leaves
nothing learned, still skips. The shape the scheduler balances with is the cut sample's."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from harmonia.data.loader import MultimodalDataset
from harmonia.model.presets import mllm_preset
from harmonia.workload.work import llm_tokens

SPEC = mllm_preset("tiny-vlm")
LONG = "tell me about the picture " * 6  # ~150 byte tokens


def _dataset(tmp_path, records, **kw) -> MultimodalDataset:
    Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    (tmp_path / "data.json").write_text(json.dumps(records))
    return MultimodalDataset(tmp_path / "data.json", SPEC, **kw)


def _record(i, question, answer, image=True):
    out = {"id": i, "conversations": [{"from": "human", "value": ("<image>\n" if image else "") + question},
                                      {"from": "gpt", "value": answer}]}
    return {**out, "image": "a.png"} if image else out


def test_long_samples_are_cut_to_max_tokens(tmp_path) -> None:
    records = [_record(0, "short?", "yes"), _record(1, LONG, "a long answer " * 20)]
    skip = _dataset(tmp_path, records, max_tokens=200)
    assert [s.sample_id for s in skip.shapes()] == [0] and skip.stats.skipped["too_long"] == 1
    cut = _dataset(tmp_path, records, max_tokens=200, truncate=True)
    shapes = {s.sample_id: s for s in cut.shapes()}
    assert sorted(shapes) == [0, 1] and not cut.stats.skipped
    (built,) = cut.load([1])
    assert len(built.tokens) == 200 == llm_tokens(shapes[1], SPEC)
    assert built.shape == shapes[1]
    assert int((built.tokens.labels != -100).sum()) == cut.outline(shapes[1]).n_targets > 0


def test_cuts_that_split_an_item_or_learn_nothing_still_skip(tmp_path) -> None:
    records = [_record(0, "q", "a " * 200),  # the cut falls in the answer: kept
               _record(1, LONG * 3, "a")]    # the cut falls before the answer: nothing learned
    ds = _dataset(tmp_path, records, max_tokens=120, truncate=True)
    assert [s.sample_id for s in ds.shapes()] == [0] and ds.stats.skipped["too_long"] == 1
    n_image = llm_tokens(ds.shapes()[0], SPEC) - ds.shapes()[0].text_tokens
    inside = _dataset(tmp_path, [_record(0, "q", "a")], max_tokens=n_image // 2 + 2, truncate=True)
    assert not inside.shapes() and inside.stats.skipped["too_long"] == 1
