"""What each module trains, counted as the runtime builds it, and printed with the plan."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from harmonia.model.lora import apply_training
from harmonia.model.mllm import build_module, trainable_counts
from harmonia.model.presets import mllm_preset
from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
from harmonia.train.job import print_plan


def spec():
    return mllm_preset("tiny-vlm", training={"vision": "frozen", "llm": "lora"})


def test_counts_are_the_built_modules_parameters() -> None:
    s = spec()
    counts = trainable_counts(s)
    assert set(counts) == set(s.module_names)
    for name in s.module_names:
        torch.manual_seed(0)
        module = build_module(s, name)
        apply_training(module, s.training_of(name))
        params = list(module.parameters())
        assert counts[name] == (sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))
    assert counts["vision"][0] == 0 and counts["vision_proj"][0] == counts["vision_proj"][1]
    assert 0 < counts["llm"][0] < counts["llm"][1]  # LoRA: the adapters only


def test_the_plan_printout_says_what_trains() -> None:
    s = spec()
    plan = plan_from_layouts(s, "tiny-vlm", parse_layouts("vision dp2; llm dp2"), 2, 8)
    out = io.StringIO()
    print_plan(plan, None, Console(file=out, width=200), s)
    text = out.getvalue()
    counts = trainable_counts(s)
    trained, total = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
    assert f"trainable parameters: {trained:,} of {total:,} ({trained / total:.2%})" in text
    assert "lora" in text and "frozen" in text and "vision_proj (with its encoder's last stage): trains full" in text
