"""The bounds the plan search prunes with never exceed the simulated iteration time.

The branch and bound skips a candidate once a bound on its time exceeds the best simulated score,
so a bound above the simulation would lose the optimum. Checked on every recipe's placements
(colocated, disjoint, encoders fused into the LLM's first stage), pp 1/2/4, 1F1B, zero-bubble and
interleaved schedules, trainable and frozen encoders, with and without activation recomputation.
"""

from dataclasses import replace

import pytest

import harmonia.plan.bounds as bounds
from harmonia.plan.bounds import plan_bound, work_bound, work_bound_busy
from harmonia.plan.candidates import lower_bound_s
from harmonia.plan.heavy_replicas import heaviest_replicas
from harmonia.plan.recipes import (RECIPES, Candidate, assign, candidates, homogeneous_candidates, recompute_options,
                                   simulate_work)
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.schedule.layout import Layout
from harmonia.schedule.stagework import plan_iteration_work

TOLERANCE = 1e-9


def _scenario(name: str, traces) -> Scenario:
    specs = {
        "internvl-8b frozen vision, 8 GPUs": ("internvl-8b", "h100:1x8", str(traces / "chartqa.csv"),
                                              {"vision": "frozen"}),
        "llava-siglip-8b trainable, 16 GPUs": ("llava-siglip-8b", "h100:2x8", str(traces / "ai2d.csv"), {}),
        "omni-8b frozen encoders, 16 GPUs": ("omni-8b", "h100:2x8", "synthetic",
                                             {"vision": "frozen", "audio": "frozen"}),
    }
    model, cluster, trace, training = specs[name]
    return Scenario(name, model, cluster, trace, 32, training, iterations=1, search_batches=1)


def _interleaved(cand: Candidate) -> Candidate | None:
    """The candidate with two stage chunks per LLM pipeline rank, under interleaved 1F1B."""
    llm, plan = cand.plan.layouts["llm"], cand.plan
    if llm.pp < 2 or cand.fused or plan.n_microbatches % llm.pp:
        return None
    chunked = Layout(llm.tp, llm.cp, llm.dp, llm.pp, llm.rank_offset, llm.ranks, None, 2, llm.fsdp)
    return replace(cand, plan=replace(plan, layouts={**plan.layouts, "llm": chunked}, schedule="interleaved"))


