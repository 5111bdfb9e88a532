"""Kernel classes of the cost model: elementwise traffic, attention rate, sequence parallelism,
multi-rail collectives and the calibration fit."""

import numpy as np
import pytest

from harmonia.model.presets import mllm_preset
from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
from harmonia.plan.recipes import Candidate
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.train.calibrate import MeasuredAction, fit_calibration
from harmonia.workload.calibration import Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.memory_cost import PARAM_BYTES
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.kernels import elementwise_elems, replicated_activation_elems
from harmonia.workload.work import ModuleLoad

H100 = device_preset("h100")


def test_llama_block_elementwise_traffic_by_hand() -> None:
    mllm = mllm_preset("llama3-8b")
    cost = CostModel(mllm, H100)
    block = cost.layers["llm"][1]
    h, q, kv, f = 4096, 4096, 1024, 14336
    elems = elementwise_elems(mllm, "llm", block)
    # forward: SwiGLU 3f and rotary 2(q + kv) inside TP's shards; norms 4h and residual adds 6h replicated
    assert elems[0].tolist() == [3 * f + 2 * (q + kv), 10 * h]
    assert elems[1].tolist() == [5 * f + 2 * (q + kv), 12 * h]
    assert elems[2].tolist() == [0, 0]
    assert replicated_activation_elems(mllm, "llm", block) == 4 * h  # norm inputs and qkv / MLP-up inputs
    head = cost.layers["llm"][-1]
    assert elementwise_elems(mllm, "llm", head)[1].tolist() == [2 * 128256, 3 * h]


def test_a_frozen_encoder_without_backward_has_no_backward_traffic() -> None:
    mllm = mllm_preset("internvl-8b", training={"vision": "frozen"})
    cost = CostModel(mllm, H100)
    block = cost.layers["vision"][1]
    elems = elementwise_elems(mllm, "vision", block)
    assert elems[0].sum() > 0 and elems[1].sum() == 0 and elems[2].sum() == 0
    assert replicated_activation_elems(mllm, "vision", block) == 0  # it keeps nothing


def test_stage_times_add_the_kernel_classes() -> None:
    cost = CostModel(mllm_preset("llama3-8b"), H100)
    tokens = 8192
    load = ModuleLoad(tokens, tokens * (tokens + 1) // 2, 1)
    layer = cost.layers["llm"][1]
    elem = elementwise_elems(cost.mllm, "llm", layer)
    bw = H100.mem_bw * H100.bw_efficiency
    for tp, cp in ((1, 1), (2, 2)):
        forward = (layer.f_tok * tokens / (tp * cp) / (H100.peak_flops * H100.flops_efficiency)
                   + layer.f_pair * load.pairs / (tp * cp) / (H100.peak_flops * 0.55)
                   + (elem[0, 0] / tp + elem[0, 1]) * tokens / cp * 2 / bw)
        assert cost.stage_times("llm", load, 1, 2, tp, cp).F == pytest.approx(forward, rel=1e-12)
        assert sum(cost.kernel_seconds("llm", load, 1, 2, tp, cp)[0]) == pytest.approx(forward, rel=1e-12)
    # one token reads the weights: the matmul class is memory-bound
    tiny = cost.kernel_seconds("llm", ModuleLoad(1, 1, 1), 1, 2)[0][0]
    assert tiny == pytest.approx(layer.params * PARAM_BYTES / bw)
    # the balancer's costs are the same classes on one device, without the weight-read bound
    costs = cost.costs_from_loads(np.array([[tokens]], dtype=float), np.array([[load.pairs]], dtype=float))
    assert costs[0, 0] == pytest.approx(sum(sum(p) for p in cost.kernel_seconds("llm", load)), rel=1e-9)


def test_sequence_parallelism_splits_the_replicated_activations() -> None:
    mllm = mllm_preset("llama3-70b")
    plain, sp = CostModel(mllm, H100), CostModel(mllm, H100, sequence_parallel=True)
    h, tokens = 8192, 4096
    kept = plain.layers["llm"][1].act_elems_tok
    for tp, cp in ((1, 1), (4, 2)):
        assert sp.activation_bytes("llm", tokens, 1, 2, tp, cp) == pytest.approx(kept * tokens * 2 / (tp * cp))
        replicated = 4 * h * tokens * 2 / cp
        assert plain.activation_bytes("llm", tokens, 1, 2, tp, cp) == pytest.approx(
            (kept * tokens * 2 / cp - replicated) / tp + replicated)
        assert sp.activation_bytes("llm", tokens, 1, 5, tp, cp, recompute=True) == pytest.approx(
            4 * tokens * h * 2 / (tp * cp))  # each recomputed block keeps its input, split by SP


def test_ring_collectives_drive_one_nic_per_rank_of_a_node() -> None:
    cluster = cluster_from_string("h100:4x8")
    gb = 1e9 * H100.bw_efficiency
    assert cluster.group_bandwidth(range(8)) == pytest.approx(450 * gb)  # NVLink
    assert cluster.group_bandwidth(range(16)) == pytest.approx(400 * gb)  # 8 NICs a node, under NVLink
    assert cluster.group_bandwidth(range(0, 32, 2)) == pytest.approx(200 * gb)  # 4 ranks a node
    assert cluster.group_bandwidth([0, 8, 16, 24]) == pytest.approx(50 * gb)  # one rank a node
    assert cluster.group_bandwidth([0, 1, 8]) == pytest.approx(50 * gb)  # the node holding fewest sets it


def test_a_fitted_calibration_reproduces_the_measured_compute(tmp_path) -> None:
    scenario = Scenario("fit", "tiny-vlm", "h100:1x4", "synthetic:image=0.7,text=0.3", 16, iterations=1, search_batches=1)
    run = ScenarioRun(scenario)
    plan = plan_from_layouts(run.mllm, "tiny-vlm", parse_layouts("vision dp4; llm tp1 pp2 dp2"), 4, 16, 2)
    timeline = run.timeline(Candidate("harmonia", plan), 0, 0.0)
    compute = ("F", "B", "W", "BW")
    measured = {}
    for task, start, end in zip(timeline.tasks, timeline.start, timeline.end):
        if task.kind in compute:  # a device 40x slower than the model
            measured.setdefault(task.rank, []).append(MeasuredAction(task.name, task.module, task.kind, start,
                                                                     start + 40 * (end - start), 0.0))
    calibration = fit_calibration(run.cost, measured, timeline)
    run.cost = CostModel(run.mllm, run.cluster.device, calibration)
    again = run.timeline(Candidate("harmonia", plan), 0, 0.0)
    simulated = sum(t.duration for t in again.tasks if t.kind in compute)
    assert simulated == pytest.approx(sum(a.end - a.start for acts in measured.values() for a in acts), rel=1e-6)
    # ranks sharing cores: the fit is to the actions' CPU seconds, what each takes on a core of its own
    on_cores = {r: [a._replace(cpu_s=0.5 * (a.end - a.start)) for a in acts] for r, acts in measured.items()}
    by_cpu = fit_calibration(run.cost, on_cores, timeline, cpu_time=True)
    assert by_cpu.flops_efficiency["F"] == pytest.approx(2 * calibration.flops_efficiency["F"])
    cpu = {r: sum(a.cpu_s for a in acts) + 0.25 for r, acts in on_cores.items()}
    with_host = fit_calibration(run.cost, on_cores, timeline, cpu_time=True, process_cpu_s=cpu)
    assert with_host.host_cpu_s == pytest.approx({r: 0.25 for r in on_cores})
    with_host.save(tmp_path / "calibration.json")
    assert Calibration.load(tmp_path / "calibration.json") == with_host

