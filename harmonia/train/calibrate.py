"""Fit the cost model to a measured step, so simulated and measured steps can be compared.

A calibration is the achieved fraction of the device's peak over whole blocks' FLOPs
(`harmonia.workload.calibration.Calibration`): nominal efficiencies describe well-fed accelerators, and
a small model on an oversubscribed CPU runs far below them (per-op overheads, ranks sharing
cores). After a warm-up step, every rank's measured compute actions (F, B, W, fused BW) are summed,
and the FLOPs the simulator gave the same step's compute tasks are divided by them:

    efficiency = sum(simulated compute FLOPs) / (peak * sum(measured compute s))

so the calibrated cost model, which runs a phase's FLOPs at that rate, spends the measured seconds.
One factor for all phases keeps the fit to one number per job (per-phase ratios would also absorb
the fused-versus-split backward difference). Measured actions include waits inside them (a
receive that blocks), so the fitted rate is a lower bound and the calibrated simulation errs slow;
what remains between the calibrated simulation and the measurement is scheduling, communication
and waiting that the simulator models differently from the run.
"""

from __future__ import annotations

from harmonia.sim.engine import Timeline
from harmonia.workload.calibration import PHASES, Calibration
from harmonia.workload.cost import CostModel

COMPUTE = ("F", "B", "W", "BW")


def fit_calibration(cost: CostModel, measured: dict[int, list[tuple[str, str, str, float, float]]],
                    simulated: Timeline) -> Calibration | None:
    """A calibration making ``simulated``'s compute match ``measured``'s; None when either has none.

    Args:
        cost: the cost model the simulation used.
        measured: rank -> (name, module, kind, start s, end s) of every action of one step.
        simulated: the simulator's timeline of the same step.
    """
    measured_s = sum(e - s for actions in measured.values() for _, _, kind, s, e in actions if kind in COMPUTE)
    simulated_s = sum(t.duration for t in simulated.tasks if t.kind in COMPUTE)
    flops = sum(t.flops for t in simulated.tasks if t.kind in COMPUTE)
    if measured_s <= 0 or simulated_s <= 0 or flops <= 0:
        return None
    efficiency = min(1.5, flops / (cost.device.peak_flops * measured_s))
    return Calibration(cost.device.name, {p: efficiency for p in PHASES},
                       [{"measured_compute_s": measured_s, "simulated_compute_s": simulated_s,
                         "slowdown": measured_s / simulated_s}])