def _spread(run: ScenarioRun, per_family: int = 2) -> list[Candidate]:
    """A few candidates of every (recipe, placement, schedule, llm pp) family, plus interleaved ones."""
    s = run.scenario
    every = [c for r in RECIPES for c in candidates(r, run.cost, run.cluster, run.profile, s.global_batch, s.model)]
    every += list(homogeneous_candidates(run.cost, run.cluster, run.profile, s.global_batch, s.model))
    families: dict[tuple, list[Candidate]] = {}
    for c in every:
        key = (c.recipe, c.fused, c.plan.placement, c.plan.schedule, c.plan.layouts["llm"].pp)
        families.setdefault(key, []).append(c)
    picked = [c for group in families.values() for c in group[:: max(1, len(group) // per_family)][:per_family]]
    picked += [x for x in map(_interleaved, picked) if x is not None]
    return picked + [x for x in (_recomputed(run.cost, c) for c in picked) if x is not None]


def _recomputed(cost, cand: Candidate) -> Candidate | None:
    """The candidate recomputing every module with a backward (as the recipes retry a misfit)."""
    modules, shares = recompute_options(cost, cand.plan)[-1]
    return replace(cand, plan=replace(cand.plan, recompute=modules, recompute_fraction=shares)) if modules else None


def _bounds_and_time(run: ScenarioRun, cand: Candidate, k: int) -> tuple[dict[str, float], float, object]:
    iw = run.iteration_work(cand, k)
    simulated = float(simulate_work(cand, iw, run.cost, run.cluster, 0.0).iteration_s)
    found = {
        "work_bound": work_bound(cand.plan, run.cost, run.cluster, iw),
        "plan_bound": plan_bound(cand.plan, run.cost, run.cluster, run.profile, [k]).lower_s,
        "lower_bound_s": lower_bound_s(run.profile, cand.plan.layouts, [k]),
    }
    return found, simulated, iw


def _describe(cand: Candidate) -> str:
    p = cand.plan
    layouts = " ".join(f"{m}:tp{x.tp}pp{x.pp}dp{x.dp}v{x.virtual_stages}" for m, x in p.layouts.items())
    return f"{cand.recipe}{' fused' if cand.fused else ''} {p.placement.value} {p.schedule}x{p.n_microbatches} {layouts}"


@pytest.mark.parametrize("name", ["internvl-8b frozen vision, 8 GPUs", "llava-siglip-8b trainable, 16 GPUs",
                                  "omni-8b frozen encoders, 16 GPUs"])
def test_bounds_never_exceed_the_simulated_time(name: str, shared_traces, monkeypatch) -> None:
    run = ScenarioRun(_scenario(name, shared_traces))
    picked = _spread(run)
    assert {c.plan.schedule for c in picked} >= {"1f1b", "zb", "interleaved"}
    assert {c.plan.layouts["llm"].pp for c in picked} >= {1, 2, 4}
    assert {c.plan.placement.value for c in picked} == {"colocated", "disjoint"}
    assert any(c.plan.recompute for c in picked)
    violations, sharper, slowed = [], set(), 0
    for cand in picked:
        found, simulated, iw = _bounds_and_time(run, cand, 1)
        if cand.plan.layouts["llm"].resharded:  # compute slowed beside the gathers it hides raises the bound
            plain = run.cluster.with_device(overlap_slowdown=0.0)
            slowed += found["plan_bound"] > plan_bound(cand.plan, run.cost, plain, run.profile, [1]).lower_s * (1 + 1e-9)
        for what, value in found.items():
            if value > simulated * (1 + TOLERANCE):
                violations.append(f"{what} {value:.6f} > simulated {simulated:.6f}: {_describe(cand)}")
        with monkeypatch.context() as m:  # the busiest rank alone, without pipeline fill and drain
            m.setattr(bounds, "_pipeline_bound", lambda *args: 0.0)
            busiest = work_bound(cand.plan, run.cost, run.cluster, iw)
        if found["work_bound"] > busiest * (1 + 1e-6):
            sharper.add(cand.plan.schedule)
    assert not violations, "\n".join(violations)
    # the pipeline fill and drain raise the work bound, interleaved chunks included: the check exercises them
    assert sharper >= {"1f1b", "interleaved"}, sharper
    assert slowed, "no resharded LLM's analytic bound counts the slowdown beside its gathers"



def _replica_ranks(layout: Layout, d: int) -> list[int]:
    return [r for i, r in enumerate(layout.rank_list()) if i // (layout.cp * layout.tp) % layout.dp == d]


def test_the_bound_on_the_heaviest_replicas_bounds_the_whole_and_is_exact_on_their_ranks(shared_traces) -> None:
    """The search bounds a batch on the units of each module's heaviest replicas and of every replica
    sharing their ranks (`heaviest_replicas`): at most the bound over every unit, every rank whose
    replicas are all priced has its whole busy seconds, and the heaviest LLM replica's ranks are such."""
    run = ScenarioRun(_scenario("omni-8b frozen encoders, 16 GPUs", shared_traces))
    batch = run.profile.batches[1]
    shapes = [run.samples[i] for i in batch]
    partial_plans, tight = 0, 0
    for cand in _spread(run):
        plan = cand.plan
        assignment = assign(cand, run.costs[batch], run.tokens[batch], run.cost, shapes)
        assert heaviest_replicas(plan, assignment, run.costs[batch], run.cost.modules, count=len(batch)) is None
        replicas = heaviest_replicas(plan, assignment, run.costs[batch], run.cost.modules, count=1)
        if replicas is None:
            continue
        partial_plans += 1
        whole = plan_iteration_work(shapes, plan, run.cost, assignment)
        some = plan_iteration_work(shapes, plan, run.cost, assignment, replicas=replicas)
        assert len(some.work) < len(whole.work)
        assert some.boundary_bytes == whole.boundary_bytes
        bound, busy = work_bound_busy(plan, run.cost, run.cluster, some)
        full_bound, full_busy = work_bound_busy(plan, run.cost, run.cluster, whole)
        assert bound <= full_bound * (1 + TOLERANCE), _describe(cand)
        tight += bound >= full_bound * (1 - 1e-9)
        priced = {(m, d) for m, chosen in replicas.items() for d in chosen}
        holders: dict[int, set] = {}
        for m, layout in plan.layouts.items():
            for d in range(layout.dp):
                for r in _replica_ranks(layout, d):
                    holders.setdefault(r, set()).add((m, d))
        whole_ranks = {r for r, held in holders.items() if held <= priced}
        assert whole_ranks
        for r in whole_ranks:
            assert busy.get(r, 0.0) == full_busy.get(r, 0.0), (r, _describe(cand))
        llm_loads = [0.0] * plan.layouts["llm"].dp
        for samples, split in zip(assignment.microbatches, assignment.llm_split):
            for d, positions in enumerate(split):
                llm_loads[d] += sum(run.costs[batch][samples[p], run.cost.modules.index("llm")] for p in positions)
        heaviest_llm = max(range(len(llm_loads)), key=llm_loads.__getitem__)
        assert set(_replica_ranks(plan.layouts["llm"], heaviest_llm)) <= whole_ranks, _describe(cand)
    assert partial_plans >= 10
    assert tight >= partial_plans // 2, f"the heaviest replica's bound matched the whole on {tight} of {partial_plans}"


def test_the_work_bound_grows_with_what_a_plan_recomputes(shared_traces) -> None:
    """A plan's work bound is at least its twin's that recomputes less (the search bounds one by the
    other, `harmonia.plan.search._Scorer.twin_bound`), on the same assignment and replicas."""
    run = ScenarioRun(_scenario("llava-siglip-8b trainable, 16 GPUs", shared_traces))
    batch = run.profile.batches[1]
    shapes = [run.samples[i] for i in batch]
    checked = 0
    for cand in _spread(run):
        more = _recomputed(run.cost, cand)
        if more is None or cand.plan.recompute:
            continue
        assignment = assign(cand, run.costs[batch], run.tokens[batch], run.cost, shapes)
        replicas = heaviest_replicas(cand.plan, assignment, run.costs[batch], run.cost.modules, count=1)
        for priced in (None, replicas):
            bounds = [work_bound_busy(c.plan, run.cost, run.cluster,
                                      plan_iteration_work(shapes, c.plan, run.cost, assignment, replicas=priced))[0]
                      for c in (cand, more)]
            assert bounds[1] >= bounds[0], _describe(more)
            checked += bounds[1] > bounds[0]
    assert checked >= 10
