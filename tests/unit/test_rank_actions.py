"""Every rank's action list, built once: the simulator times exactly the list the executor runs.

Random plans (colocated and disjoint encoders, every schedule family, TP/CP/DP/PP and interleaved
LLM layouts, sub-microbatches) and random batches, no process group: for every rank the simulator's
tasks are that rank's actions in the list's order, the lists replay without a deadlock, every
message has its peer, and every compute action of the schedule runs on every rank of its stage.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harmonia.model.presets import mllm_preset
from harmonia.schedule.actions import Action, Kind, StageRef
from harmonia.schedule.encoder_slots import movable_encoders
from harmonia.schedule.iteration import assign_iteration, balancer_costs, feeding_replicas
from harmonia.schedule.layout import Layout, Placement
from harmonia.schedule.plan import Plan
from harmonia.schedule.lowering import lower
from harmonia.schedule.rank_actions import holder_copy, plan_rank_actions, rank_compute_actions
from harmonia.schedule.stagework import iteration_schedule, plan_iteration_work
from harmonia.sim.engine import replay
from harmonia.sim.tasks import build_tasks
from harmonia.workload.cost import CostModel
from harmonia.workload.devices import cluster_from_string, device_preset
from harmonia.workload.traces import synthesize_trace

SPEC = mllm_preset("tiny-omni", training={"audio": "frozen"})
COST = CostModel(SPEC, device_preset("h100"))
CLUSTER = cluster_from_string("h100x8")


def _factor(rng: random.Random, n: int, cp: bool, max_pp: int) -> dict:
    """Degrees whose product is ``n``: pp and cp (where allowed) first, the rest over dp and tp."""
    out = {"pp": 1, "cp": 1, "tp": 1, "dp": 1}
    for axis in (["pp", "cp"] if cp else ["pp"]) + ["tp"]:
        options = [k for k in (1, 2, 4) if n % k == 0 and (axis != "pp" or k <= max_pp)]
        out[axis] = rng.choice(options)
        n //= out[axis]
    out["dp"] = n
    return out


def random_plan(rng: random.Random) -> Plan:
    """A plan of tiny-omni on at most 8 ranks, colocated or disjoint, any family."""
    family = rng.choice(["gpipe", "1f1b", "zb", "interleaved"])
    n_mb = rng.choice([2, 4])
    if rng.random() < 0.5:  # colocated: every module over the same ranks, factorised its own way
        world = rng.choice([2, 4, 8])
        llm = Layout(**_factor(rng, world, cp=True, max_pp=4))
        encoders = {e: Layout(**_factor(rng, world, cp=False, max_pp=2)) for e in ("vision", "audio")}
        placement = Placement.COLOCATED
    else:  # disjoint: each encoder on ranks of its own, then the LLM
        offset, encoders = 0, {}
        for e in ("vision", "audio"):
            size = rng.choice([1, 2])
            encoders[e] = Layout(**_factor(rng, size, cp=False, max_pp=2), rank_offset=offset)
            offset += size
        llm = Layout(**_factor(rng, rng.choice([1, 2, 4]), cp=True, max_pp=4), rank_offset=offset)
        placement = Placement.DISJOINT
    if family == "interleaved":
        if llm.pp == 2 and n_mb % 2 == 0:
            llm = replace(llm, virtual_stages=2)
        else:
            family = "1f1b"
    n_sub = {e: rng.choice([1, 2]) for e in encoders}
    plan = Plan("tiny-omni", {**encoders, "llm": llm}, placement, family, n_mb, global_batch=4 * llm.dp * n_mb)
    return plan, n_sub


def iteration(seed: int):
    rng = random.Random(seed)
    plan, n_sub = random_plan(rng)
    shapes = synthesize_trace(plan.global_batch, seed=seed)
    costs, columns, tokens = balancer_costs(COST, shapes, plan.encoders)
    assignment = assign_iteration(costs, columns, plan.layouts["llm"].dp, {e: plan.layouts[e].dp for e in plan.encoders},
                                  plan.n_microbatches, tokens=tokens, seed=seed,
                                  feeds={e: feeding_replicas(plan, e) for e in plan.encoders})
    subs = {e: (k,) * plan.n_microbatches for e, k in n_sub.items()}
    iw = plan_iteration_work(shapes, plan, COST, assignment, subs)
    return plan, iw, iteration_schedule(plan, COST, iw)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
@example(42408405)  # colocated zero-bubble: audio dp8's replicas re-placed into the LLM groups' slack
def test_the_simulator_times_exactly_every_ranks_list(seed: int) -> None:
    plan, iw, schedule = iteration(seed)
    actions = plan_rank_actions(plan.layouts, schedule)
    assert set(actions) == set(range(plan.world_size))
    for rank in actions:  # the executor's own call gives the same list
        assert plan_rank_actions(plan.layouts, schedule, [rank])[rank] == actions[rank]
    tasks, queue, comm = build_tasks(plan, COST, iw, actions, schedule.graph, CLUSTER)
    timeline = replay(tasks, queue, comm)  # raises on a deadlock
    for rank, acts in actions.items():
        mine = [t for t in tasks if t.rank == rank and " sync " not in t.name]  # not the lockstep barriers
        assert [t.action for t in mine] == acts, f"rank {rank}: the simulator's tasks are not its list"
        assert queue[rank] == sorted(queue[rank]) and comm[rank] == sorted(comm[rank])  # streams in list order
        starts = [timeline.start[i] for i in queue[rank]]
        assert starts == sorted(starts)
    _messages_pair_up(actions)
    _every_compute_runs_on_its_ranks(plan, schedule, actions)
    # each rank's compute list alone is its list's compute actions; a lowered copy of the schedule
    # (its own timeline derived again, not the original's kept one) gives every rank the same list
    compute = rank_compute_actions(plan.layouts, schedule)
    assert all(compute[r] == [a for a in acts if a.kind.is_compute] for r, acts in actions.items())
    assert schedule.chunk_actions is not None and lower(schedule).chunk_actions is None
    assert plan_rank_actions(plan.layouts, lower(schedule)) == actions


def _messages_pair_up(actions: dict[int, list[Action]]) -> None:
    """Every stage-message send has one receive on its peer rank and back; boundary transfers run
    on every rank of both stages, once per microbatch and encoder."""
    sends = Counter((r, a.peer_rank, a.module, a.kind, a.microbatch, a.sub, a.stage)
                    for r, acts in actions.items() for a in acts if a.kind.is_send and a.peer is None)
    recvs = Counter((a.peer_rank, r, a.module, Kind.SEND_F if a.kind is Kind.RECV_F else Kind.SEND_B, a.microbatch,
                     a.sub, a.stage - 1 if a.kind is Kind.RECV_F else a.stage + 1)
                    for r, acts in actions.items() for a in acts if a.kind.is_recv and a.peer is None)
    assert sends == recvs and max(sends.values(), default=1) == 1
    for acts in actions.values():
        boundary = Counter((a.kind, a.module, a.peer, a.microbatch) for a in acts if a.peer is not None)
        assert max(boundary.values(), default=1) == 1


def _every_compute_runs_on_its_ranks(plan: Plan, schedule, actions: dict[int, list[Action]]) -> None:
    """Each rank runs its stages' compute as the holder's copy orders it; an encoder the ranks may
    re-place into their LLM group's slack (`harmonia.schedule.encoder_slots`) keeps the order of its
    forwards and that of its backwards, each kind's actions exactly the holder's."""
    graph = schedule.graph
    movable = movable_encoders(plan.layouts, plan.encoders)
    for module, layout in plan.layouts.items():
        for rank in layout.rank_list():
            pp = layout.coords(rank)["pp"]
            for c in range(pp, layout.n_stages, layout.pp):
                ref = StageRef(module, c)
                want = [a for a in schedule.orders[holder_copy(graph, plan.layouts, ref, rank)] if a.stage_ref == ref]
                got = [a for a in actions[rank] if a.kind.is_compute and a.stage_ref == ref]
                if module in movable:
                    for kind in {a.kind for a in want}:
                        assert [a for a in got if a.kind is kind] == [a for a in want if a.kind is kind], \
                            f"rank {rank} runs {ref}'s {kind} actions out of the holder's order"
                    assert sorted(map(str, got)) == sorted(map(str, want)), f"rank {rank}: other actions of {ref}"
                else:
                    assert got == want, f"rank {rank} runs {ref} differently from its holder's copy"


def test_a_rank_holding_two_modules_merges_them_by_the_schedules_timeline() -> None:
    """Vision pp2 over the ranks of an LLM dp2: rank 1 holds vision's last chunk and LLM replica 1's
    whole pipeline, which the schedule puts on different ranks; its list interleaves them so that
    no action waits for one later in the list."""
    plan = Plan("tiny-omni", {"vision": Layout(pp=2), "audio": Layout(dp=2), "llm": Layout(dp=2)},
                Placement.COLOCATED, "1f1b", 4, global_batch=16)
    shapes = synthesize_trace(16, seed=3)
    costs, columns, tokens = balancer_costs(COST, shapes, plan.encoders)
    assignment = assign_iteration(costs, columns, 2, {"vision": 1, "audio": 2}, 4, tokens=tokens,
                                  feeds={e: feeding_replicas(plan, e) for e in plan.encoders})
    iw = plan_iteration_work(shapes, plan, COST, assignment)
    schedule = iteration_schedule(plan, COST, iw)
    actions = plan_rank_actions(plan.layouts, schedule)
    mine = actions[1]
    assert {a.module for a in mine if a.kind.is_compute} == {"vision", "audio", "llm"}
    for m in range(4):  # vision's rows leave before the LLM on this rank needs them
        send = mine.index(Action("vision", 1, Kind.SEND_F, m, peer=StageRef("llm", 0)))
        forward = mine.index(Action("llm", 0, Kind.F, m))
        assert send < forward
    replay(*build_tasks(plan, COST, iw, actions, schedule.graph, CLUSTER))


@pytest.mark.parametrize("text", ["llm.s1.REDUCE", "vision.s1.SEND_F3>llm.s0", "llm.s0.RECV_B2<vision.s1"])
def test_list_actions_round_trip_as_text(text: str) -> None:
    assert str(Action.parse(text)) == text
