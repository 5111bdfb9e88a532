"""`MLLMExecutor.loss_share`'s ``beside_reduction``: host work (a training step's next step, prepared
on the CPU) runs once every action has run and before the gradient reductions are waited for,
without changing the loss or the gradients."""

from __future__ import annotations

import random

import torch

from harmonia.model.batch import TokenizedSample
from harmonia.model.presets import mllm_preset
from harmonia.schedule.layout import Layout

SPEC = mllm_preset("tiny-vlm")


def _samples() -> list[TokenizedSample]:
    rng, g = random.Random(3), torch.Generator().manual_seed(3)
    out = []
    for i in range(4):
        n = rng.randint(3, 12)
        ids = torch.randint(4, SPEC.llm.vocab_size, (n,), generator=g)
        labels = torch.roll(ids, -1)
        labels[-1] = -100
        out.append(TokenizedSample(ids, labels, [("text", n)], sample_id=i))
    return out


def _executor():
    """tiny-vlm's LLM on one rank, two microbatches of its 1F1B schedule and their batch."""
    from harmonia.runtime.meshes import build_module_meshes
    from harmonia.runtime.mllm_executor import MLLMExecutor
    from harmonia.runtime.mllm_inputs import build_rank_batch
    from harmonia.runtime.parallelize import build_stage_modules
    from harmonia.schedule import StageGraph, build_schedule

    layout = Layout()
    torch.manual_seed(0)
    chunks = build_stage_modules(SPEC, "llm", layout, 0, None)
    executor = MLLMExecutor(build_module_meshes({"llm": layout}), {"llm": chunks}, SPEC.llm.hidden,
                            optimizer=torch.optim.SGD)
    graph = StageGraph.from_layouts({"llm": layout}, {"llm": (True,)})
    batch = build_rank_batch({"llm": layout}, 0, [_samples()[:2], _samples()[2:]], [[[0, 1]], [[0, 1]]], {})
    return executor, build_schedule(graph, 2, "1f1b"), batch


def test_host_work_runs_after_every_action_and_before_the_reductions_are_waited_for(one_process_group,
                                                                                   monkeypatch) -> None:
    from harmonia.runtime.runner import ModuleRunner

    executor, schedule, batch = _executor()
    loss = executor.loss_share(schedule, batch)
    grads = [p.grad.clone() for p in executor.trainable]
    events = []
    finish = ModuleRunner.finish_reduction
    monkeypatch.setattr(ModuleRunner, "finish_reduction", lambda self: events.append("waited") or finish(self))

    def beside() -> None:  # every action has run: every gradient is there (the step cleared them first)
        events.append("beside")
        assert all(p.grad is not None for p in executor.trainable)

    again = executor.loss_share(schedule, batch, beside)
    assert events == ["beside", "waited"]
    assert torch.equal(again, loss) and all(torch.equal(g, p.grad) for g, p in zip(grads, executor.trainable))
