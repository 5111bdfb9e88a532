"""The search's refinements in worker processes (`harmonia.plan.refiners`): the same ranking as one
process, outcomes and failures carried back, workers held to the parts they simulate."""

import os
import signal
import time

import pytest

import harmonia.plan.refiners as refiners
from harmonia.errors import HarmoniaError
from harmonia.plan.refiners import Outcome, Refiners
from harmonia.plan.scenario import Scenario
from harmonia.plan.search import search_plan


def _ranking(report):
    return [(seconds, c.plan) for seconds, _, c in report.ranked], report.peak_bytes


def test_workers_rank_what_one_process_ranks(monkeypatch, shared_traces) -> None:
    """Workers started at once (no seconds here first) refine candidates two at a time; the ranked
    plans, their times and peaks are the one-process search's."""
    scenario = Scenario("wide", "llava-siglip-8b", "h100:8x8", str(shared_traces / "ai2d.csv"), 512,
                        {"vision": "frozen"}, iterations=1, search_batches=2)
    alone = search_plan(scenario, top=3)
    started = []
    real = Refiners._start
    monkeypatch.setattr(refiners, "PARALLEL_AFTER_S", 0.0)
    monkeypatch.setattr(Refiners, "_start", lambda self: started.append(self.workers) or real(self))
    together = search_plan(scenario, top=3, workers=2)
    assert started == [2] and together.workers == 2 and alone.workers == 1
    assert _ranking(together) == _ranking(alone)
    assert together.timelines >= alone.timelines  # the workers' simulations are counted


def _square(i: int, j: int, level: int, value: float) -> Outcome:
    if i < 0:
        raise ValueError("no such candidate")
    time.sleep(0.05 * j if j < 10 else j)
    return Outcome(i, j, [level + 1, value * value], peak=float(os.getpid()))


def test_refinements_run_here_until_the_time_is_spent_then_in_workers() -> None:
    with Refiners(_square, workers=2, after_s=0.0) as pool:
        pool.submit(0, 1, 3, 2.0, (2.0, 0))  # the first starts the workers: none had run here
        assert pool.started and pool.idle()  # one of two workers busy
        assert pool.can_take(1, 0) and not pool.can_take(0, 1)  # (0, 1) is in its worker
        pool.submit(1, 0, 3, 3.0, (3.0, 1))
        assert not pool.idle() and pool.in_flight() == 2
        assert pool.in_flight_before((2.0, 1)) and not pool.in_flight_before((2.0, 0))
        outcomes = {o.i: o for o in (pool.wait(), pool.wait())}
        assert outcomes[0].state == [4, 4.0] and outcomes[1].state == [4, 9.0]
        assert all(o.remote for o in outcomes.values())
        assert outcomes[0].peak != os.getpid()  # refined in a worker
        pool.submit(0, 1, 4, 4.0)  # a later refinement of (0, 1) goes to the worker that did it first
        again = pool.wait()
        assert again.peak == outcomes[0].peak and again.state == [5, 16.0]
        pool.submit(1, 30, 0, 1.0)
        procs, t0 = list(pool._procs), time.perf_counter()  # one busy for 30 s: ended at once, not needed
    assert time.perf_counter() - t0 < 15 and not any(p.is_alive() for p in procs)
    assert sorted(p.exitcode for p in procs) == [-signal.SIGTERM, 0]

    with Refiners(_square, workers=2, after_s=60.0) as pool:
        pool.submit(0, 0, 0, 5.0)
        assert not pool.started and not pool.idle()  # one at a time here
        assert pool.wait() == Outcome(0, 0, [1, 25.0], peak=float(os.getpid()))
        assert pool.idle()


def test_a_worker_that_fails_or_dies_ends_the_search_saying_so() -> None:
    with Refiners(_square, workers=2, after_s=0.0) as pool:
        pool.submit(-1, 0, 0, 1.0)
        with pytest.raises(RuntimeError, match="(?s)a planner worker failed:.*ValueError: no such candidate"):
            pool.wait()
    with Refiners(_square, workers=2, after_s=0.0) as pool:
        pool.submit(0, 20, 0, 1.0)  # a second in its worker
        os.kill(pool._procs[0].pid, signal.SIGKILL)
        with pytest.raises(HarmoniaError, match=r"ended without its result \(exit code -9\)"):
            pool.wait()


_ABSORBED: dict = {}  # in a worker: what the others shared with it


def _absorb(entries: dict) -> None:
    _ABSORBED.update(entries)


def _sharing(i: int, j: int, level: int, value: float) -> Outcome:
    time.sleep(0.2)  # both workers busy at once
    return Outcome(i, j, [level, sorted(_ABSORBED)], shared={("made by", i): os.getpid()})


def test_what_a_worker_shares_reaches_the_others_with_their_next_refinement() -> None:
    with Refiners(_sharing, workers=2, after_s=0.0, absorb=_absorb) as pool:
        pool.submit(0, 0, 1, 0.0)
        pool.submit(1, 0, 1, 0.0)
        first = {o.i: o for o in (pool.wait(), pool.wait())}
        assert all(o.state[1] == [] for o in first.values())  # nothing shared yet
        pool.submit(2, 0, 1, 0.0)  # to the worker that refined 0, with what refined 1 made
        pool.submit(3, 0, 1, 0.0)
        second = {o.i: o for o in (pool.wait(), pool.wait())}
    assert second[2].state[1] == [("made by", 1)] and second[3].state[1] == [("made by", 0)]
    assert second[2].shared == {("made by", 2): first[0].shared[("made by", 0)]}  # the same worker
