"""Operator dispatch per layer and phase (`DeviceSpec.dispatch_s`): what a small model's microbatch
costs beyond its kernels, added on the CPU, overlapped on an accelerator, absorbed by a calibration."""

import dataclasses

import pytest

from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from harmonia.workload.calibration import PHASES, Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import DeviceSpec, device_preset
from harmonia.workload.work import ModuleLoad

SPEC = mllm_preset("tiny-vlm", training={"vision": "frozen"})
CPU = device_preset("cpu")
LOAD = ModuleLoad(64, 64 * 65 // 2, 1)


def _without(device: DeviceSpec) -> DeviceSpec:
    return dataclasses.replace(device, dispatch_s=0.0)


def test_the_cpu_adds_each_running_layers_dispatch_to_its_phase() -> None:
    with_, without = CostModel(SPEC, CPU), CostModel(SPEC, _without(CPU))
    layers = without.layers["llm"]
    n = (len(layers), sum(x.needs_b for x in layers), sum(x.needs_w for x in layers))
    got, base = with_.unit_cost("llm", LOAD, 0, len(layers))[0], without.unit_cost("llm", LOAD, 0, len(layers))[0]
    assert (got.F - base.F, got.B - base.B, got.W - base.W) == pytest.approx(tuple(k * CPU.dispatch_s for k in n))
    # a frozen tower's layers run no backward, so they dispatch none
    vision = with_.unit_cost("vision", LOAD, 0, len(with_.layers["vision"]))[0]
    assert vision.B == vision.W == 0.0
    assert vision.F >= len(with_.layers["vision"]) * CPU.dispatch_s


def test_an_accelerator_takes_the_longer_of_kernels_and_dispatch() -> None:
    gpu = dataclasses.replace(device_preset("h100"), dispatch_s=1e-3)
    cost, base = CostModel(SPEC, gpu), CostModel(SPEC, _without(gpu))
    n = len(cost.layers["llm"])
    small = cost.unit_cost("llm", ModuleLoad(4, 10, 1), 0, n)[0]
    assert small.F == pytest.approx(n * 1e-3)  # the kernels take microseconds: the host is the bound
    big_load = ModuleLoad(1 << 22, 1 << 40, 1)
    big, big_base = cost.unit_cost("llm", big_load, 0, n)[0], base.unit_cost("llm", big_load, 0, n)[0]
    assert big.F == big_base.F > n * 1e-3  # dispatch hides behind the kernels


def test_a_calibration_measured_the_dispatch_already() -> None:
    calibration = Calibration("cpu", {p: 0.1 for p in PHASES})
    with_, without = CostModel(SPEC, CPU, calibration), CostModel(SPEC, _without(CPU), calibration)
    n = len(with_.layers["llm"])
    assert with_.unit_cost("llm", LOAD, 0, n)[0] == without.unit_cost("llm", LOAD, 0, n)[0]


def test_dispatch_makes_fewer_microbatches_cheaper_on_a_small_model() -> None:
    cost, base = CostModel(SPEC, CPU), CostModel(SPEC, _without(CPU))
    n = len(cost.layers["llm"])

    def eight_vs_one(c: CostModel) -> float:
        eighth = ModuleLoad(LOAD.tokens // 8, LOAD.pairs // 64, 1)
        return 8 * c.unit_cost("llm", eighth, 0, n)[0].total / c.unit_cost("llm", LOAD, 0, n)[0].total

    assert eight_vs_one(cost) > 3.0 > eight_vs_one(base)


def test_a_negative_dispatch_is_refused() -> None:
    with pytest.raises(ConfigError, match="dispatch_s"):
        dataclasses.replace(CPU, dispatch_s=-1.0)
