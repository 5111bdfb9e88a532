"""Scoring a given plan: layouts as text, LLM-only models and traces, `harmonia simulate --layout/--plan`."""

import json

import pytest
import transformers
from hypothesis import given
from hypothesis import strategies as st

from harmonia.cli import main
from harmonia.errors import ConfigError, LayoutError, TraceError
from harmonia.model.presets import LLMS, mllm_preset
from harmonia.model.resolve import resolve_mllm
from harmonia.plan.layout_text import describe_layouts, parse_layout, parse_layouts, place_layouts, plan_from_layouts
from harmonia.schedule.layout import Layout, Placement
from harmonia.workload.traces import load_trace

DEGREES = st.sampled_from([1, 2, 3, 4, 8])


@given(tp=DEGREES, cp=DEGREES, pp=DEGREES, v=DEGREES, dp=DEGREES, fsdp=st.booleans())
def test_describe_round_trips(tp, cp, pp, v, dp, fsdp) -> None:
    layout = Layout(tp=tp, cp=cp, dp=dp, pp=pp, virtual_stages=v, fsdp=fsdp and dp > 1)
    text = layout.describe()
    assert parse_layout(text) == layout
    assert parse_layout(text).describe() == text
    both = {"vision": Layout(tp=tp, dp=dp), "llm": layout}
    assert parse_layouts(describe_layouts(both)) == both
    assert list(parse_layouts(describe_layouts(both))) == ["vision", "llm"]  # the order written is kept


def test_layout_text_forms_and_errors() -> None:
    assert parse_layout("tp4 cp2 pp4 v5 dp2") == Layout(tp=4, cp=2, pp=4, virtual_stages=5, dp=2)
    assert parse_layout("dp32 fsdp cp2") == Layout(cp=2, dp=32, fsdp=True)  # axes left out are 1
    assert parse_layout("tp1 pp2 dp1 split[15, 13]").stage_layers == (15, 13)  # as `harmonia plan` prints it
    for bad, named in (("tp4 tp2", "'tp2'"), ("tp4 sp2", "'sp2'"), ("pp0", "pp=0")):
        with pytest.raises(LayoutError, match=named):
            parse_layout(bad)
    with pytest.raises(LayoutError, match="module name"):
        parse_layouts("tp4 pp2")
    with pytest.raises(LayoutError, match="twice"):
        parse_layouts("llm tp1; llm tp2")


def test_ranks_follow_the_cluster() -> None:
    layouts = parse_layouts("vision tp1 pp1 dp8; llm tp4 pp2 dp1")
    disjoint, placement = place_layouts(layouts, 16)
    assert placement is Placement.DISJOINT
    assert disjoint["vision"].rank_list() == tuple(range(8)) and disjoint["llm"].rank_list() == tuple(range(8, 16))
    colocated, placement = place_layouts(parse_layouts("vision tp1 pp1 dp4; llm tp4 pp2 dp1"), 8)
    assert placement is Placement.COLOCATED and colocated["vision"].rank_list() == (0, 1, 2, 3)
    with pytest.raises(LayoutError, match="add up to 12"):
        place_layouts(layouts, 12)
    with pytest.raises(LayoutError, match="'llm'"):
        place_layouts({"vision": Layout(dp=8)}, 8)


def test_plan_from_layouts_checks_batch_and_model() -> None:
    mllm = mllm_preset("llama3-70b")
    plan = plan_from_layouts(mllm, "llama3-70b", parse_layouts("llm tp4 cp2 pp4 v5 dp2"), 64, 128)
    assert (plan.n_microbatches, plan.schedule, plan.world_size) == (64, "interleaved", 64)
    assert plan_from_layouts(mllm, "llama3-70b", parse_layouts("llm cp2 dp32 fsdp"), 64, 128, 2,
                             recompute=("llm",)).n_microbatches == 2
    with pytest.raises(ConfigError, match="not a multiple"):
        plan_from_layouts(mllm, "llama3-70b", parse_layouts("llm cp2 dp32 fsdp"), 64, 100)
    with pytest.raises(ConfigError, match="not modules"):
        plan_from_layouts(mllm, "llama3-70b", parse_layouts("llm dp8"), 8, 16, recompute=("vision",))
    with pytest.raises(ConfigError, match="encoders"):  # a layout for a module the model lacks
        plan_from_layouts(mllm, "llama3-70b", parse_layouts("vision dp8; llm dp8"), 16, 16)


def test_text_trace() -> None:
    samples = load_trace("text:8192", n_samples=5)
    assert [(s.text_tokens, s.items) for s in samples] == [(8192, ())] * 5
    for bad in ("text:", "text:0", "text:8k"):
        with pytest.raises(TraceError, match="text:N"):
            load_trace(bad)


