"""Ranks that run in lockstep replay once, and the result is the whole replay's.

`harmonia.sim.lockstep` replays one representative per group of ranks a replay cannot tell apart.
On plans small enough to replay whole, both ways must give the same iteration time, every rank's
busy seconds and activation peak, and every rank's tasks starting and ending at the same times
(the representatives' copied to their groups, their stage messages renamed for each rank's own
neighbours). Checked on TP, CP and pipeline groups inside and across nodes, interleaved stages,
FSDP chunks that reshard per microbatch (their DP groups run in lockstep), colocated encoders whose
replicas split the LLM's TP groups (barriers), disjoint encoders feeding several LLM replicas, and
on every recipe's candidates of a multimodal scenario; also on independent parts as the planner
simulates them.
"""

import pytest

from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
from harmonia.plan.recipes import Candidate, candidate_schedule
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.schedule.rank_actions import rank_compute_actions
from harmonia.sim.lockstep import lockstep_groups
from harmonia.sim.parts import independent_parts, simulate_part
from harmonia.sim.tasks import simulate_schedule
from harmonia.workload.devices import cluster_from_string
from tests.unit.test_plan_bounds import _describe, _scenario, _spread

GIVEN = [  # (model, cluster, trace, global batch, layouts, ranks replayed where fewer than all)
    ("llama3-8b", "h100:2x4", "text:4096", 16, "llm tp2 cp2 pp2 dp1", 2),
    ("llama3-8b", "h100:4x2", "text:4096", 16, "llm tp4 pp2 dp1", 2),  # each TP group spans two nodes
    ("llama3-8b", "h100:2x8", "text:4096", 32, "llm tp2 pp2 v2 dp4", 8),
    ("llama3-8b", "h100:2x8", "text:4096", 32, "llm tp2 pp2 dp4 fsdp reshard", 8),
    ("llava-siglip-8b", "h100:2x8", "ai2d", 32, "vision tp4 pp1 dp4; llm tp4 pp2 v2 dp2", 8),
    ("llava-siglip-8b", "h100:2x8", "ai2d", 32, "vision tp2 pp1 dp8; llm tp2 pp2 dp4", None),
    ("omni-8b", "h100:2x8", "synthetic", 32, "vision tp2 pp1 dp8; audio tp4 pp1 dp4; llm tp4 pp2 dp2 fsdp", None),
    ("omni-8b", "h100:4x8", "synthetic", 32,
     "vision tp2 pp1 dp4; audio tp2 pp1 dp4; llm tp4 cp2 pp1 dp2 fsdp reshard", 10),
]


def _times(timeline) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """Every task's (start, end) by rank and name, barriers left out (a barrier couples a group:
    the whole replay keeps one per group, the lockstep replay one per group of representatives)."""
    out: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for task, start, end in zip(timeline.tasks, timeline.start.tolist(), timeline.end.tolist()):
        if " sync " not in task.name:
            out.setdefault((task.rank, task.name), []).append((start, end))
    return {k: sorted(v) for k, v in out.items()}


def _same(lockstep, whole, what: str) -> None:
    assert lockstep.iteration_s == whole.iteration_s, what
    assert lockstep.ranks == whole.ranks, what
    assert lockstep.peak_mem == whole.peak_mem, what
    assert lockstep.busy_s == whole.busy_s, what
    assert _times(lockstep) == _times(whole), what
    assert lockstep.mfu(1e15) == pytest.approx(whole.mfu(1e15), rel=1e-12), what
    assert lockstep.module_seconds() == pytest.approx(whole.module_seconds(), rel=1e-12), what


def _replayed(timeline) -> int:
    return len({t.rank for t in timeline.replayed})


@pytest.mark.parametrize("model, cluster, trace, batch, text, replayed", GIVEN, ids=[g[4] for g in GIVEN])
def test_given_layouts_replay_as_a_whole(model, cluster, trace, batch, text, replayed, shared_traces) -> None:
    trace = str(shared_traces / f"{trace}.csv") if trace == "ai2d" else trace
    run = ScenarioRun(Scenario("lockstep", model, cluster, trace, batch, iterations=1, search_batches=1,
                               memory_batches=0))
    training = {m: t.mode.value for m, t in run.mllm.training.items()}
    plan = plan_from_layouts(run.mllm, model, parse_layouts(text), run.cluster.world_size, batch, training=training)
    cand = Candidate("harmonia", plan)
    iw = run.iteration_work(cand, 0)
    schedule = candidate_schedule(cand, run.cost, iw)
    lockstep = simulate_schedule(plan, run.cost, run.cluster, iw, schedule)
    whole = simulate_schedule(plan, run.cost, run.cluster, iw, schedule, lockstep=False)
    _same(lockstep, whole, text)
    # messages and reductions are named by their action, once read (`Task.name`), not when made
    made = [t for t in whole.tasks if t.action is not None and not t.action.kind.is_compute]
    assert made and all(t.label == "" and t.name == str(t.action) for t in made), text
    assert _replayed(lockstep) == (replayed or run.cluster.world_size), text
    assert _replayed(whole) == run.cluster.world_size


@pytest.mark.parametrize("name", ["llava-siglip-8b trainable, 16 GPUs", "omni-8b frozen encoders, 16 GPUs"])
def test_every_recipe_replays_as_a_whole(name: str, shared_traces) -> None:
    run = ScenarioRun(_scenario(name, shared_traces))
    for cand in _spread(run, per_family=1):
        plan = cand.plan
        iw = run.iteration_work(cand, 0)
        schedule = candidate_schedule(cand, run.cost, iw)
        lockstep = simulate_schedule(plan, run.cost, run.cluster, iw, schedule)
        _same(lockstep, simulate_schedule(plan, run.cost, run.cluster, iw, schedule, lockstep=False), _describe(cand))
        for part in independent_parts(plan, run.cost, iw):  # as the planner simulates them
            alone = simulate_part(plan, run.cost, run.cluster, iw, schedule, part)
            _same(alone, simulate_part(plan, run.cost, run.cluster, iw, schedule, part, lockstep=False),
                  _describe(cand))


def test_ranks_sharing_cores_are_never_grouped() -> None:
    run = ScenarioRun(Scenario("cores", "tiny-vlm", "cpu:1x4@2", "synthetic:image=1", 8, iterations=1, search_batches=1,
                               memory_batches=0))
    plan = plan_from_layouts(run.mllm, "tiny-vlm", parse_layouts("vision tp2 dp1; llm tp2 dp1"), 4, 8)
    cand = Candidate("harmonia", plan)
    iw = run.iteration_work(cand, 0)
    compute = rank_compute_actions(plan.layouts, candidate_schedule(cand, run.cost, iw))
    assert lockstep_groups(plan, run.cost, run.cluster, iw, compute) == {}
    alone = cluster_from_string("h100:1x4")
    assert lockstep_groups(plan, run.cost, alone, iw, compute) == {0: (1,), 2: (3,)}
