"""Fit the cost model to a measured step, so simulated and measured steps can be compared.

A calibration is the achieved fraction of the device's peak over whole blocks' FLOPs
(`harmonia.workload.calibration.Calibration`): nominal efficiencies describe well-fed accelerators, and
a small model on an oversubscribed CPU runs far below them (per-op overheads, ranks sharing
cores). After a warm-up step, every rank's measured compute actions (F, B, W, fused BW) are summed,
and the FLOPs the simulator gave the same step's compute tasks are divided by them:

    efficiency = sum(simulated compute FLOPs) / (peak * sum(measured compute s))

so the calibrated cost model, which runs a phase's FLOPs at that rate, spends the measured seconds.
Where the job's ranks share cores (`ClusterSpec.cores`), an action's wall time also holds the
time its rank waited for a core, which the simulator adds itself (`harmonia.sim.shared`): there the
measured seconds are the actions' CPU seconds (the rank's thread; its intra-op threads are one),
the time each takes on a core of its own, and each rank's CPU outside its compute actions in the
step (its process's CPU seconds over the step less its actions': the prefetch thread preparing the
next step, the optimizer, the collectives' threads) is kept beside the fit, for the simulator to
run on the same cores.
One factor for all phases keeps the fit to one number per job (per-phase ratios would also absorb
the fused-versus-split backward difference). Measured actions include waits inside them (a
receive that blocks), so the fitted rate is a lower bound and the calibrated simulation errs slow;
what remains between the calibrated simulation and the measurement is scheduling, communication
and waiting that the simulator models differently from the run.
"""

from __future__ import annotations

from typing import NamedTuple

from harmonia.sim.engine import Timeline
from harmonia.workload.calibration import PHASES, Calibration
from harmonia.workload.cost import CostModel

COMPUTE = ("F", "B", "W", "BW")


class MeasuredAction(NamedTuple):
    """One compute action a rank ran: its name, module and kind, start and end (seconds from the
    step's start) and the CPU seconds its thread spent in it."""

    name: str
    module: str
    kind: str
    start: float
    end: float
    cpu_s: float


def fit_calibration(cost: CostModel, measured: dict[int, list[MeasuredAction]], simulated: Timeline,
                    cpu_time: bool = False, process_cpu_s: dict[int, float] | None = None) -> Calibration | None:
    """A calibration making ``simulated``'s compute match ``measured``'s; None when either has none.

    Args:
        cost: the cost model the simulation used.
        measured: rank -> every compute action of one step.
        simulated: the simulator's timeline of the same step.
        cpu_time: fit to the actions' CPU seconds (ranks sharing cores) instead of their wall time.
        process_cpu_s: with ``cpu_time``, rank -> its process's CPU seconds over the step; what its
            actions did not spend becomes the calibration's ``host_cpu_s``.
    """
    measured_s = sum(a.cpu_s if cpu_time else a.end - a.start
                     for actions in measured.values() for a in actions if a.kind in COMPUTE)
    simulated_s = sum(t.duration for t in simulated.tasks if t.kind in COMPUTE)
    flops = sum(t.flops for t in simulated.tasks if t.kind in COMPUTE)
    if measured_s <= 0 or simulated_s <= 0 or flops <= 0:
        return None
    efficiency = min(1.5, flops / (cost.device.peak_flops * measured_s))
    host = {r: max(0.0, total - sum(a.cpu_s for a in measured.get(r, ())))
            for r, total in (process_cpu_s or {}).items()} if cpu_time else {}
    return Calibration(cost.device.name, {p: efficiency for p in PHASES},
                       [{"measured_compute_s": measured_s, "simulated_compute_s": simulated_s,
                         "slowdown": measured_s / simulated_s}], host)
