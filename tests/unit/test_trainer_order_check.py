"""The trainer's per-batch order search hands its pick to the ranks only where the simulator, timing
every rank's action list, finds it strictly faster than the balancer's order (as the planner and
the simulate benchmark do), so a search on the replay alone never slows a step down."""

from __future__ import annotations

from dataclasses import replace

from harmonia.schedule.families import build_schedule
from harmonia.schedule.stagework import cost_table, plan_iteration_work
from harmonia.sim.tasks import SimulatedOrders
from harmonia.train import iteration
from harmonia.train.iteration import DataOrder, IterationBuilder
from harmonia.train.rank import schedule_graph
from harmonia.workload.cost import CostModel
from tests.unit.test_sequential_assignment import BATCH, PLAN, SPEC, dataset  # noqa: F401
from tests.unit.test_sequential_assignment import CLUSTER as CPU

N_MB = 6  # one sample per microbatch of each LLM replica: orders differ most
STEPS = range(6)
SEARCHED = replace(PLAN, n_microbatches=N_MB)
CLUSTER = CPU.with_device(dispatch_s=0.0)  # kernels only: on the CPU's dispatch the tiny model's orders tie


def _builder(ds) -> IterationBuilder:
    shapes = {s.sample_id: s for s in ds.shapes()}
    return IterationBuilder(SPEC, SEARCHED, ds, DataOrder(list(shapes), BATCH, seed=2), CostModel(SPEC, CLUSTER.device),
                            CLUSTER, schedule_graph(SPEC, SEARCHED), 0, search_evaluations=16, shapes=shapes)


def _searches(dataset, monkeypatch, simulated=None) -> list:
    """Each step's (search result, built iteration); ``simulated(order)`` replaces the simulated step."""
    found = []
    real = iteration.search_order

    def spy(*args, **kwargs):
        assert isinstance(kwargs.get("step"), SimulatedOrders), "the pick is checked by the simulated step"
        found.append(real(*args, **kwargs))
        return found[-1]

    monkeypatch.setattr(iteration, "search_order", spy)
    if simulated is not None:
        monkeypatch.setattr(SimulatedOrders, "__call__", lambda self, order, family: simulated(order))
    builder = _builder(dataset)
    built = [builder.build(step) for step in STEPS]
    assert len(found) == len(built)
    return list(zip(found, built))


def _schedule(dataset, it, order: list[int]):
    by_id = {s.sample_id: s for s in dataset.shapes()}
    iw = plan_iteration_work([by_id[i] for i in it.sample_ids], SEARCHED, CostModel(SPEC, CLUSTER.device),
                             it.assignment)
    return build_schedule(schedule_graph(SPEC, SEARCHED), N_MB, SEARCHED.schedule, order=order,
                          costs=cost_table(SEARCHED, iw))


DEFAULT = list(range(N_MB))


def test_the_replays_pick_runs_only_where_the_simulator_finds_it_faster(dataset, monkeypatch):
    with monkeypatch.context() as m:
        honest = _searches(dataset, m)
    checked = [(r, it) for r, it in honest if r.step_s == r.step_s]  # the replay picked another order
    assert checked, "the replay never picks: the check exercises nothing"
    for result, it in honest:
        assert it.schedule.orders == _schedule(dataset, it, result.order).orders
        if result.order != DEFAULT:
            assert result.step_s < result.start_step_s
    with monkeypatch.context() as m:  # the simulator finds every pick faster: each one runs
        faster = _searches(dataset, m, simulated=lambda order: float(order == DEFAULT))
    picked = [(r, it) for r, it in faster if r.order != DEFAULT]
    assert len(picked) == len(checked)
    assert all(it.schedule.orders != _schedule(dataset, it, DEFAULT).orders for _, it in picked)
    slower = _searches(dataset, monkeypatch, simulated=lambda order: float(order != DEFAULT))
    for result, it in slower:  # ... finds every pick slower: none runs
        assert result.order == DEFAULT
        assert it.schedule.orders == _schedule(dataset, it, DEFAULT).orders
