"""The real-model path end to end: an HF LLaVA checkpoint and LLaVA JSON data through
`harmonia train` (4 processes, the encoder's layout unlike the LLM's) -> `harmonia export` ->
transformers, which must load the export with no missing or unexpected keys and no warnings, give
the same logits as harmonia's trained model, and score the training conversations better than the
initial checkpoint.
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from rich.console import Console

from harmonia.config import load_config
from harmonia.data.synth import write_synthetic_dataset
from harmonia.train.tiny_llava import write_tiny_llava
from harmonia.train import run_training

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    base = write_tiny_llava(tmp / "base")
    write_synthetic_dataset(tmp / "data", 112, seed=0, heldout=1 / 7, tile=32, fmt="llava")
    config = load_config(None, [
        f"--model.hf={base}", "--model.frozen=vision", f"--data.path={tmp / 'data' / 'train' / 'llava.json'}",
        "--train.steps=10", "--train.global_batch=16", "--train.warmup=1", "--train.lr=5e-3",
        "--parallel.llm_pp=2", "--parallel.timeout_s=400", "--log.tensorboard=false",
        f"--log.dir={tmp / 'run'}", f"--checkpoint.dir={tmp / 'run' / 'ck'}"])
    printed = io.StringIO()
    result = run_training(config, Console(file=printed, width=200))
    from harmonia.train.export import export_checkpoint

    export_checkpoint(tmp / "run" / "ck", tmp / "export")
    return tmp, config, result


def _conversations(tmp: Path, n: int) -> list[dict]:
    return json.loads((tmp / "data" / "train" / "llava.json").read_text())[:n]


def _inputs(processor, row: dict, root: Path) -> dict:
    """transformers' inputs for a LLaVA-JSON row, labels on the answer and end of turn only."""
    from PIL import Image

    from harmonia.train.hf_generate import _messages

    msgs, answer = _messages(row["conversations"])
    prompt = processor.apply_chat_template(msgs, add_generation_prompt=True)
    full = prompt + answer + "<|im_end|>\n"
    images = [Image.open(root / row["image"]).convert("RGB")] if "image" in row else None
    batch = processor(images=images, text=[full], return_tensors="pt")
    n_prompt = processor(images=images, text=[prompt], return_tensors="pt")["input_ids"].shape[1]
    labels = batch["input_ids"].clone()
    labels[:, :n_prompt] = -100
    return {**batch, "labels": labels}


def test_plan_gives_the_encoder_its_own_layout(job) -> None:
    _, _, result = job
    llm = result.plan.layouts["llm"]
    assert llm.pp == 2 and result.plan.layouts["vision"] != llm
    assert result.losses[-1] < result.losses[0]


def test_export_loads_cleanly_with_harmonia_logits(job, caplog) -> None:
    from harmonia.model.batch import pack_samples
    from harmonia.model.families.llava import tokenized_sample
    from harmonia.train.export import checkpoint_model

    tmp, config, _ = job
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        model, info = transformers.LlavaForConditionalGeneration.from_pretrained(
            tmp / "export", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not [str(w.message) for w in caught if "checkpoint" in str(w.message).lower()]
    assert not [r.message for r in caplog.records if "weight" in r.message.lower()]
    processor = transformers.AutoProcessor.from_pretrained(tmp / "export")

    spec, ours = checkpoint_model(config.checkpoint.dir)  # frozen tensors from the source, as training read them
    row = _conversations(tmp, 3)[0]
    batch = _inputs(processor, row, tmp / "data" / "train")
    sample = tokenized_sample(spec, batch["input_ids"][0], batch["pixel_values"])
    with torch.no_grad():
        want = model.eval()(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits
        got = ours(pack_samples([sample]))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_training_lowered_the_transformers_loss(job) -> None:
    tmp, _, _ = job
    losses = {}
    for name in ("base", "export"):
        model = transformers.LlavaForConditionalGeneration.from_pretrained(tmp / name).eval()
        processor = transformers.AutoProcessor.from_pretrained(tmp / name)
        with torch.no_grad():
            losses[name] = sum(float(model(**_inputs(processor, row, tmp / "data" / "train")).loss)
                               for row in _conversations(tmp, 24)) / 24
    assert losses["export"] < losses["base"], losses


def test_export_reads_the_checkpoint_one_output_shard_at_a_time(job, monkeypatch) -> None:
    """Peak memory of an export is about one output file: the checkpoint is read a shard's tensors
    at a time, and the result equals the export written with one big file."""
    import torch.distributed.checkpoint as dcp

    from harmonia.model.hf.io import read_state_dict
    from harmonia.train.export import export_checkpoint

    tmp, config, _ = job
    shard = 200_000
    requested = []
    load = dcp.load

    def spy(state, **kw):
        requested.append(sum(t.numel() * t.element_size() for t in state["model"].values()))
        return load(state, **kw)

    monkeypatch.setattr(dcp, "load", spy)
    export_checkpoint(config.checkpoint.dir, tmp / "export-small", max_shard_bytes=shard)
    files = list((tmp / "export-small").glob("*.safetensors"))
    assert len(files) > 3 and len(requested) > 3
    largest = max(t.numel() * 4 for t in read_state_dict(tmp / "export").values())
    assert max(requested) <= 2 * shard + largest, requested  # the checkpoint may hold wider dtypes than written
    small, big = read_state_dict(tmp / "export-small"), read_state_dict(tmp / "export")
    assert small.keys() == big.keys() and all(torch.equal(small[k], big[k]) for k in big)
