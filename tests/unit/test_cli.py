"""The command line in-process: each subcommand's help, and the workload and profile paths."""

import json

import pytest

from harmonia.cli import build_parser, main


@pytest.mark.parametrize("command", ["models", "workload", "profile", "simulate", "demo"])
def test_help(command, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: harmonia" in capsys.readouterr().out


def test_every_subcommand_is_registered() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"models", "workload", "profile", "simulate", "demo"} <= set(sub.choices)


def test_workload_on_real_trace(shared_traces, capsys) -> None:
    assert main(["workload", "--model", "omni-8b", "--frozen", "vision,audio",
                 "--trace", str(shared_traces / "chartqa.csv")]) == 0
    out = capsys.readouterr().out
    assert "18317 samples" in out and "vision_proj" in out


def test_bad_input_is_an_error_not_a_traceback(capsys) -> None:
    assert main(["workload", "--model", "no-such-model"]) == 2
    assert "unknown MLLM preset" in capsys.readouterr().out


def test_profile_writes_calibration(tmp_path) -> None:
    out = tmp_path / "cal.json"
    assert main(["profile", "--lengths", "32,64", "--repeats", "1", "--out", str(out)]) == 0
    cal = json.loads(out.read_text())
    measured = {r["phase"] for r in cal["measurements"] if r["seconds"] is not None}  # B, W: above the noise
    assert "F" in measured and set(cal["flops_efficiency"]) == measured
    assert all(0 < v <= 1.5 for v in cal["flops_efficiency"].values())


def test_simulate_writes_the_comparison_json(tmp_path) -> None:
    out = tmp_path / "sim.json"
    assert main(["simulate", "--recipes", "megatron,disttrain", "--iterations", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"scenario", "recipes", "lower_bound_s"}
    for recipe in ("megatron", "disttrain"):
        r = result["recipes"][recipe]
        assert r["iteration_s"] >= result["lower_bound_s"] * 0.99
        assert 0 <= r["bubble_frac"] < 1 and 0 < r["mfu"] < 1


def test_a_plan_into_a_missing_directory_is_refused_before_the_search(tmp_path, capsys) -> None:
    out = tmp_path / "missing" / "plan.json"
    assert main(["plan", "--json", str(out)]) == 2
    printed = capsys.readouterr()
    assert f"--json {out}: its directory {out.parent} does not exist" in printed.out + printed.err
    assert not out.parent.exists()
