"""``train.eval_every``: the loss over the evaluation set during training is the one-process loss of
the checkpoint on those samples, and evaluating does not change what trains."""

from __future__ import annotations

import io
import json
import warnings

import pytest
import torch
from rich.console import Console

from harmonia.config import load_config
from harmonia.errors import ConfigError
from harmonia.metrics import read_metrics
from harmonia.model.batch import pack_samples
from harmonia.model.llm import lm_loss
from harmonia.train import run_training
from harmonia.train.data import open_split
from harmonia.train.job import prepare_data
from harmonia.train.planning import model_spec
from harmonia.train.report import summary_table
from harmonia.train.weights import initial_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def _config(tmp_path, name: str, *extra: str):
    return load_config(None, [
        "--model.preset=tiny-vlm", "--parallel.world_size=2", "--parallel.cluster=cpu:1x2",
        f"--data.path={tmp_path / 'data'}", "--data.synthesize=32", "--data.heldout=20", "--train.steps=2",
        "--train.global_batch=8", "--train.warmup=1", "--log.tensorboard=false", f"--log.dir={tmp_path / name}",
        f"--checkpoint.dir={tmp_path / name / 'ck'}", "--checkpoint.every=0", *extra])


def _checkpoint_loss(config, step: int) -> float:
    """The mean next-token loss over every target token of the held-out samples, in one process."""
    import torch.distributed.checkpoint as dcp

    spec = model_spec(config)
    ds = open_split(config, "heldout", spec)
    samples = ds.load(list(range(len(ds))))
    model = initial_model(spec, config.train.seed, None)
    state = {"model": dict(model.state_dict())}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=f"{config.checkpoint.dir}/step-{step}", no_dist=True)
    model.eval()
    total = targets = 0.0
    with torch.no_grad():
        for s in samples:
            batch = pack_samples([s.tokens])
            total += float(lm_loss(model(batch), batch.labels, normalizer=1.0))
            targets += float((batch.labels != -100).sum())
    return total / targets, len(samples)


def test_the_eval_loss_is_the_checkpoints_and_leaves_training_alone(tmp_path, capfd) -> None:
    config = _config(tmp_path, "eval", "--train.eval_every=1")
    result = run_training(config, Console(file=io.StringIO(), width=200))
    assert [(e["step"], e["batches"], e["samples"], e["left_out"]) for e in result.evals] == [(1, 2, 16, 4), (2, 2, 16, 4)]
    assert result.evals[1]["loss"] < result.evals[0]["loss"]
    assert "eval after step 2: loss" in capfd.readouterr().out  # rank 0's line
    table = Console(file=io.StringIO(), width=200)
    table.print(summary_table(result.records, result.accuracy, result.evals))
    assert "eval loss (after step 1 -> 2, 16 samples)" in table.file.getvalue()
    logged = [r for r in read_metrics(tmp_path / "eval") if "eval" in r]
    assert [(r["step"], r["eval"]["loss"]) for r in logged] == [(0, result.evals[0]["loss"]), (1, result.evals[1]["loss"])]
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["eval_losses"] == result.evals

    plain = run_training(_config(tmp_path, "plain"), Console(file=io.StringIO(), width=200))
    assert plain.losses == result.losses and not plain.evals  # evaluating changed nothing that trains

    # 16 of the 20 held-out samples are evaluated (2 whole batches); with all 20 evaluated the
    # checkpoint's own loss differs, so evaluate a set of exactly 16 against it
    ds_dir = tmp_path / "data"
    config16 = _config(tmp_path, "eval16", "--train.eval_every=2", f"--data.eval_path={ds_dir / 'heldout'}",
                       "--train.global_batch=4")
    got = run_training(config16, Console(file=io.StringIO(), width=200)).evals[-1]
    assert got["samples"] == 20 and got["left_out"] == 0
    want, n = _checkpoint_loss(config16, 2)
    assert n == 20 and got["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("layouts", ["vision dp2 fsdp; llm dp2 fsdp reshard", "vision dp2; llm dp2 fsdp",
                                     "vision dp2; llm pp2", "vision tp2; llm tp2"])
def test_the_forward_only_evaluation_is_the_checkpoints_loss_under_every_layout_kind(tmp_path, layouts) -> None:
    """Evaluation batches run forward actions alone (no backward, no gradient): under FSDP, a pipeline
    and TP's vocabulary-parallel loss, the loss is still the checkpoint's."""
    from harmonia.model.presets import mllm_preset
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts

    plan = plan_from_layouts(mllm_preset("tiny-vlm"), "tiny-vlm", parse_layouts(layouts), 2, 4, microbatch_size=2)
    plan.save(tmp_path / "plan.json")
    prepare_data(_config(tmp_path, "data"))
    config = _config(tmp_path, "eval", "--train.eval_every=2", f"--data.eval_path={tmp_path / 'data' / 'heldout'}",
                     "--train.global_batch=4", f"--parallel.plan={tmp_path / 'plan.json'}")
    got = run_training(config, Console(file=io.StringIO(), width=200)).evals[-1]
    want, n = _checkpoint_loss(config, 2)
    assert got["samples"] == n == 20 and got["loss"] == pytest.approx(want, rel=1e-5)


def test_evaluation_schedules_hold_forward_actions_only() -> None:
    from harmonia.model.presets import mllm_preset
    from harmonia.plan.layout_text import parse_layouts, plan_from_layouts
    from harmonia.schedule.actions import Kind
    from harmonia.schedule.families import build_schedule
    from harmonia.train.rank import schedule_graph

    spec = mllm_preset("tiny-vlm")
    plan = plan_from_layouts(spec, "tiny-vlm", parse_layouts("vision dp2; llm pp2"), 2, 8, microbatch_size=2)

    def kinds(graph):
        return {a.kind for actions in build_schedule(graph, 4, "1f1b").orders.values() for a in actions}

    assert Kind.F in kinds(schedule_graph(spec, plan)) and Kind.BW in kinds(schedule_graph(spec, plan))
    assert kinds(schedule_graph(spec, plan, forward_only=True)) == {Kind.F}


def test_an_eval_set_in_no_known_format_stops_the_job_before_any_rank_starts(tmp_path) -> None:
    (tmp_path / "eval.jsonl").write_text('{"foo": 1}\n')
    config = _config(tmp_path, "badformat", "--train.eval_every=1", f"--data.eval_path={tmp_path / 'eval.jsonl'}")
    with pytest.raises(ConfigError, match=r"eval.jsonl: its first 1 records match no format: keys found \['foo'\]"):
        run_training(config, Console(file=io.StringIO(), width=200))


def test_an_eval_path_that_does_not_exist_is_refused(tmp_path) -> None:
    config = _config(tmp_path, "bad", "--train.eval_every=1", f"--data.eval_path={tmp_path / 'nope.jsonl'}")
    with pytest.raises(ConfigError, match="data.eval_path=.*nope.jsonl.* does not exist"):
        run_training(config, Console(file=io.StringIO(), width=200))


def test_an_eval_set_smaller_than_a_batch_stops_the_job_before_any_rank_starts(tmp_path) -> None:
    """Counted by the launcher, with one line, not by every rank after it started (global batch 8)."""
    from harmonia.errors import SampleError

    config = _config(tmp_path, "small", "--train.eval_every=1", "--data.heldout=5")
    with pytest.raises(SampleError, match="has 5 usable samples, fewer than train.global_batch=8"):
        run_training(config, Console(file=io.StringIO(), width=200))
    assert not (tmp_path / "small" / "metrics.jsonl").exists()  # no rank trained
