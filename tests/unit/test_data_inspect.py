"""`harmonia data inspect`: every record read, every media file decoded, bad records by kind, a JSON report."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from harmonia.cli import main


def _png(path, h, w):
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 120, np.uint8)).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())


@pytest.fixture()
def llava_json(tmp_path):
    (tmp_path / "img").mkdir()
    _png(tmp_path / "img" / "small.png", 16, 16)
    _png(tmp_path / "img" / "wide.png", 16, 64)
    (tmp_path / "img" / "bad.png").write_bytes(b"not a png")

    def row(q, **extra):
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "an answer"}], **extra}

    rows = [row("<image>\nWhat is this?", image="img/small.png"), row("<image>\nAnd this?", image="img/wide.png"),
            row("Just text."), row("<image>\nBroken.", image="img/bad.png"), row("No tag.", image="img/small.png"),
            {"prompt_only": "x"}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    return tmp_path / "d.json"


def test_inspect_json_counts_records_modalities_and_bad_kinds(llava_json, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["data", "inspect", str(llava_json), "--json", str(out), "--workers", "0", "--preset", "tiny-vlm"]) == 0
    report = json.loads(out.read_text())
    assert report["records"] == 6 and report["ok"] == 3
    assert report["bad"] == {"corrupt_media": 1, "placeholder_mismatch": 1, "unknown_schema": 1}
    assert report["records"] == report["ok"] + sum(report["bad"].values())
    assert report["bad_examples"]["unknown_schema"][0].startswith(f"{llava_json}[5]")
    corrupt = report["bad_examples"]["corrupt_media"][0]  # names the record and its file, not a buffer
    assert corrupt.startswith(f"{llava_json}[3]") and "bad.png" in corrupt and "BytesIO" not in corrupt, corrupt
    assert report["modalities"]["items"] == {"image": 2}
    assert report["modalities"]["samples"] == {"image": 2, "text": 1}
    assert report["tiles"]["histogram"] == {"1": 1, "5": 1}  # tiny-vit: a 16x64 image is 4 tiles + thumbnail
    assert report["tokens"]["n"] == 3
    printed = capsys.readouterr().out
    assert "bad records" in printed and "placeholder_mismatch" in printed


def test_inspect_with_an_hf_checkpoint(llava_json, tmp_path):
    from harmonia.train.tiny_llava import write_tiny_llava

    ckpt = write_tiny_llava(tmp_path / "ckpt", image_size=16, patch_size=4)
    out = tmp_path / "report.json"
    assert main(["data", "inspect", str(llava_json), "--json", str(out), "--workers", "0",
                 "--model-hf", str(ckpt)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] == 3 and report["tiles"]["histogram"] == {"1": 2}  # LLaVA-1.5: one tile per image
    # two image samples carry 16 image tokens each ((16/4)^2 patches + class token - 1 'default')
    assert report["tokens"]["max"] - report["tokens"]["min"] >= 16


def test_inspect_takes_the_model_as_plan_spells_it(llava_json, tmp_path, capsys):
    """``--model`` is a preset name or a checkpoint directory, as for ``harmonia plan --model``; the
    reports equal those of the older ``--preset`` / ``--model-hf``; two of them at once are refused."""
    from harmonia.train.tiny_llava import write_tiny_llava

    ckpt = write_tiny_llava(tmp_path / "ckpt", image_size=16, patch_size=4)
    reports = {}
    for name, flags in {"model preset": ["--model", "tiny-vlm"], "preset": ["--preset", "tiny-vlm"],
                        "model dir": ["--model", str(ckpt)], "model-hf": ["--model-hf", str(ckpt)]}.items():
        out = tmp_path / f"{name}.json"
        assert main(["data", "inspect", str(llava_json), "--json", str(out), "--workers", "0", *flags]) == 0
        reports[name] = json.loads(out.read_text())
    assert reports["model preset"] == reports["preset"] and reports["model dir"] == reports["model-hf"]
    assert reports["model preset"] != reports["model dir"]
    capsys.readouterr()
    assert main(["data", "inspect", str(llava_json), "--model", "tiny-vlm", "--preset", "tiny-vlm"]) == 2
    assert "give one of --model, --model-hf, --preset, not --model and --preset" in capsys.readouterr().out


def test_inspect_refuses_a_missing_path(tmp_path, capsys):
    assert main(["data", "inspect", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in capsys.readouterr().out
