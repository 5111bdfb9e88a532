"""A short single-process CPU training run on the synthetic dataset beats chance on held-out answers."""

import random

import pytest
import torch

from harmonia.data.evaluate import answer_accuracy, chance_accuracy
from harmonia.data.loader import MultimodalDataset, collate
from harmonia.data.synth import write_synthetic_dataset
from harmonia.model.mllm import build_mllm_model
from harmonia.model.presets import mllm_preset
from harmonia.workload.shapes import ModalityItem, SampleShape


@pytest.mark.slow
def test_tiny_omni_learns_the_synthetic_tasks(tmp_path):
    torch.manual_seed(0)
    rng = random.Random(0)
    trace = [SampleShape(8, (ModalityItem.image(tiles=1),)), SampleShape(8, (ModalityItem.audio(1.0),)),
             SampleShape(8, (ModalityItem.video(frames=4, tiles=1),))]
    write_synthetic_dataset(tmp_path, 480, seed=0, heldout=0.25, trace=trace,
                            mix={"colour": 1, "pitch": 1, "direction": 1})
    spec = mllm_preset("tiny-omni")
    train = MultimodalDataset(tmp_path / "train", spec)
    held = MultimodalDataset(tmp_path / "heldout", spec)
    train_samples, held_samples = train.load(list(range(len(train)))), held.load(list(range(len(held))))
    model = build_mllm_model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    for _ in range(120):
        batch = collate(rng.sample(train_samples, 16))
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        warmup.step()
    acc = answer_accuracy(model, held_samples)
    mean = sum(a for a, _ in acc.values()) / len(acc)
    chance = sum(chance_accuracy(t) for t in acc) / len(acc)
    print(f"held-out accuracy {acc}, mean {mean:.2f} vs chance {chance:.2f}")
    assert set(acc) == {"colour", "pitch", "direction"}
    assert mean > chance + 0.25
    assert all(a > chance_accuracy(t) for t, (a, _) in acc.items())


def test_a_llava_set_of_a_trace_with_videos_is_refused_before_writing(tmp_path):
    """LLaVA JSON holds the image and text tasks: a trace asking for videos is refused with the way out,
    and nothing is written (it failed half-way with a KeyError)."""
    from harmonia.errors import ConfigError

    video = SampleShape(40, [ModalityItem.video(4, 1)])
    with pytest.raises(ConfigError, match=r"asks for \['direction'\] .*--format harmonia"):
        write_synthetic_dataset(tmp_path / "out", 8, trace=[video], fmt="llava")
    assert not (tmp_path / "out").exists()
