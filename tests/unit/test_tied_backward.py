"""An LLM chunk holding both uses of tied embeddings keeps one fused backward under split schedules:
the rule, the schedule it gives, the planner pricing the graph the runtime runs, and the executor's
refusal of a split it cannot run. (Its parity with one process: ``llava tied`` cases of
tests/distributed/test_mllm_parity.py.)"""

from dataclasses import replace

import pytest

from harmonia.errors import ScheduleError
from harmonia.model.llm import DecoderLM
from harmonia.model.presets import mllm_preset
from harmonia.schedule import build_schedule, lower
from harmonia.schedule.actions import Action, Kind
from harmonia.schedule.graph import LLM, fused_backward
from harmonia.schedule.layout import Layout, Placement
from harmonia.schedule.plan import Plan
from harmonia.schedule.stagework import plan_graph
from harmonia.schedule.validator import validate
from harmonia.train.rank import schedule_graph
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset


def _tied(tie: bool = True):
    spec = mllm_preset("tiny-omni")
    return replace(spec, llm=replace(spec.llm, tie_embeddings=tie))


@pytest.mark.parametrize("llm, tie, fused", [
    (Layout(), True, (True,)),
    (Layout(dp=2), True, (True,)),
    (Layout(pp=2), True, (False, False)),
    (Layout(virtual_stages=2), True, (False, False)),
    (Layout(), False, (False,)),
])
def test_only_a_chunk_holding_both_tied_uses_is_fused(llm, tie, fused) -> None:
    assert fused_backward({"vision": Layout(), LLM: llm}, tie) == {LLM: fused}


def test_zero_bubble_keeps_the_tied_chunk_fused_and_splits_the_rest() -> None:
    spec = _tied()
    plan = Plan("tiny-omni", {"vision": Layout(), "audio": Layout(), LLM: Layout()}, Placement.COLOCATED, "zb", 4,
                global_batch=8)
    graph = schedule_graph(spec, plan)
    schedule = lower(build_schedule(graph, 4, "zb"))
    validate(schedule)
    kinds = {(a.module, a.kind) for acts in schedule.orders.values() for a in acts if a.kind in
             (Kind.B, Kind.W, Kind.BW)}
    assert (LLM, Kind.BW) in kinds and (LLM, Kind.B) not in kinds and (LLM, Kind.W) not in kinds
    assert ("vision", Kind.W) in kinds  # the encoders keep their weight gradients apart
    untied = schedule_graph(_tied(False), plan)
    assert any(a.kind is Kind.W and a.module == LLM
               for acts in lower(build_schedule(untied, 4, "zb")).orders.values() for a in acts)


def test_the_planner_prices_the_graph_the_runtime_runs() -> None:
    spec = _tied()
    for llm in (Layout(), Layout(pp=2)):
        plan = Plan("tiny-omni", {"vision": Layout(), "audio": Layout(), LLM: llm}, Placement.COLOCATED, "zb", 4,
                    global_batch=8)
        assert plan_graph(plan, CostModel(spec, device_preset("h100"))) == schedule_graph(spec, plan)


def test_the_executor_refuses_to_split_a_tied_chunk_holding_both_uses() -> None:
    from harmonia.runtime.mllm_iteration import check_splittable

    spec = _tied().llm
    whole = DecoderLM(spec, (0, spec.body.n_layers))
    with pytest.raises(ScheduleError, match="cannot be split into B and W; build the stage graph with fused_backward"):
        check_splittable(whole, Action(LLM, 0, Kind.B, 0))
    check_splittable(DecoderLM(spec, (0, 1)), Action(LLM, 0, Kind.B, 0))  # the first stage of two: fine
