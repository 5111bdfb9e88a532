"""The data pipeline on generated data, with planted bad samples."""

import json
import shutil

import numpy as np
import pytest
import torch

from harmonia.data.loader import MultimodalDataset, collate
from harmonia.data.media import audio_chunks, log_mel, open_image, tile_image
from harmonia.data.records import DataError
from harmonia.data.synth import write_synthetic_dataset
from harmonia.errors import ConfigError
from harmonia.model.mllm import build_mllm_model
from harmonia.model.presets import mllm_preset
from harmonia.workload.shapes import ModalityItem, encoder_sequences, image_tiles
from harmonia.workload.work import llm_tokens

SPEC = mllm_preset("tiny-omni")
VIT, AUD = SPEC.encoders["vision"], SPEC.encoders["audio"]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    write_synthetic_dataset(root / "files", 40, seed=1)
    write_synthetic_dataset(root / "tars", 40, seed=1, shards=3)
    return root


@pytest.mark.parametrize("fmt", ["files", "tars"])
def test_shapes_from_headers_match_decoded_tensors(synth, fmt):
    ds = MultimodalDataset(synth / fmt / "train", SPEC)
    assert len(ds) == 36
    shapes = ds.shapes()
    loaded = ds.load(list(range(len(ds))))
    assert [s.shape for s in loaded] == shapes
    assert {m.modality for s in shapes for m in s.items} == {"image", "video", "audio"}
    for s in loaded:
        assert len(s.tokens) == llm_tokens(s.shape, SPEC)
        n_seq = {"vision": 0, "audio": 0}
        for item, inputs in zip(s.shape.items, s.tokens.items):
            enc = SPEC.encoders[SPEC.encoder_for(item.modality)]
            assert inputs.inputs.shape[0] == len(encoder_sequences(item, enc))
            n_seq[inputs.module] += 1
        targets = s.tokens.labels[s.tokens.labels != -100]
        assert bytes(targets[:-1].tolist()).decode() == s.answer and targets[-1] == 2  # answer then eos
    assert ds.stats.metrics() == {"data/loaded": 36, "data/skipped": 0}


def test_same_records_in_both_formats(synth):
    a = MultimodalDataset(synth / "files" / "train", SPEC)
    b = MultimodalDataset(synth / "tars" / "train", SPEC)
    ia, ib = a.load([0, 5]), b.load([0, 5])
    for x, y in zip(ia, ib):
        assert torch.equal(x.tokens.input_ids, y.tokens.input_ids)
        for p, q in zip(x.tokens.items, y.tokens.items):
            torch.testing.assert_close(p.inputs, q.inputs)


def test_collated_batch_runs_through_the_model(synth):
    ds = MultimodalDataset(synth / "files" / "train", SPEC)
    batches = list(ds.iter_load([[0, 1, 2, 3], [4, 5, 6]], num_workers=2))
    assert [len(b) for b in batches] == [4, 3]
    batch = collate(batches[0])
    assert batch.n_tokens == sum(llm_tokens(s.shape, SPEC) for s in batches[0])
    torch.manual_seed(0)
    loss = build_mllm_model(SPEC).loss(batch)
    assert torch.isfinite(loss)
    assert ds.stats.loaded == 7


