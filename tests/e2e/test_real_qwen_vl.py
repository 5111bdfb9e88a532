"""The real-model path end to end for the Qwen-VL family: a tiny HF Qwen2.5-VL checkpoint and LLaVA
JSON data (images, and some short videos) through `harmonia train` (4 processes, the vision tower on
a layout of its own beside the LLM's pipeline) -> `harmonia export` -> transformers, which must load
the export with no missing or unexpected keys, give the same logits as harmonia's trained model, and
score the training conversations better than the initial checkpoint.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from harmonia.config import load_config
from harmonia.data.synth import write_synthetic_dataset
from harmonia.train import run_training
from harmonia.train.tiny_qwen_vl import IMAGE_PAD, write_tiny_qwen_vl
from tests.e2e._replay import nccl_replayed

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen")
    base = write_tiny_qwen_vl(tmp / "base")
    write_synthetic_dataset(tmp / "data", 112, seed=0, heldout=1 / 7, tile=48, fmt="llava")
    _add_videos(tmp / "data" / "train", 16)
    config = load_config(None, [
        f"--model.hf={base}", "--model.frozen=vision", f"--data.path={tmp / 'data' / 'train' / 'llava.json'}",
        "--train.steps=10", "--train.global_batch=16", "--train.warmup=1", "--train.lr=5e-3",
        "--parallel.llm_pp=2", "--parallel.timeout_s=400", "--log.tensorboard=false",
        f"--log.dir={tmp / 'run'}", f"--checkpoint.dir={tmp / 'run' / 'ck'}"])
    with nccl_replayed(tmp / "comms") as replays:  # a pipelined tower -> LLM job as NCCL would run it
        result = run_training(config, Console(file=io.StringIO(), width=200))
    assert replays[0].p2p_ops > 0
    from harmonia.train.export import export_checkpoint

    export_checkpoint(tmp / "run" / "ck", tmp / "export")
    return tmp, config, result


def _add_videos(root: Path, n: int) -> None:
    """``n`` records of a short mp4 each (a `<video>` question) beside the images: the tower's layout
    takes videos through the video processor's sampling and sizing."""
    from tests.unit.test_native_video import _mp4

    records = json.loads((root / "llava.json").read_text())
    for k in range(n):
        (root / f"clip{k}.mp4").write_bytes(_mp4(6 + 2 * k, 4, 16 + 8 * (k % 3), 24 + 8 * (k % 2)))
        records.append({"id": f"clip{k}", "video": f"clip{k}.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhich way does it move?"},
            {"from": "gpt", "value": ("left", "right")[k % 2]}]})
    (root / "llava.json").write_text(json.dumps(records))


def _inputs(path: Path, row: dict, root: Path) -> dict:
    """transformers' inputs for a LLaVA-JSON row (the checkpoint's tokenizer, chat template and image
    processor; each image pad repeated for its grid, as Qwen2VLProcessor does), labels on the answer."""
    from PIL import Image

    from harmonia.train.hf_generate import _messages

    tok = transformers.AutoTokenizer.from_pretrained(path)
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    msgs, answer = _messages(row["conversations"])
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    media = processor(images=[Image.open(root / row["image"]).convert("RGB")], return_tensors="pt")
    n = int(media["image_grid_thw"].prod()) // 4
    expand = lambda text: text.replace(IMAGE_PAD, IMAGE_PAD * n)  # noqa: E731
    ids = tok(expand(prompt + answer + "<|im_end|>\n"), return_tensors="pt")["input_ids"]
    n_prompt = tok(expand(prompt), return_tensors="pt")["input_ids"].shape[1]
    labels = ids.clone()
    labels[:, :n_prompt] = -100
    types = (ids == tok.convert_tokens_to_ids(IMAGE_PAD)).long()
    return {"input_ids": ids, "labels": labels, "mm_token_type_ids": types, **media}


def _rows(tmp: Path, n: int) -> list[dict]:
    return [r for r in json.loads((tmp / "data" / "train" / "llava.json").read_text()) if "image" in r][:n]


def test_plan_gives_the_tower_its_own_layout(job) -> None:
    _, _, result = job
    llm = result.plan.layouts["llm"]
    assert llm.pp == 2 and result.plan.layouts["vision"] != llm
    assert result.losses[-1] < result.losses[0]
    assert result.records[-1]["data/skipped"] == 0  # the videos' records too


def test_export_loads_cleanly_with_harmonia_logits(job) -> None:
    from harmonia.model.batch import pack_samples
    from harmonia.model.families.qwen_vl import tokenized_sample
    from harmonia.train.export import checkpoint_model

    tmp, config, _ = job
    model, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp / "export", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    spec, ours = checkpoint_model(config.checkpoint.dir)  # frozen tensors from the source, as training read them
    batch = _inputs(tmp / "export", _rows(tmp, 1)[0], tmp / "data" / "train")
    sample = tokenized_sample(spec, batch["input_ids"][0], batch["pixel_values"],
                              image_grid_thw=batch["image_grid_thw"])
    with torch.no_grad():
        want = model.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits
        got = ours(pack_samples([sample]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_training_lowered_the_transformers_loss(job) -> None:
    tmp, _, _ = job
    losses = {}
    for name in ("base", "export"):
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp / name).eval()
        with torch.no_grad():
            rows = _rows(tmp, 24)
            losses[name] = sum(float(model(**_inputs(tmp / name, r, tmp / "data" / "train")).loss) for r in rows) / len(rows)
    assert losses["export"] < losses["base"], losses
