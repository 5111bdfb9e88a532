"""A split backward (zero bubble) as the runtime runs it: torch.distributed.pipelining's
``stage_backward_input`` keeps the autograd graph and every trained weight's output gradient until
``stage_backward_weight``; the cost model and the memory replay price exactly that."""

from __future__ import annotations

import pytest

from harmonia.model.presets import mllm_preset
from harmonia.schedule.stagework import MicrobatchWork
from harmonia.sim.memory import unit_memory
from harmonia.workload.cost import CostModel, PhaseTimes
from harmonia.workload.devices import device_preset


@pytest.mark.parametrize("tp", [1, 2])
def test_a_trained_blocks_w_keeps_its_weight_ops_output_gradients(tp) -> None:
    mllm = mllm_preset("llama3-8b")
    cost = CostModel(mllm, device_preset("h100"))
    spec = mllm.llm.body
    h, q, kv, f = spec.hidden, spec.q_dim, spec.kv_dim, spec.ffn_hidden
    # q, k, v and SwiGLU's gate and up split over TP; the out and down projections and two norms whole
    per_token = (q + 2 * kv + 2 * f) / tp + 4 * h
    assert cost.wgrad_bytes("llm", 1000, 1, 3, tp, cp=2) == pytest.approx(2 * per_token * 1000 * cost.act_bytes / 2)
    frozen = CostModel(mllm_preset("llama3-8b", {"llm": "frozen"}), device_preset("h100"))
    assert frozen.wgrad_bytes("llm", 1000, 1, 3) == 0.0


def test_b_frees_nothing_and_keeps_ws_gradients_which_w_frees_with_the_activations() -> None:
    work = MicrobatchWork(PhaseTimes(1.0, 1.0, 1.0), act_bytes=100.0, transient=7.0, w_held=30.0)
    assert unit_memory(work, "F", False, True)[0] == 100.0
    assert unit_memory(work, "B", False, True) == (30.0, 7.0)  # split: the graph stays for W
    assert unit_memory(work, "W", False, True) == (-130.0, 0.0)
    assert unit_memory(work, "BW", False, True)[0] == -100.0  # fused: nothing kept for a later W
    assert unit_memory(work, "W", True, True)[0] == -100.0  # a stage whose whole backward is its W


def test_w_holds_the_two_largest_weight_gradients_it_makes() -> None:
    mllm = mllm_preset("llama3-8b")
    cost = CostModel(mllm, device_preset("h100"))
    h, f, v = mllm.llm.hidden, mllm.llm.body.ffn_hidden, mllm.llm.vocab_size
    assert cost.w_transient_bytes("llm", 1, 3, tp=2) == 2 * h * f * 4 / 2  # SwiGLU's gate and up
    assert cost.w_transient_bytes("llm", 0, 2) == (v * h + h * f) * 4  # the embedding and a gate
    work = MicrobatchWork(PhaseTimes(1.0, 1.0, 1.0), act_bytes=100.0, w_held=30.0, w_transient=9.0)
    assert unit_memory(work, "W", False, True) == (-130.0, 9.0)
