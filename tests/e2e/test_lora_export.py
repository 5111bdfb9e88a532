"""LoRA fine-tuning as a user runs it: `harmonia train` with LoRA settings on the LLM (the tower and
projector frozen, or the projector trained fully), then `harmonia export --adapter`: peft puts the
adapter on the base checkpoint and computes what the merged export computes; the run's checkpoint
records the settings."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console

from harmonia.config import load_config
from harmonia.data.synth import write_synthetic_dataset
from harmonia.errors import ConfigError
from harmonia.train import run_training
from harmonia.train.export import export_checkpoint
from harmonia.train.tiny_llava import write_tiny_llava

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base = write_tiny_llava(tmp / "base")
    write_synthetic_dataset(tmp / "data", 48, seed=0, heldout=1 / 6, tile=32, fmt="llava")
    config = load_config(None, [
        f"--model.hf={base}", "--model.frozen=vision,vision_proj", "--model.lora=llm", "--model.lora_rank=4",
        "--model.lora_alpha=16", "--model.lora_dropout=0.1", "--model.lora_targets=q_proj,v_proj,down_proj",
        f"--data.path={tmp / 'data' / 'train' / 'llava.json'}", "--train.steps=4", "--train.global_batch=8",
        "--train.warmup=1", "--train.lr=1e-2", "--parallel.world_size=2", "--parallel.timeout_s=400",
        "--checkpoint.every=2", "--checkpoint.export_every=2",
        "--log.tensorboard=false", f"--log.dir={tmp / 'run'}", f"--checkpoint.dir={tmp / 'run' / 'ck'}"])
    run_training(config, Console(file=io.StringIO(), width=200))
    return tmp


def test_the_adapter_computes_the_merged_model(job) -> None:
    export_checkpoint(job / "run" / "ck", job / "adapter", dtype="float32", adapter=True)
    export_checkpoint(job / "run" / "ck", job / "merged", dtype="float32")
    config = json.loads((job / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 16.0, 0.1)
    assert {p.rpartition(".")[2] for p in config["target_modules"]} == {"q_proj", "v_proj", "down_proj"}
    base = transformers.LlavaForConditionalGeneration.from_pretrained(job / "base").eval()
    merged = transformers.LlavaForConditionalGeneration.from_pretrained(job / "merged").eval()
    ids = torch.randint(4, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        want = merged(input_ids=ids).logits
        got = peft.PeftModel.from_pretrained(base, job / "adapter").eval()(input_ids=ids).logits
    assert not torch.allclose(want, before, atol=1e-4), "training changed the adapters"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_checkpoint_records_the_lora_settings(job) -> None:
    step = sorted((job / "run" / "ck").glob("step-*"))[-1]
    fingerprint = json.loads((step / "trainer.json").read_text())["fingerprint"]
    assert fingerprint["lora"] == {"llm": {"rank": 4, "alpha": 16.0, "dropout": 0.1,
                                           "targets": ["q_proj", "v_proj", "down_proj"]}}


def test_a_fully_trained_projector_goes_in_the_adapter(tmp_path) -> None:
    """LoRA on the LLM, the projector trained fully, the tower frozen (the usual LLaVA recipe): the
    adapter saves the projector whole (``modules_to_save``) and peft computes the merged export's
    logits on an image sample."""
    from PIL import Image

    from harmonia.train.hf_generate import _messages, load_processor

    base = write_tiny_llava(tmp_path / "base")
    write_synthetic_dataset(tmp_path / "data", 16, seed=0, heldout=1 / 4, tile=32, fmt="llava")
    config = load_config(None, [
        f"--model.hf={base}", "--model.lora=llm", f"--data.path={tmp_path / 'data' / 'train' / 'llava.json'}",
        "--train.steps=1", "--train.global_batch=4", "--train.warmup=0", "--parallel.world_size=1",
        "--log.tensorboard=false", f"--log.dir={tmp_path / 'run'}", f"--checkpoint.dir={tmp_path / 'ck'}"])
    run_training(config, Console(file=io.StringIO(), width=200))
    export_checkpoint(tmp_path / "ck", tmp_path / "adapter", dtype="float32", adapter=True)
    export_checkpoint(tmp_path / "ck", tmp_path / "merged", dtype="float32")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == [
        "model.multi_modal_projector"]
    row = next(r for r in json.loads((tmp_path / "data" / "train" / "llava.json").read_text()) if "image" in r)
    processor = load_processor(base)
    text = processor.apply_chat_template(_messages(row["conversations"])[0], add_generation_prompt=True)
    image = Image.open(tmp_path / "data" / "train" / row["image"]).convert("RGB")
    inputs = processor(images=[image], text=[text], return_tensors="pt")
    with torch.no_grad():
        source = transformers.LlavaForConditionalGeneration.from_pretrained(base).eval()
        before = source(**inputs).logits
        want = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()(**inputs).logits
        got = peft.PeftModel.from_pretrained(source, tmp_path / "adapter").eval()(**inputs).logits
    assert not torch.allclose(want, before, atol=1e-4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_hf_directories_are_written_while_training(job) -> None:
    """checkpoint.export_every=2 over 4 steps: step-2 and step-4 as HF directories, whole (no .partial
    left), the last equal to what `harmonia export` writes afterwards."""
    from harmonia.model.hf.io import read_state_dict

    hf = job / "run" / "ck" / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["step-2", "step-4"]
    export_checkpoint(job / "run" / "ck", job / "final")
    during, after = read_state_dict(hf / "step-4"), read_state_dict(job / "final")
    assert during.keys() == after.keys() and all(torch.equal(during[k], after[k]) for k in after)
    transformers.LlavaForConditionalGeneration.from_pretrained(hf / "step-2")


def test_export_every_must_follow_the_checkpoints(tmp_path) -> None:
    with pytest.raises(ConfigError, match="checkpoint.export_every"):
        load_config(None, ["--checkpoint.every=3", "--checkpoint.export_every=2"])
    with pytest.raises(ConfigError, match="a preset model"):
        load_config(None, ["--model.preset=tiny-vlm", "--checkpoint.every=2", "--checkpoint.export_every=2"])


def test_the_checkpoint_holds_only_what_training_changed(job) -> None:
    """The frozen tower, projector and LLM base stay in the source: the checkpoint holds the adapters
    and their optimizer states (a quarter of the tiny base's bytes; a 7B base's LoRA: under 1%)."""
    import torch.distributed.checkpoint as dcp

    from harmonia.train.weights import is_adapter

    step = sorted((job / "run" / "ck").glob("step-*"))[-1]
    stored = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    weights = [k.removeprefix("model.") for k in stored if k.startswith("model.")]
    assert weights and all(is_adapter(k) for k in weights)
    assert sorted(json.loads((step / "trainer.json").read_text())["from_source"]) == ["llm", "vision", "vision_proj"]
    base = sum(p.stat().st_size for p in (job / "base").glob("*.safetensors"))
    assert sum(p.stat().st_size for p in step.glob("*.distcp")) < base / 2  # adapters and Adam: 0.25x here


def _lora_job(tmp, base, steps: int, resume: bool = True) -> list[float]:
    config = load_config(None, [
        f"--model.hf={base}", "--model.frozen=vision,vision_proj", "--model.lora=llm", "--model.lora_rank=4",
        f"--data.path={tmp / 'data' / 'train' / 'llava.json'}", f"--train.steps={steps}", "--train.global_batch=4",
        "--train.warmup=1", "--train.lr=1e-2", "--parallel.world_size=1", "--checkpoint.every=2",
        f"--checkpoint.resume={str(resume).lower()}", "--checkpoint.on_existing=replace", "--log.tensorboard=false",
        f"--log.dir={tmp / 'run'}", f"--checkpoint.dir={tmp / 'ck'}"])
    return run_training(config, Console(file=io.StringIO(), width=200)).losses


def test_resuming_from_the_source_continues_the_run_and_a_changed_source_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    base = write_tiny_llava(tmp_path / "base")
    write_synthetic_dataset(tmp_path / "data", 24, seed=0, heldout=1 / 6, tile=32, fmt="llava")
    whole = _lora_job(tmp_path, base, 4, resume=False)
    _lora_job(tmp_path, base, 2, resume=False)
    assert _lora_job(tmp_path, base, 4) == pytest.approx(whole, rel=1e-5)  # steps 0-1 from the checkpoint
    (weights,) = base.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(k for k in tensors if "layers.0" in k and k.endswith("q_proj.weight"))
    tensors[name] = tensors[name] + 0.01  # the same shapes, other values: a different base model
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model_files"):
        _lora_job(tmp_path, base, 6)
    with pytest.raises(ConfigError, match="files changed"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out")


def test_the_held_out_evaluation_reads_the_checkpoint_beside_its_source(tmp_path) -> None:
    """A run whose checkpoint holds only what training changed (LoRA on the LLM, the tower frozen: their
    base weights stay in the source) ends with the synthetic layout's held-out evaluation: the model
    it evaluates after training is the checkpoint's, the source giving what the checkpoint lacks."""
    base = write_tiny_llava(tmp_path / "base")
    write_synthetic_dataset(tmp_path / "data", 16, seed=0, heldout=1 / 4, tile=32, fmt="llava")
    config = load_config(None, [
        f"--model.hf={base}", "--model.lora=llm", "--model.frozen=vision", f"--data.path={tmp_path / 'data'}",
        "--train.steps=2", "--train.global_batch=4", "--train.warmup=0", "--train.lr=5e-2",
        "--parallel.world_size=1", "--log.tensorboard=false", f"--log.dir={tmp_path / 'run'}",
        f"--checkpoint.dir={tmp_path / 'ck'}"])
    result = run_training(config, Console(file=io.StringIO(), width=200))
    assert result.accuracy and all(n > 0 for _, _, n, _ in result.accuracy.values()), result.accuracy
    step = sorted((tmp_path / "ck").glob("step-*"))[-1]
    held = {k for k in dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata if k.startswith("model.llm.")}
    assert held and not any(".base." in k for k in held)  # the LLM's base weights are the source's
