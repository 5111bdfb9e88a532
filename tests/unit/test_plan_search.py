"""`harmonia plan`: the search's choice against exhaustive enumeration, and impossible requests."""

import re
from dataclasses import replace

import numpy as np
import pytest

from harmonia.cli import main
from harmonia.errors import ConfigError, LayoutError
from harmonia.plan.recipes import candidates
from harmonia.plan.rerank import PLAINER_TOLERANCE
from harmonia.plan.scenario import Scenario, ScenarioRun
from harmonia.plan.search import search_plan
from harmonia.schedule.plan import Plan


def _exhaustive_best(scenario: Scenario) -> tuple[float, int]:
    """The smallest mean simulated time over every distinct candidate, and how many there are."""
    run = ScenarioRun(scenario)
    distinct = {}
    for c in candidates("harmonia", run.cost, run.cluster, run.profile, scenario.global_batch, scenario.model):
        p = c.plan
        distinct.setdefault((c.recipe, c.fused, p.placement, p.schedule, p.n_microbatches,
                             tuple(sorted(p.layouts.items()))), c)
    search = range(scenario.iterations, scenario.iterations + scenario.search_batches)
    scores = [np.mean([run.timeline(c, k, 0.0).iteration_s for k in search]) for c in distinct.values()]
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
    rest = report.ranked[1:]  # the first may be the best's plainer twin, at most PLAINER_TOLERANCE slower
    assert rest == sorted(rest, key=lambda r: r[0])
    assert found <= min(r[0] for r in report.ranked) * (1 + PLAINER_TOLERANCE)


def _has_candidates(model: str, cluster: str, trace: str, global_batch: int) -> bool:
    run = ScenarioRun(Scenario("s", model, cluster, trace, global_batch, iterations=1, search_batches=1))
    return next(candidates("harmonia", run.cost, run.cluster, run.profile, global_batch, model), None) is not None


def test_model_that_cannot_fit_says_the_smallest_device_count() -> None:
    scenario = Scenario("big", "internvl-76b", "h100:1x2", "synthetic:image=1", 64, iterations=1, search_batches=1)
    with pytest.raises(LayoutError, match=r"exceeds device memory.*use at least (\d+) devices \(h100:(\d+)x2\)") as err:
        search_plan(scenario)
    nodes = int(re.search(r"\(h100:(\d+)x2\)", str(err.value)).group(1))
    assert _has_candidates("internvl-76b", f"h100:{nodes}x2", "synthetic:image=1", 64)
    assert not _has_candidates("internvl-76b", f"h100:{nodes - 1}x2", "synthetic:image=1", 64)


def test_world_size_that_no_layout_factorises_names_one_that_does(shared_traces) -> None:
    # 16 ranks of an LLM with 4 blocks and 2 KV heads: tp <= 2 and pp <= 4, so dp >= 2 replicas
    # need at least 2 samples each; a global batch of 2 feeds none of them
    trace = str(shared_traces / "ai2d.csv")
    scenario = Scenario("odd", "tiny-vlm", "cpu:2x8", trace, 2, iterations=1, search_batches=1)
    with pytest.raises(LayoutError, match=r"factor its 16 devices.*or (\d+) devices \(cpu:1x(\d+)\)") as err:
        search_plan(scenario)
    per_node = int(re.search(r"\(cpu:1x(\d+)\)", str(err.value)).group(1))
    assert _has_candidates("tiny-vlm", f"cpu:1x{per_node}", trace, 2)


def test_global_batch_that_feeds_no_replicas_names_the_smallest_that_does(shared_traces) -> None:
    trace = str(shared_traces / "ai2d.csv")
    scenario = Scenario("small", "internvl-8b", "h100:8x8", trace, 4, iterations=1, search_batches=1)
    with pytest.raises(LayoutError, match=r"use a global batch of at least (\d+)") as err:
        search_plan(scenario)
    batch = int(re.search(r"global batch of at least (\d+)", str(err.value)).group(1))
    assert _has_candidates("internvl-8b", "h100:8x8", trace, batch)
    assert not _has_candidates("internvl-8b", "h100:8x8", trace, batch - 1)


