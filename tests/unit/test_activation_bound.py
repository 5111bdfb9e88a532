"""`harmonia.sim.memory.activation_bound`: no order of a rank's actions, whatever their kinds (F,
fused BW, split B and W, a W-only stage's W), holds more activations than the bound says, the
transients of recomputed blocks, intermediates and weight gradients included; a rank counts only
the stages it runs."""

from __future__ import annotations

import random

from harmonia.schedule.stagework import IterationWork, MicrobatchWork, StageKey
from harmonia.sim.engine import running_peak
from harmonia.sim.memory import activation_bound, unit_memory
from harmonia.workload.cost import PhaseTimes

LLM_KEY, VISION_KEY = StageKey("llm", 0, 0), StageKey("vision", 0, 0)
STAGE_RANKS = {LLM_KEY: (0,), VISION_KEY: (0, 1)}  # rank 1 runs the vision stage alone
BACKWARDS = {  # a unit's phases after its F: (kind, W-only stage, the stage has W)
    "fused": [("BW", False, False)], "split": [("B", False, True), ("W", False, True)],
    "w-only": [("W", True, True)]}


def _unit(rng: random.Random) -> MicrobatchWork:
    """Transients up to 3x the kept bytes: a bound that dropped one would show."""
    return MicrobatchWork(PhaseTimes(), act_bytes=rng.uniform(0, 10), transient=rng.uniform(0, 30),
                          f_transient=rng.choice([0.0, rng.uniform(0, 30)]), w_held=rng.uniform(0, 5),
                          w_transient=rng.uniform(0, 30))


def test_no_order_of_a_ranks_phases_holds_more_than_the_bound() -> None:
    rng = random.Random(0)
    tight = 0
    for _ in range(300):
        work = {(key, m, sub): _unit(rng) for key in STAGE_RANKS for m in range(rng.randint(1, 3))
                for sub in ((None,) if key == LLM_KEY else (0, 1))}
        bound = activation_bound(IterationWork(assignment=None, work=work, stage_ranks=STAGE_RANKS))
        assert set(bound) == {0, 1}
        for rank in (0, 1):
            backward = BACKWARDS[rng.choice(list(BACKWARDS))]
            events = [unit_memory(w, *phase) for (key, _, _), w in work.items() if rank in STAGE_RANKS[key]
                      for phase in [("F", False, backward[0][2]), *backward]]
            for _ in range(30):  # orders of any kind, dependencies ignored
                rng.shuffle(events)
                peak = running_peak(events)
                assert peak <= bound[rank] * (1 + 1e-12)
                tight += peak >= 0.6 * bound[rank]
    assert tight > 0, "the bound is never approached: the check proves nothing"
