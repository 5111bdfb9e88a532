"""`harmonia profile`: B and W are differences of two timings; one within their noise is recorded as such
and left out of the fit, and a phase never measured above the noise keeps the device's own rate."""

from __future__ import annotations

import pytest

from harmonia.cli import main
from harmonia.model.presets import llm_preset, mllm_preset
from harmonia.workload import profile
from harmonia.workload.calibration import Calibration
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import device_preset


def test_a_difference_within_the_timings_noise_is_not_a_time() -> None:
    assert profile.phase_seconds(1.0, 3.0, 4.0) == {"F": 1.0, "B": 2.0, "W": 1.0}
    assert profile.phase_seconds(1.0, 3.0, 3.05)["W"] is None  # 0.05 s of 3.05: under 3%
    assert profile.phase_seconds(1.0, 0.9, 3.0)["B"] is None  # a negative difference


def test_a_phase_within_the_noise_everywhere_keeps_the_devices_rate(monkeypatch, tmp_path, capsys) -> None:
    timings = {128: (1e-3, 3e-3, 4e-3), 256: (2e-3, 6e-3, 6.01e-3)}  # W within the noise at 256 only
    monkeypatch.setattr(profile, "measure_block", lambda spec, t, *a: profile.phase_seconds(*timings[t]))
    device = device_preset("cpu")
    calibration = profile.profile_device(device, llm_preset("tiny-llm").body, (128, 256))
    rows = {(r["tokens"], r["phase"]): r["seconds"] for r in calibration.measurements}
    assert rows[(256, "W")] is None and rows[(128, "W")] == pytest.approx(1e-3)
    w_flops = next(r["flops"] for r in calibration.measurements if r["tokens"] == 128 and r["phase"] == "W")
    assert calibration.flops_efficiency["W"] == pytest.approx(w_flops / (1e-3 * device.peak_flops))  # 128's alone
    timings[128] = (1e-3, 3e-3, 3.02e-3)  # now W is within the noise at every length: not calibrated
    calibration = profile.profile_device(device, llm_preset("tiny-llm").body, (128, 256))
    assert set(calibration.flops_efficiency) == {"F", "B"}
    assert CostModel(mllm_preset("tiny-vlm"), device, calibration).efficiency("W") == device.flops_efficiency
    out = tmp_path / "calibration.json"
    assert main(["profile", "--lengths", "128,256", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "W: within the timings' noise at every length, not calibrated" in printed and "within noise" in printed
    assert set(Calibration.load(out).flops_efficiency) == {"F", "B"}
