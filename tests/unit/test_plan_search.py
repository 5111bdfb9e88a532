"""`harmonia plan`: the search's choice against exhaustive enumeration, and impossible requests."""

import re

import numpy as np
import pytest

from harmonia.cli import main
from harmonia.errors import LayoutError
from harmonia.plan.plan import Plan
from harmonia.plan.search import search_plan
from harmonia.sim.recipes import candidates
from harmonia.sim.scenario import Scenario, ScenarioRun


def _exhaustive_best(scenario: Scenario) -> tuple[float, int]:
    """The smallest mean simulated time over every distinct candidate, and how many there are."""
    run = ScenarioRun(scenario)
    distinct = {}
    for c in candidates("harmonia", run.cost, run.cluster, run.profile, scenario.global_batch, scenario.model):
        p = c.plan
        distinct.setdefault((c.recipe, c.fused, p.placement, p.schedule, p.n_microbatches,
                             tuple(sorted(p.layouts.items()))), c)
    search = range(scenario.iterations, scenario.iterations + scenario.search_batches)
    scores = [np.mean([run._timeline(c, k, 0.0).iteration_s for k in search]) for c in distinct.values()]
    return float(min(scores)), len(distinct)


@pytest.mark.parametrize("model, cluster, trace, training, batches", [
    ("internvl-8b", "h100:1x4", "chartqa.csv", {"vision": "frozen"}, 1),
    ("internvl-8b", "h100:1x8", "chartqa.csv", {"vision": "frozen"}, 2),
    ("llava-siglip-8b", "h100:2x8", "ai2d.csv", {}, 1),
])
def test_search_within_two_percent_of_exhaustive(model, cluster, trace, training, batches, shared_traces) -> None:
    scenario = Scenario("q", model, cluster, str(shared_traces / trace), 32, training, iterations=1,
                        search_batches=batches)
    report = search_plan(scenario, top=3)
    best, n = _exhaustive_best(scenario)
    found = report.ranked[0][0]
    assert best * (1 - 1e-9) <= found <= best * 1.02, f"search {found:.4f} s, exhaustive best {best:.4f} s"
    assert report.simulated < n  # the bounds pruned something
    assert report.ranked == sorted(report.ranked, key=lambda r: r[0])


def test_model_that_cannot_fit_says_how_many_devices() -> None:
    scenario = Scenario("big", "internvl-76b", "h100:1x2", "synthetic:image=1", 64, iterations=1, search_batches=1)
    with pytest.raises(LayoutError, match=r"use at least (\d+) devices") as err:
        search_plan(scenario)
    assert int(re.search(r"at least (\d+)", str(err.value)).group(1)) >= 16


def test_cli_writes_a_valid_plan(tmp_path, shared_traces) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny-vlm", "--cluster", "cpu:1x4", "--trace",
                 str(shared_traces / "ai2d.csv"), "--global-batch", "32", "--batches", "1",
                 "--json", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.world_size == 4 and np.isclose(plan.global_batch, 32)
