"""Frozen-aware rules, memory, times and calibration of the cost model."""

import numpy as np
import pytest

from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from harmonia.workload.calibration import Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import ClusterSpec, cluster_from_string, device_preset
from harmonia.workload.shapes import ModalityItem, SampleShape
from harmonia.workload.work import ModuleLoad

H100 = device_preset("h100")


def phases(cost: CostModel, module: str) -> tuple[bool, bool]:
    """(any B, any W) over the module's layers."""
    layers = cost.layers[module]
    return any(x.b_tok > 0 for x in layers), any(x.w_tok > 0 for x in layers)


def test_frozen_encoder_at_the_front_has_no_backward() -> None:
    cost = CostModel(mllm_preset("internvl-8b", training={"vision": "frozen"}), H100)
    assert phases(cost, "vision") == (False, False)
    assert cost.activation_bytes("vision", 1000) == 0
    # the projector trains but nothing upstream does: W, and B only inside (no input gradient)
    proj = cost.layers["vision_proj"][0]
    assert proj.needs_w and not proj.needs_b


def test_frozen_llm_behind_trainable_projector_needs_b_not_w() -> None:
    cost = CostModel(mllm_preset("internvl-8b", training={"vision": "frozen", "llm": "frozen"}), H100)
    b, w = phases(cost, "llm")
    assert b and not w
    assert all(x.needs_b for x in cost.layers["llm"][1:])
    full = CostModel(mllm_preset("internvl-8b"), H100)
    assert 0 < cost.activation_bytes("llm", 1000) < full.activation_bytes("llm", 1000)


def test_everything_frozen_but_llm_skips_encoder_backward() -> None:
    cost = CostModel(mllm_preset("omni-8b", training={"vision": "frozen", "audio": "frozen",
                                                     "vision_proj": "frozen", "audio_proj": "frozen"}), H100)
    for module in ("vision", "audio", "vision_proj", "audio_proj"):
        assert phases(cost, module) == (False, False)
        assert not cost.needs_backward(module)
    # the first trainable layer (embedding) has no input gradient; the blocks after it do
    assert not cost.layers["llm"][0].needs_b and cost.layers["llm"][1].needs_b


def test_lora_needs_b_and_adapter_only_w() -> None:
    cost = CostModel(mllm_preset("internvl-8b", training={"llm": "lora"}), H100)
    full = CostModel(mllm_preset("internvl-8b"), H100)
    blk, blk_full = cost.layers["llm"][3], full.layers["llm"][3]
    assert blk.needs_b and blk.needs_w
    assert 0 < blk.trainable_params < 0.01 * blk.params
    assert 0 < blk.w_tok < 0.01 * blk_full.w_tok
    # the frozen base is held in bf16 under mixed precision (2 of a trained weight's 16 bytes), adapters train
    assert 0.125 * full.state_bytes("llm") < cost.state_bytes("llm") < 0.135 * full.state_bytes("llm")


def test_sample_costs_are_additive_and_ordered() -> None:
    cost = CostModel(mllm_preset("omni-8b"), H100)
    samples = [SampleShape(100, (ModalityItem.image(tiles=t),)) for t in (1, 3, 5)]
    samples.append(SampleShape(50, (ModalityItem.audio(20.0),)))
    c = cost.sample_costs(samples)
    assert c.shape == (4, 5)
    vision = cost.modules.index("vision")
    assert c[0, vision] < c[1, vision] < c[2, vision] and c[3, vision] == 0
    assert c[3, cost.modules.index("audio")] > 0
    # additive: the cost of a set is the sum of its samples' costs
    assert np.allclose(cost.sample_costs(samples[:2]).sum(0), c[:2].sum(0))


def test_stage_times_roofline_and_parallel_degrees() -> None:
    cost = CostModel(mllm_preset("internvl-8b"), H100)
    load = ModuleLoad(4096, 4096 * 4097 // 2, 1)
    one = cost.stage_times("llm", load, 1, 9)
    tp2 = cost.stage_times("llm", load, 1, 9, tp=2)
    assert one.F > 0 and one.B > 0 and one.W > 0
    sequence_parallel = CostModel(mllm_preset("internvl-8b"), H100, sequence_parallel=True)
    assert sequence_parallel.stage_times("llm", load, 1, 9, tp=2).F == pytest.approx(one.F / 2, rel=1e-6)
    assert tp2.F > one.F / 2  # without sequence parallelism norms and residual adds run whole on each TP rank
    # a single token is memory-bound: reading the weights dominates
    tiny = cost.stage_times("llm", ModuleLoad(1, 1, 1), 1, 9)
    weight_bytes = cost.param_count("llm", 1, 9)[0] * 2
    assert tiny.F == pytest.approx(weight_bytes / (H100.mem_bw * H100.bw_efficiency), rel=0.01)


def test_calibration_round_trip_and_effect(tmp_path) -> None:
    mllm = mllm_preset("internvl-8b")
    cal = Calibration("h100", {"F": 0.3, "B": 0.3, "W": 0.3})
    cal.save(tmp_path / "c.json")
    loaded = Calibration.load(tmp_path / "c.json")
    assert loaded == cal
    calibrated = CostModel(mllm, H100, loaded)
    slow = calibrated.sample_costs([SampleShape(500)])
    flops = calibrated.model_flops([SampleShape(500)])  # a measured efficiency covers the whole block
    assert slow.sum() == pytest.approx(flops / (H100.peak_flops * 0.3), rel=1e-9)
    assert slow.sum() > CostModel(mllm, H100).sample_costs([SampleShape(500)]).sum()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="harmonia profile"):
        Calibration.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="efficiencies"):
        Calibration("h100", {"X": 0.5})