@pytest.mark.parametrize("model, cluster, says", [
    ("internvl-9b", "h100:1x8", r"unknown MLLM preset 'internvl-9b'; known: \[.*'internvl-8b'.*\]"),
    ("internvl-8b", "h900:1x8", r"unknown device 'h900'; known devices: \[.*'h100'.*\]"),
    ("internvl-8b", "h100:ax8", r"expected DEVICE\[xGPUS\] or DEVICE:NODESxGPUS, e.g. h100:4x8"),
    ("internvl-8b", "h100:0x8", r"n_nodes=0 must be >= 1"),
])
def test_unknown_preset_or_cluster_spec_says_what_is_known(model, cluster, says, shared_traces) -> None:
    scenario = Scenario("bad", model, cluster, str(shared_traces / "ai2d.csv"), 32, iterations=1, search_batches=1)
    with pytest.raises(ConfigError, match=says):
        search_plan(scenario)


def test_a_trace_of_modalities_the_model_cannot_take_is_refused_naming_them() -> None:
    scenario = Scenario("llm", "llama3-8b", "h100:1x8", "synthetic", 8, iterations=1, search_batches=1)
    with pytest.raises(ConfigError, match=r"trace 'synthetic' holds \['audio', 'image', 'video'\] items, which "
                       r"'llama3-8b' has no encoder for \(it encodes \[\]\); profile text:N"):
        ScenarioRun(scenario)
    assert ScenarioRun(replace(scenario, trace="text:64")).samples  # its own modalities: profiled


