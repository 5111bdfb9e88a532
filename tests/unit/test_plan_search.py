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


def test_search_within_two_percent_of_exhaustive(shared_traces) -> None:
    scenario = Scenario("q", "internvl-8b", "h100:1x4", str(shared_traces / "chartqa.csv"), 32,
                        {"vision": "frozen"}, iterations=1, search_batches=1)
    report = search_plan(scenario, top=5)
    run = ScenarioRun(scenario)
    every = [float(run._timeline(c, 1, 0.0).iteration_s) for c in
             candidates("harmonia", run.cost, run.cluster, run.profile, 32, "internvl-8b")]
    assert report.ranked[0][0] <= min(every) * 1.02
    assert report.simulated + report.pruned == len(every)
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