def test_tiling_and_mel_follow_the_shape_functions():
    img = open_image(_png_bytes(40, 70))
    tiles = tile_image(img, VIT)
    item = ModalityItem.image(height=40, width=70)
    assert tiles.shape == (image_tiles(item, VIT), 3, 16, 16)
    assert -1.0 <= float(tiles.min()) and float(tiles.max()) <= 1.0
    mel = log_mel(torch.zeros(16000 * 2), AUD)
    assert mel.shape == (AUD.n_mels, 16000 * 2 // AUD.hop_length)
    chunks, item = audio_chunks(np.zeros(8000 * 5, np.float32), 8000, AUD)  # 5 s at 8 kHz, resampled
    assert item.seconds == pytest.approx(5.0)
    assert chunks.shape[0] == len(encoder_sequences(item, AUD)) == 3


def _png_bytes(h: int, w: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _plant_bad_samples(root):
    """Corrupt one image and one WAV, and append bad manifest lines."""
    manifest = root / "manifest.jsonl"
    lines = manifest.read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    img = next(r for r in recs if r["media"] and r["media"][0]["type"] == "image")
    wav = next(r for r in recs if r["media"] and r["media"][0]["type"] == "audio")
    (root / img["media"][0]["path"]).write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root / wav["media"][0]["path"]).write_bytes(b"RIFF nonsense")
    lines += [
        '{"id": "broken", "prompt": "no closing brace"',
        json.dumps({"id": "smell", "prompt": "<smell>", "answer": "x", "media": [{"type": "smell", "path": "a"}]}),
        json.dumps({"id": "gone", "prompt": "<image>", "answer": "x", "media": [{"type": "image", "path": "nope.png"}]}),
        json.dumps({"id": "long", "prompt": "y" * 600, "answer": "x"}),
    ]
    manifest.write_text("\n".join(lines) + "\n")
    return len(lines)


def test_bad_samples_are_reported_counted_and_skipped(synth, tmp_path, caplog):
    root = tmp_path / "train"
    shutil.copytree(synth / "files" / "train", root)
    n_lines = _plant_bad_samples(root)
    ds = MultimodalDataset(root, SPEC, max_tokens=512)
    assert len(ds) == n_lines - 2  # the non-JSON line and the unknown modality never become records
    good = ds.shapes()
    loaded = [s for b in ds.iter_load([list(range(len(ds)))], num_workers=2) for s in b]
    assert len(good) == len(loaded) == n_lines - 6
    metrics = ds.stats.metrics()
    assert metrics == {
        "data/loaded": n_lines - 6, "data/skipped": 6, "data/skipped/bad_json": 1,
        "data/skipped/corrupt_media": 2, "data/skipped/missing_file": 1, "data/skipped/too_long": 1,
        "data/skipped/unknown_modality": 1,
    }
    messages = " ".join(m for ms in ds.stats.examples.values() for m in ms)
    assert f"manifest.jsonl:{n_lines - 3}" in messages  # the non-JSON line, by number
    assert "nope.png" in messages and "max_tokens=512" in messages
    assert "skipping sample (bad_json)" in caplog.text


def test_fail_policy_raises_on_the_first_bad_sample(synth, tmp_path):
    root = tmp_path / "train"
    shutil.copytree(synth / "files" / "train", root)
    _plant_bad_samples(root)
    with pytest.raises(DataError, match="not JSON"):
        MultimodalDataset(root, SPEC, on_error="fail")
    with pytest.raises(ConfigError, match="on_error"):
        MultimodalDataset(root, SPEC, on_error="ignore")


def test_model_without_audio_encoder_skips_audio_samples(synth):
    ds = MultimodalDataset(synth / "files" / "train", mllm_preset("tiny-vlm"))
    shapes = ds.shapes()
    assert all(m.modality != "audio" for s in shapes for m in s.items)
    assert ds.stats.skipped["unknown_modality"] > 0


def test_declared_sizes_spare_file_reads_and_are_checked(tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / "a.png")
    recs = [
        {"id": "ok", "prompt": "<image>", "answer": "x", "media": [{"type": "image", "path": "a.png", "height": 20, "width": 30}]},
        {"id": "lie", "prompt": "<image>", "answer": "x", "media": [{"type": "image", "path": "a.png", "height": 21, "width": 30}]},
        {"id": "far", "prompt": "<image>", "answer": "x", "media": [{"type": "image", "path": "b.png", "height": 16, "width": 16}]},
    ]
    (tmp_path / "manifest.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    ds = MultimodalDataset(tmp_path, SPEC)
    assert [s.items[0].height for s in ds.shapes()] == [20, 21, 16]  # no file opened for shapes
    assert [s.index for s in ds.load([0, 1, 2])] == [0]
    assert ds.stats.skipped == {"shape_mismatch": 1, "missing_file": 1}
