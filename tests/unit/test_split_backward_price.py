"""A backward split into B and W (zero-bubble) costs the host more than the fused one where the host
runs the kernels (`DeviceSpec.split_backward_s`): the simulator's B and W tasks and the search's work
bound add it, a fused backward and a calibrated cost model do not."""

import dataclasses

import pytest

from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from harmonia.plan.bounds import work_bound_busy
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.schedule.rank_actions import plan_rank_actions
from harmonia.schedule.stagework import iteration_schedule, plan_iteration_work, stage_layer_range
from harmonia.sim.tasks import build_tasks
from harmonia.workload.calibration import PHASES, Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.traces import synthesize_trace
from tests.unit.iteration_helpers import assignment

SPEC = mllm_preset("tiny-vlm", training={"vision": "frozen"})
CPU = device_preset("cpu")
UNSPLIT = dataclasses.replace(CPU, split_backward_s=(0.0, 0.0))


def _plan(schedule: str) -> Plan:
    return Plan("tiny-vlm", {"vision": Layout(), "llm": Layout(pp=2, rank_offset=1)}, "disjoint",
                schedule=schedule, global_batch=8, n_microbatches=4)


def _durations(schedule: str, device) -> dict[str, float]:
    """Every task's seconds by name, and the work bound's busiest rank."""
    plan, cost = _plan(schedule), CostModel(SPEC, device)
    samples = synthesize_trace(8, {"image": 1.0}, seed=0)
    iw = plan_iteration_work(samples, plan, cost, assignment(plan, cost, samples, [[[0, 1], [2, 3], [4, 5], [6, 7]]]))
    sched = iteration_schedule(plan, cost, iw)
    cluster = cluster_from_string("cpu:1x3")  # the cost model prices the split from its own device
    tasks, _, _ = build_tasks(plan, cost, iw, plan_rank_actions(plan.layouts, sched), sched.graph, cluster)
    out = {t.name: t.duration for t in tasks if t.kind in ("F", "B", "W", "BW")}
    out["bound"] = work_bound_busy(plan, cost, cluster, iw)[0]
    return out


def test_the_cost_model_counts_each_phase_s_layers() -> None:
    cost = CostModel(SPEC, CPU)
    n = len(cost.layers["llm"])
    layers = cost.layers["llm"]
    b, w = cost.split_backward_extra("llm", 0, n)
    s_b, s_w = CPU.split_backward_s
    assert (b, w) == pytest.approx((sum(x.needs_b for x in layers) * s_b, sum(x.needs_w for x in layers) * s_w))
    assert b > 0 and w > 0
    assert CostModel(SPEC, UNSPLIT).split_backward_extra("llm", 0, n) == (0.0, 0.0)
    calibrated = CostModel(SPEC, CPU, Calibration("cpu", {p: 0.1 for p in PHASES}))
    assert calibrated.split_backward_extra("llm", 0, n) == (0.0, 0.0)  # measured whole in its phases


def test_split_b_and_w_tasks_pay_it_and_fused_backwards_do_not() -> None:
    cost = CostModel(SPEC, CPU)
    plan = _plan("zb")
    split, unsplit = _durations("zb", CPU), _durations("zb", UNSPLIT)
    extras = {s: cost.split_backward_extra("llm", *stage_layer_range(cost, plan, "llm", s)) for s in (0, 1)}
    checked = 0
    for name, seconds in split.items():
        if name == "bound":
            continue
        stage = int(name.split(".s")[1].split(".")[0])
        kind = name.split(".")[3].rstrip("0123456789")
        want = unsplit[name] + (extras[stage][kind == "W"] if name.startswith("llm") and kind in "BW" else 0.0)
        assert seconds == pytest.approx(want, rel=1e-12), name
        checked += kind in ("B", "W") and name.startswith("llm")
    assert checked == 2 * 2 * 4  # B and W of 2 stages x 4 microbatches
    assert split["bound"] > unsplit["bound"]
    fused, fused_unsplit = _durations("1f1b", CPU), _durations("1f1b", UNSPLIT)
    assert fused == fused_unsplit  # BW is one autograd pass: nothing to add


@pytest.mark.parametrize("bad", [(-1e-4, 0.0), (1e-4,)])
def test_a_split_price_that_is_not_two_seconds_is_refused(bad) -> None:
    with pytest.raises(ConfigError, match="split_backward_s"):
        dataclasses.replace(CPU, split_backward_s=bad)


def test_an_accelerator_is_refused_a_host_split_price() -> None:
    with pytest.raises(ConfigError, match="kernels_on_host"):
        dataclasses.replace(device_preset("h100"), split_backward_s=(1e-4, 1e-4))