def test_llm_only_models_from_presets_and_config_json(tmp_path) -> None:
    for name, published in (("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9)):
        mllm = mllm_preset(name)
        assert mllm.module_names == ["llm"]
        assert abs(mllm.llm.n_params() / published - 1) < 0.002
    # Llama-3.1-8B's config.json (architecture only, no weights) is an MLLM without encoders
    transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}).save_pretrained(tmp_path)
    mllm = resolve_mllm(str(tmp_path))
    assert mllm.encoders == {} and mllm.module_names == ["llm"]
    assert mllm.llm.n_params() == LLMS["llama3-8b"].spec.n_params()


def test_simulate_scores_a_layout_and_a_plan_alike(tmp_path, capsys) -> None:
    flags = ["--model", "llama3-8b", "--cluster", "h100:1x8", "--trace", "text:4096", "--global-batch", "16",
             "--iterations", "1"]
    out = tmp_path / "layout.json"
    assert main(["simulate", *flags, "--layout", "llm tp1 cp2 pp1 dp4", "--microbatch-size", "2",
                 "--json", str(out)]) == 0
    assert "MFU: useful FLOPs" in capsys.readouterr().out.replace("\n", " ")  # the table says how it counts
    scored = json.loads(out.read_text())["recipes"]["harmonia"]
    assert scored["plan"]["llm"]["cp"] == 2 and scored["n_microbatches"] == 2
    assert scored["tokens_per_s"] == pytest.approx(16 * 4096 / scored["iteration_s"])
    mllm = mllm_preset("llama3-8b")
    plan = plan_from_layouts(mllm, "llama3-8b", parse_layouts("llm tp1 cp2 pp1 dp4"), 8, 16, 2)
    plan.save(tmp_path / "plan.json")
    again = tmp_path / "plan-scored.json"
    assert main(["simulate", *flags, "--plan", str(tmp_path / "plan.json"), "--json", str(again)]) == 0
    assert json.loads(again.read_text())["recipes"]["harmonia"]["iteration_s"] == scored["iteration_s"]
    slower = tmp_path / "slower.json"  # a measured matmul rate below the preset's 0.60
    assert main(["simulate", *flags, "--plan", str(tmp_path / "plan.json"), "--device-set", "flops_efficiency=0.5",
                 "--json", str(slower)]) == 0
    assert json.loads(slower.read_text())["recipes"]["harmonia"]["iteration_s"] > scored["iteration_s"] * 1.05


def test_simulate_refuses_mixed_or_mismatched_inputs(tmp_path, capsys) -> None:
    assert main(["simulate", "--scenario", "configs/scenarios/d-qwen7b-internvit-8gpu.toml", "--model",
                 "llama3-8b"]) == 2
    assert "both given" in capsys.readouterr().out
    assert main(["simulate", "--model", "llama3-8b", "--cluster", "h100:1x8", "--trace", "text:1024",
                 "--global-batch", "16", "--layout", "llm tp1 pp1 dp4"]) == 2
    assert "add up to 8" in capsys.readouterr().out
    assert main(["simulate", "--model", "llama3-8b", "--cluster", "h100:1x8", "--trace", "text:1024",
                 "--global-batch", "16", "--layout", "llm tp1 pp1 dp8", "--device-set", "flops=0.6"]) == 2
    assert "device setting 'flops=0.6': expected FIELD=VALUE" in capsys.readouterr().out


def test_simulate_refuses_a_layout_off_the_cluster_before_loading_anything(tmp_path, capsys) -> None:
    missing = str(tmp_path / "no-such-trace.csv")  # never read: the sizes are refused first
    assert main(["simulate", "--model", "llama3-70b", "--cluster", "h100:8x8", "--trace", missing,
                 "--global-batch", "256", "--layout", "llm tp8 cp2 pp8 v2 dp4"]) == 2
    out = capsys.readouterr().out.replace("\n", " ")
    assert "{'llm': 512} ranks on a cluster of 64" in out and "no-such-trace" not in out
    plan = plan_from_layouts(mllm_preset("llama3-8b"), "llama3-8b", parse_layouts("llm tp1 pp1 dp8"), 8, 16)
    plan.save(tmp_path / "plan.json")
    assert main(["simulate", "--plan", str(tmp_path / "plan.json"), "--cluster", "h100:2x8", "--trace", missing]) == 2
    out = capsys.readouterr().out.replace("\n", " ")
    assert "the plan uses 8 ranks but cluster h100:2x8 has 16" in out and "no-such-trace" not in out
