"""The schedule's cost table: per stage, microbatch and sub-microbatch, the slowest replica's work."""

from itertools import islice

import pytest

from harmonia.plan.recipes import assign, candidate_schedule, candidates
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.schedule.costs import PhaseCost
from harmonia.schedule.graph import LLM, colocated_holders_by_replica
from harmonia.schedule.stagework import (NO_WORK, IterationWork, StageKey, cost_table, llm_replicas_work,
                                         plan_iteration_work, with_submicrobatches)
from harmonia.sim.parts import simulate_part


def slowest_by_lookup(plan, iw: IterationWork) -> dict:
    """Every replica of every stage looked up in turn (the table's definition, written plainly)."""
    out = {}
    for m in range(iw.n_microbatches):
        for module, layout in plan.layouts.items():
            for chunk in range(layout.n_stages):
                for sub in iw.subs(module, m):
                    works = [w for r in range(layout.dp)
                             if (w := iw.unit(StageKey(module, r, chunk), m, sub)) is not None]
                    out[(module, chunk, m, sub)] = NO_WORK if not works else PhaseCost(
                        max(w.times.F for w in works), max(w.times.B for w in works), max(w.times.W for w in works))
    return out


def shares_by_lookup(plan, iw: IterationWork) -> dict:
    """Each holder position's slowest encoder replica, every replica looked up in turn (the shares'
    definition, written plainly: the first of the slowest, sub-microbatches summed)."""
    llm, out = plan.layouts[LLM], {}
    for enc in plan.encoders:
        for chunk in range(plan.layouts[enc].n_stages):
            every = colocated_holders_by_replica(plan.layouts, enc, chunk) or {}
            if len(every.get(0, ())) < 2:
                continue
            by_position = {}
            for d in range(llm.dp):
                for rank, replicas in every.get(d, {}).items():
                    by_position.setdefault(llm.coords(rank)["pp"], []).extend(replicas)
            for pp, replicas in by_position.items():
                for m in range(iw.n_microbatches):
                    best, most = (0.0, 0.0, 0.0), 0.0
                    for e in replicas:
                        parts = [w.times for sub in iw.subs(enc, m)
                                 if (w := iw.unit(StageKey(enc, e, chunk), m, sub)) is not None]
                        total = (sum(t.F for t in parts), sum(t.B for t in parts), sum(t.W for t in parts))
                        if parts and sum(total) > most:
                            best, most = total, sum(total)
                    out[(llm.rank_at(pp=pp, dp=0), enc, chunk, m)] = PhaseCost(*best)
    return out


@pytest.fixture(scope="module")
def run() -> ScenarioRun:
    return ScenarioRun(Scenario("t", "omni-8b", "h100:4x8", "synthetic", 64, iterations=1, search_batches=1))


def held_by_several(plan) -> bool:
    """Whether a colocated encoder stage of the plan is held by several LLM ranks of a replica."""
    return any(len((colocated_holders_by_replica(plan.layouts, e, chunk) or {}).get(0, ())) >= 2
               for e in plan.encoders for chunk in range(plan.layouts[e].n_stages))


def test_the_table_holds_each_units_slowest_replica(run: ScenarioRun) -> None:
    found = list(candidates("harmonia", run.cost, run.cluster, run.profile, 64, "omni-8b"))
    checked = shared = 0
    for cand in [*islice(found, 0, 400, 20), *[c for c in found if held_by_several(c.plan)][::80]]:
        iw = run.iteration_work(cand, 0)
        table = cost_table(cand.plan, iw)
        assert table.entries == slowest_by_lookup(cand.plan, iw)
        assert list(table.entries) == list(slowest_by_lookup(cand.plan, iw))  # the same order
        assert table.shares == shares_by_lookup(cand.plan, iw)
        enc = cand.plan.encoders[0]
        split = with_submicrobatches(iw, cand.plan, run.cost, enc, [2] * iw.n_microbatches)
        assert cost_table(cand.plan, split).entries == slowest_by_lookup(cand.plan, split)
        assert cost_table(cand.plan, split).shares == shares_by_lookup(cand.plan, split)
        checked += 1
        shared += bool(table.shares)
    assert checked >= 30 and shared >= 10


def test_some_llm_replicas_work_gives_the_whole_table_and_their_own_units(run: ScenarioRun) -> None:
    """`llm_replicas_work`: every LLM replica's times in the table, the chosen replicas' units and every
    encoder's as the whole iteration's, and a column of those replicas replays alike."""
    found = candidates("harmonia", run.cost, run.cluster, run.profile, 64, "omni-8b")
    batch = run.profile.batches[0]
    shapes = [run.samples[i] for i in batch]
    checked = wide = 0
    for cand in islice(found, 0, 800, 16):
        plan, llm = cand.plan, cand.plan.layouts[LLM]
        assignment = assign(cand, run.costs[batch], run.tokens[batch], run.cost, shapes)
        whole = plan_iteration_work(shapes, plan, run.cost, assignment)
        d = llm.dp - 1
        some = llm_replicas_work(shapes, plan, run.cost, assignment, {d})
        assert cost_table(plan, some) == cost_table(plan, whole)
        assert some.work == {k: w for k, w in whole.work.items() if k[0].module != LLM or k[0].replica == d}
        column = tuple(llm.rank_at(pp=p, dp=d, cp=0, tp=0) for p in range(llm.pp))
        schedule = candidate_schedule(cand, run.cost, whole)
        assert (simulate_part(plan, run.cost, run.cluster, some, schedule, column, closed=False).iteration_s
                == simulate_part(plan, run.cost, run.cluster, whole, schedule, column, closed=False).iteration_s)
        checked += 1
        wide += llm.dp >= 8  # the units priced in one vectorised pass
    assert checked >= 20 and wide >= 5
