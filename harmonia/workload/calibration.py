"""A device's measured efficiency factors (`harmonia profile` writes them; the cost model's
``calibration`` reads them): the achieved fraction of peak FLOP/s per phase over whole blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harmonia.errors import ConfigError

PHASES = ("F", "B", "W")


@dataclass(frozen=True)
class Calibration:
    """Measured efficiency factors: achieved fraction of ``peak_flops`` per phase, over a whole block's
    FLOPs (its matmul, attention and elementwise kernels together).

    Attributes:
        device: device name the numbers were measured on.
        flops_efficiency: phase -> achieved fraction of peak.
        measurements: raw rows (layer, tokens, phase, seconds, flops) for reference.
        host_cpu_s: rank -> CPU seconds per step its process spends outside compute (preparing the
            next step, the optimizer, communication), measured where ranks share cores; the
            simulator runs it beside their compute on those cores (`harmonia.sim.shared`).
    """

    device: str
    flops_efficiency: dict[str, float]
    measurements: list[dict] = field(default_factory=list)
    host_cpu_s: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.flops_efficiency.items() if k not in PHASES or not 0 < v <= 1.5}
        if bad:
            raise ConfigError(
                f"calibration for {self.device!r}: efficiencies {bad} invalid; expected phases "
                f"{PHASES} with values in (0, 1.5]"
            )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(
            {"device": self.device, "flops_efficiency": self.flops_efficiency,
             "measurements": self.measurements, "host_cpu_s": self.host_cpu_s}, indent=1))

    @staticmethod
    def load(path: str | Path) -> Calibration:
        try:
            raw = json.loads(Path(path).read_text())
            return Calibration(raw["device"], dict(raw["flops_efficiency"]), list(raw.get("measurements", [])),
                               {int(r): float(s) for r, s in raw.get("host_cpu_s", {}).items()})
        except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
            raise ConfigError(
                f"calibration file {path}: {err}; expected JSON written by `harmonia profile`"
            ) from None
