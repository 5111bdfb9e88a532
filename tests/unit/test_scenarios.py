"""The benchmark scenarios and the regimes they cover: every file loads, long videos, long-context search."""

from pathlib import Path

import pytest

from harmonia.errors import ConfigError
from harmonia.model.presets import mllm_preset
from harmonia.plan.recipes import LONG_SAMPLE, candidates
from harmonia.plan.scenario import Scenario, ScenarioRun, parse_device_changes
from harmonia.workload.traces import load_trace
from harmonia.workload.work import load_arrays

SCENARIOS = sorted((Path(__file__).resolve().parents[2] / "configs" / "scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_every_scenario_file_loads(path) -> None:
    scenario = Scenario.load(path)
    assert scenario.global_batch >= 1
    if not scenario.trace.endswith(".csv"):
        assert load_trace(scenario.trace_spec(), n_samples=8)


def test_long_videos_are_8k_to_40k_llm_tokens() -> None:
    samples = load_trace("synthetic:long_video=1", n_samples=2000)
    frames = [s.items[0].frames for s in samples]
    assert min(frames) == 32 and max(frames) == 160
    mllm = mllm_preset("internvl-8b")
    tokens = load_arrays(samples, mllm)[0][:, mllm.module_names.index("llm")]
    assert 8192 < tokens.min() and tokens.max() < 160 * 256 + 4096


@pytest.mark.parametrize("trace, long", [("text:8192", True), ("text:512", False)])
def test_long_samples_are_searched_with_context_parallelism_and_one_per_microbatch(trace, long) -> None:
    run = ScenarioRun(Scenario("cp", "tiny-vlm", "cpu:1x4", trace, 32, iterations=1, search_batches=1))
    assert (run.profile.sample_load("llm").tokens >= LONG_SAMPLE) is long
    found = list(candidates("harmonia", run.cost, run.cluster, run.profile, 32, "tiny-vlm"))
    assert found and any(c.plan.layouts["llm"].cp > 1 for c in found) is long
    assert all(c.plan.layouts[e].cp == 1 for c in found for e in c.plan.encoders)  # never an encoder
    one_each = [c for c in found if c.plan.n_microbatches * c.plan.layouts["llm"].dp == 32]
    assert any(c.plan.n_microbatches > 16 for c in one_each) is long  # beyond the usual 2pp, 4pp, 8


def test_a_scenarios_device_fields_replace_the_presets_in_the_cost_model_and_the_cluster(tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[scenario]\nname = "fit"\nmodel = "llama3-8b"\ncluster = "h100:1x8"\ntrace = "text:2048"\n'
                    'global_batch = 8\niterations = 1\nsearch_batches = 1\ndevice = { flops_efficiency = 0.5 }\n')
    run = ScenarioRun(Scenario.load(path))
    preset = ScenarioRun(Scenario("preset", "llama3-8b", "h100:1x8", "text:2048", 8, iterations=1, search_batches=1))
    assert run.cluster.device.flops_efficiency == run.cost.device.flops_efficiency == 0.5
    assert run.cost.device.attention_efficiency == preset.cost.device.attention_efficiency  # only what is named
    slower = run.costs[0, run.cost.modules.index("llm")] / preset.costs[0, preset.cost.modules.index("llm")]
    assert 1.0 < slower < 0.6 / 0.5 + 1e-9  # the matmuls alone run 0.6 / 0.5 times longer
    with pytest.raises(ConfigError, match=r"device fields \['flops'\] unknown"):
        Scenario("bad", "llama3-8b", "h100:1x8", "text:2048", 8, device={"flops": 0.6})
    with pytest.raises(ConfigError, match=r"device \{'flops_efficiency': '0.6'\} invalid"):  # a TOML string
        Scenario("bad", "llama3-8b", "h100:1x8", "text:2048", 8, device={"flops_efficiency": "0.6"})
    with pytest.raises(ConfigError, match="mixed_precision is true or false"):
        Scenario("bad", "llama3-8b", "h100:1x8", "text:2048", 8, device={"mixed_precision": 1})
    with pytest.raises(ConfigError, match="flops_efficiency must be in"):
        ScenarioRun(Scenario("bad", "llama3-8b", "h100:1x8", "text:2048", 8, iterations=1, search_batches=1,
                             device={"flops_efficiency": 1.5}))


def test_device_settings_parse_to_each_fields_type_or_name_what_is_wrong() -> None:
    assert parse_device_changes("flops_efficiency=0.6, mixed_precision=false") == {
        "flops_efficiency": 0.6, "mixed_precision": False}
    assert parse_device_changes("") == {}
    for text, message in (("flops=0.6", "expected FIELD=VALUE"), ("flops_efficiency", "expected FIELD=VALUE"),
                          ("gpus_per_node=4", "expected FIELD=VALUE"),  # the cluster string gives it
                          ("mixed_precision=yes", "mixed_precision takes a bool, not 'yes'"),
                          ("latency_s=soon", "latency_s takes a float, not 'soon'"),
                          ("split_backward_s=1e-4", "split_backward_s takes a pair of floats B:W, not '1e-4'")):
        with pytest.raises(ConfigError, match=message):
            parse_device_changes(text)
    assert parse_device_changes("split_backward_s=2e-4:4e-4") == {"split_backward_s": (2e-4, 4e-4)}


def test_a_scenario_sets_the_split_backward_price_as_two_numbers_and_nothing_outside_its_table(tmp_path) -> None:
    run = ScenarioRun(Scenario("cpu", "tiny-vlm", "cpu:1x2", "text:64", 4, iterations=1, search_batches=1,
                               device={"split_backward_s": [1e-4, 2e-4]}))  # as TOML gives it: a list
    assert run.cluster.device.split_backward_s == (1e-4, 2e-4)
    with pytest.raises(ConfigError, match="split_backward_s two numbers"):
        Scenario("bad", "tiny-vlm", "cpu:1x2", "text:64", 4, device={"split_backward_s": 1e-4})
    path = tmp_path / "s.toml"
    path.write_text('[scenario]\nname = "s"\nmodel = "tiny-vlm"\ncluster = "cpu:1x2"\ntrace = "text:64"\n'
                    'global_batch = 4\n\n[device]\nsplit_backward_s = [1e-4, 2e-4]\n')
    with pytest.raises(ConfigError, match=r"unknown tables or keys \['device'\]"):
        Scenario.load(path)