def test_cluster_specs() -> None:
    c = cluster_from_string("h100:2x8")
    assert c.world_size == 16 and c.node_of(9) == 1
    assert c.p2p_bandwidth(0, 1) > c.p2p_bandwidth(0, 9)
    assert c.group_bandwidth([0, 1, 2]) > c.group_bandwidth([7, 8])
    with pytest.raises(ConfigError, match="unknown device"):
        cluster_from_string("tpu:1x4")
    with pytest.raises(ConfigError, match="n_nodes"):
        ClusterSpec(H100, 0)


def test_a_unit_from_its_range_factors_equals_the_general_path_bit_for_bit() -> None:
    """`unit_cost` prices an uncalibrated unit from factors kept per range; its numbers are those
    of `stage_times`, `phase_flops`, `activation_bytes` and the transients."""
    import random

    from harmonia.workload.work import ModuleLoad

    rnd = random.Random(0)
    for preset in ("omni-8b", "internvl-8b"):
        cost = CostModel(mllm_preset(preset, training={"vision": "frozen"}), H100)
        for module in ("llm", "vision"):
            n = len(cost.layers[module])
            for _ in range(200):
                a = rnd.randrange(0, n)
                b, tp, cp = rnd.randrange(a, n + 1), rnd.choice([1, 2, 4]), rnd.choice([1, 2])
                share = rnd.choice([0.0, 0.25, 0.5, 1.0, True])
                load = ModuleLoad(rnd.randrange(0, 50000), rnd.randrange(0, 10**8), rnd.randrange(0, 40))
                want = (cost.stage_times(module, load, a, b, tp, cp, share), sum(cost.phase_flops(module, load, a, b)),
                        cost.activation_bytes(module, load.tokens, a, b, tp, cp, share),
                        cost.backward_transient_bytes(module, load.tokens, a, b, tp, cp, share),
                        cost.forward_transient_bytes(module, load.tokens, a, b, tp, cp))
                assert cost.unit_cost(module, load, a, b, tp, cp, share) == want


@pytest.mark.parametrize("device", ["h100", "cpu"])
def test_units_priced_together_equal_units_priced_one_by_one_bit_for_bit(device: str) -> None:
    """`unit_costs` prices many loads of one range in one vectorised pass (a search's LLM replicas):
    each result is `unit_cost`'s, dispatch (a CPU device's per-layer cost), recompute and an encoder's
    CPU attention masks included."""
    import random

    rnd = random.Random(1)
    cost = CostModel(mllm_preset("omni-8b", training={"vision": "frozen"}), device_preset(device))
    loads = [ModuleLoad(rnd.randrange(0, 50000), rnd.randrange(0, 10**8), rnd.randrange(1, 9),
                        rnd.choice([None, rnd.randrange(0, 10**6)])) for _ in range(40)] + [ModuleLoad()]
    for module in ("llm", "vision"):
        n = len(cost.layers[module])
        for a, b in ((0, n), (0, n // 2), (n // 2, n), (1, n - 1)):
            for tp, cp in ((1, 1), (2, 1), (4, 2)):
                for share in (0.0, 0.25, 1.0):
                    together = cost.unit_costs(module, loads, a, b, tp, cp, share)
                    cost._units.clear()  # one by one, not from what the pass above left
                    assert together == [cost.unit_cost(module, load, a, b, tp, cp, share) for load in loads]
                    assert all(type(x) is float for u in together for x in (u[0].F, u[0].B, u[0].W, *u[1:]))


@pytest.mark.parametrize("tp", [1, 4])
def test_the_last_llm_stage_holds_the_loss_gradients_in_its_backward(tp) -> None:
    """The head's backward holds two fp32 (T, V / tp) gradients (log-softmax output and logits):
    with a 152k vocabulary more than any block's transient, and only on the stage holding the head."""
    cost = CostModel(mllm_preset("internvl-8b"), H100)
    n = len(cost.layers["llm"])
    vocab = cost.mllm.llm.vocab_size
    last = cost.backward_transient_bytes("llm", 1000, n // 2, n, tp=tp)
    first = cost.backward_transient_bytes("llm", 1000, 0, n // 2, tp=tp)
    assert last == pytest.approx(1000 * 2 * vocab * 4 / tp)
    assert first < last and first == cost.backward_transient_bytes("llm", 1000, 1, n // 2, tp=tp)