def test_a_shared_trace_is_named_from_any_directory(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # no ai2d here: the shared trace of that name
    assert main(["plan", "--model", "tiny-vlm", "--cluster", "cpu:1x2", "--trace", "ai2d", "--global-batch", "8",
                 "--batches", "1", "--top", "1"]) == 0
    (tmp_path / "ai2d").write_text("not a trace")  # a file of that name is the user's, and read as given
    assert main(["plan", "--model", "tiny-vlm", "--cluster", "cpu:1x2", "--trace", "ai2d", "--global-batch", "8",
                 "--batches", "1", "--top", "1"]) != 0
    said = capsys.readouterr()
    assert str(tmp_path / "ai2d") in said.out + said.err


def test_cli_writes_a_valid_plan_and_prints_the_top_three(tmp_path, shared_traces, capsys) -> None:
    """`harmonia plan` ranks its default 3 best plans exactly."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny-vlm", "--cluster", "cpu:1x4", "--trace",
                 str(shared_traces / "ai2d.csv"), "--global-batch", "32", "--batches", "1",
                 "--json", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.world_size == 4 and np.isclose(plan.global_batch, 32)
    printed = capsys.readouterr().out
    assert "best 3 plans" in printed and "peak GiB/rank" in printed
    rows = [line for line in printed.splitlines() if re.match(r"^\W*\d+ \W+\d+\.\d+ \W+\d+\.\d+ \W+\d+\.\d", line)]
    assert len(rows) == 3
    assert re.search(r"\d+ candidates: \d+ simulated .* \d+ pruned by lower bounds; rejected: ", printed)


def test_cli_reads_a_relative_trace_from_the_working_directory(tmp_path, shared_traces, monkeypatch, capsys):
    """A ``--trace`` path is the user's: relative to where they run the command, not the project."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.csv").write_text((shared_traces / "ai2d.csv").read_text())
    args = ["plan", "--model", "tiny-vlm", "--cluster", "cpu:1x4", "--global-batch", "32", "--batches", "1",
            "--json", str(tmp_path / "plan.json"), "--trace"]
    assert main([*args, "mine.csv"]) == 0 and (tmp_path / "plan.json").exists()
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    capsys.readouterr()
    assert main([*args, "bad.csv"]) != 0
    said = capsys.readouterr()
    assert f"trace {tmp_path / 'bad.csv'}: header" in said.out + said.err


def test_harmonia_plan_is_never_slower_than_its_layout_split_evenly() -> None:
    """Llama-3.1 70B on 64 H100 as tp4 cp2 pp8 (recomputing as it must to fit): the frozen-aware
    split (11 blocks on the stage before the head's) simulates slower than the even split the
    baselines use (the last stage sends nothing on); harmonia's search simulates the even split of
    its best plan too and ranks it first."""
    scenario = Scenario("g", "llama3-70b", "h100:8x8", "text:8192", 32, iterations=1, search_batches=1)

    def accept(plan):
        llm = plan.layouts["llm"]
        return None if (llm.tp, llm.cp, llm.pp, llm.virtual_stages) == (4, 2, 8, 1) else "other"

    baseline = search_plan(scenario, accept=accept, recipe="megatron")
    found = search_plan(scenario, top=2, accept=accept)
    (best, _, cand), (second, _, runner_up) = found.ranked
    assert cand.plan.layouts["llm"].stage_layers is None and runner_up.plan.layouts["llm"].stage_layers is not None
    assert best < second and best <= baseline.ranked[0][0] + 1e-9


def test_the_plainer_twin_of_the_best_plan_is_picked_within_the_tolerance() -> None:
    """Where the best plan runs FSDP or zero-bubble, the same plan without them is simulated too and
    ranked first unless more than PLAINER_TOLERANCE slower; a schedule the job pins is kept."""
    from harmonia.plan.rerank import plainer as _plainer

    scenario = Scenario("plain", "tiny-omni", "cpu:1x4@2", "synthetic:image=0.7,text=0.3", 32, {"vision": "frozen"},
                        iterations=1, search_batches=1)
    free = search_plan(scenario, top=3)
    fsdp_or_zb = search_plan(scenario, top=3, accept=lambda p: None if p.layouts["llm"].fsdp and p.schedule == "zb"
                             else "plain")
    plain = fsdp_or_zb.best
    assert plain.layouts["llm"].fsdp and plain.schedule == "zb"  # the accept filter keeps the twin out
    twins = _plainer(plain)
    assert [(t.layouts["llm"].fsdp, t.schedule) for t in twins] == [(False, "1f1b"), (False, "zb"), (True, "1f1b")]
    assert all(t.layouts["llm"] == replace(plain.layouts["llm"], fsdp=False) for t in twins[:2])
    best = free.best
    assert not best.layouts["llm"].fsdp and best.schedule != "zb"
    assert free.ranked[0][0] <= min(r[0] for r in free.ranked) * (1 + PLAINER_TOLERANCE)


def test_a_plan_near_the_device_memory_gives_way_to_a_roomier_one_within_the_tolerance() -> None:
    """An 8B LLaVA with LoRA on one H200: the fastest plan peaks above 90% of the device, so the
    fastest one within PLAINER_TOLERANCE that stays below it is picked."""
    from harmonia.plan.recipes import MEMORY_HEADROOM
    from harmonia.plan.rerank import roomier_first as _roomier_first

    scenario = Scenario("room", "llava-siglip-8b", "h200:1x1", "synthetic:image", 8, {"vision": "frozen", "llm": "lora"},
                        iterations=1, search_batches=2)
    report = search_plan(scenario, top=3)
    capacity = ScenarioRun(scenario).cluster.device.mem_bytes
    assert max(report.peak_bytes) > MEMORY_HEADROOM * capacity  # a faster plan nearer the limit was found
    assert report.peak_bytes[0] <= MEMORY_HEADROOM * capacity
    assert report.ranked[0][0] <= min(r[0] for r in report.ranked) * (1 + PLAINER_TOLERANCE)
    ranked = [(1.0, 0, "a"), (1.01, 0, "b"), (1.03, 0, "c")]
    assert _roomier_first(ranked, [95, 80, 50], 100) == [ranked[1], ranked[0], ranked[2]]
    assert _roomier_first(ranked, [95, 92, 50], 100) == ranked  # the roomy one is too slow
    assert _roomier_first(ranked, [85, 95, 50], 100) == ranked  # the best has room


def test_cli_plans_a_cpu_cluster_on_the_cores_train_would_give_it(monkeypatch, capsys) -> None:
    """`harmonia plan --cluster cpu:1x4` on a machine of 2 cores plans for 4 ranks sharing them, as
    `harmonia train` does (and says so); a cluster naming its cores is planned as named."""
    monkeypatch.setattr("harmonia.train.backend.process_cores", lambda: 2)
    args = ["plan", "--model", "tiny-vlm", "--trace", "synthetic:image", "--global-batch", "32", "--batches", "1"]
    assert main([*args, "--cluster", "cpu:1x4", "--parallel.backend=gloo"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "cpu:1x4: 4 ranks on this machine's 2 cores, planned as cpu:1x4@2" in printed
    assert "plans for tiny-vlm on cpu:1x4 (global batch 32)" in printed
    assert main([*args, "--cluster", "cpu:1x4@4", "--parallel.backend=gloo"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "planned as" not in printed and "plans for tiny-vlm on cpu:1x4@4" in printed


def test_bounding_on_the_heaviest_replicas_and_by_twins_ranks_what_bounding_every_unit_does(monkeypatch) -> None:
    """On 32 GPUs (up to 32 replicas a module) the search bounds each batch on its heaviest replicas
    (`harmonia.plan.heavy_replicas`) and a plan by its twin recomputing less (`_Scorer.twin_bound`);
    its ranking is the one bounding every plan on every unit gives."""
    import harmonia.plan.search as search

    scenario = Scenario("wide", "omni-8b", "h100:4x8", "synthetic", 64, {"vision": "frozen", "audio": "frozen"},
                        iterations=1, search_batches=1)
    used, twins = [], []
    real, real_twin = search.heaviest_replicas, search._Scorer.twin_bound
    monkeypatch.setattr(search, "heaviest_replicas", lambda *args, **kw: used.append(real(*args, **kw)) or used[-1])
    monkeypatch.setattr(search._Scorer, "twin_bound",
                        lambda self, *args: twins.append(real_twin(self, *args)) or twins[-1])
    shortcut = search_plan(scenario, top=3)
    assert any(chosen is not None for chosen in used)
    assert any(bound > 0 for bound in twins)
    monkeypatch.setattr(search, "heaviest_replicas", lambda *args, **kw: None)
    monkeypatch.setattr(search._Scorer, "twin_bound", lambda self, *args: 0.0)
    every = search_plan(scenario, top=3)
    assert [(t, c.plan) for t, _, c in shortcut.ranked] == [(t, c.plan) for t, _, c in every.ranked]
    assert shortcut.peak_bytes == every.peak_bytes


def test_a_job_config_naming_its_data_is_planned_on_that_data(tmp_path, monkeypatch, capsys) -> None:
    """`harmonia plan --config job.toml` with the job's ``data.path`` and no ``--trace`` profiles that
    dataset as `harmonia train` does (its plan is the one training would search for) and writes nothing
    beside what ``--json`` asks for; ``--trace`` still overrides it; `harmonia simulate` reads it alike."""
    from harmonia.config import load_config
    from harmonia.data.synth import write_synthetic_dataset
    from harmonia.train.data import open_split
    from harmonia.train.planning import search_training_plan

    data = write_synthetic_dataset(tmp_path / "data", 40, seed=1)
    job = tmp_path / "job.toml"
    job.write_text(f'[data]\npath = "{data}"\n[parallel]\nworld_size = 2\n[train]\nglobal_batch = 8\n')
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    assert main(["plan", "--config", str(job), "--top", "1", "--json", str(tmp_path / "plan.json")]) == 0
    printed = capsys.readouterr().out
    assert f"data.path={data} (36 usable samples)" in " ".join(printed.split())
    assert sorted(tmp_path.rglob("*")) == sorted([*before, tmp_path / "plan.json"])
    config = load_config(job)
    trained = search_training_plan(config, open_split(config, "train", cache_dir=None).shapes()).best
    assert Plan.load(tmp_path / "plan.json").layouts == trained.layouts
    assert main(["plan", "--config", str(job), "--top", "1", "--trace", "text:64"]) == 0
    assert "profiled batches of text:64" in " ".join(capsys.readouterr().out.split())
    layout = "vision dp2; audio dp2; llm dp2"
    assert main(["simulate", "--config", str(job), "--iterations", "1", "--layout", layout]) == 0
    assert f"1 iterations of 8 samples ({data})" in " ".join(capsys.readouterr().out.split())
    assert sorted(tmp_path.rglob("*")) == sorted([*before, tmp_path / "plan.json"])
