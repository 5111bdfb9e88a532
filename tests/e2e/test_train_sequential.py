"""`harmonia train` with ``train.assignment=sequential`` trains the losses one process computes.

Two processes run a Megatron-style plan (the LLM pipelined over both ranks, both encoders on its
first stage) in fixed-size microbatches in data order; every step's loss must be the one-process
run's on the same data stream (the loss of a step does not depend on how its samples are grouped).
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from harmonia.config import load_config
from harmonia.schedule.layout import Layout
from harmonia.schedule.plan import Plan
from harmonia.train import run_training
from harmonia.train.job import prepare_data

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
BATCH, N_MB = 8, 2


def _config(tmp, name: str, *extra: str):
    return load_config(None, [
        f"--data.path={tmp / 'data'}", "--data.synthesize=40", "--data.heldout=0", "--train.steps=2",
        f"--train.global_batch={BATCH}", "--train.warmup=1", "--parallel.timeout_s=240", "--log.tensorboard=false",
        '--train.modules={"vision_proj": {"lr": 0.01, "weight_decay": 0.0}}',  # a module's own rate, in both runs
        f"--log.dir={tmp / name}", f"--checkpoint.dir={tmp / name / 'ck'}", *extra])


def seq_lr(tmp) -> float:
    return _config(tmp, "lr").train.lr


def _run(config):
    return run_training(config, Console(file=io.StringIO(), width=200))


def test_two_processes_in_sequential_microbatches_train_the_one_process_losses(tmp_path) -> None:
    prepare_data(_config(tmp_path, "prep"))
    ref = _run(_config(tmp_path, "ref", "--parallel.world_size=1", "--parallel.cluster=cpu:1x1"))
    first_stage = (0,)
    plan = Plan("tiny-omni", {"vision": Layout(ranks=first_stage), "audio": Layout(ranks=first_stage),
                              "llm": Layout(pp=2)}, "colocated", "1f1b", n_microbatches=N_MB, global_batch=BATCH,
                training={"vision": "frozen"})
    plan.save(tmp_path / "plan.json")
    seq = _run(_config(tmp_path, "seq", "--parallel.world_size=2", "--parallel.cluster=cpu:1x2",
                       f"--parallel.plan={tmp_path / 'plan.json'}", "--train.assignment=sequential",
                       "--log.memory=true"))
    assert seq.plan.layouts["llm"].pp == 2 and [r["step"] for r in seq.records] == [0, 1]
    for record in seq.records:
        balance = record["balance"]
        assert balance["microbatch_samples_min"] == balance["microbatch_samples_max"] == BATCH // N_MB
        assert record["sub_microbatches"] == {"vision": 1, "audio": 1}
    assert seq.losses == pytest.approx(ref.losses, rel=1e-5)  # counting tensor bytes changes nothing
    for record in seq.records:  # the projector's own schedule: 0.01 / train.lr times the global one
        assert record["lr_modules"]["vision_proj"] == pytest.approx(0.01 / seq_lr(tmp_path) * record["lr"])
    last = seq.records[-1]  # after an optimizer step: Adam's states exist, as the planner counts them
    for held, states, peak, predicted in zip(last["memory_held_bytes"], last["memory_states_predicted_bytes"],
                                             last["memory_peak_bytes"], last["memory_predicted_bytes"]):
        assert held == pytest.approx(states, rel=0.01)  # weights, gradients, optimizer states: as priced
        assert peak > held and predicted > states  # activations on top, measured and predicted
