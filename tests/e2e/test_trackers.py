"""``log.wandb`` and ``log.mlflow``: a job logs the numbers of ``metrics.jsonl`` to a Weights & Biases
run (offline mode, read back from its transaction log with W&B's own record type) and to an MLflow run
(a local store, read back with MLflow's client); a resumed job logs to a new run beside the first."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from harmonia.config import load_config
from harmonia.metrics import read_metrics
from harmonia.train.job import prepare_data
from tests.e2e.test_faults import _args as faults_args
from tests.e2e.test_faults import _finish, _start

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
wandb_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")
mlflow = pytest.importorskip("mlflow")

W_AND_B_HEADER = 7  # ":W&B", magic 0xBEE1, version
BLOCK = 32768  # the transaction log's LevelDB-style blocks: checksum u32, length u16, type u8, payload
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's ``run-*.wandb`` file."""
    data, offset, records, parts = path.read_bytes(), W_AND_B_HEADER, [], b""
    assert data[:4] == b":W&B"
    while offset + 7 <= len(data):
        left = BLOCK - offset % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            offset += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, offset)
        if kind == 0 and length == 0:
            offset += left
            continue
        parts += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (FULL, LAST):
            record = wandb_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_history(records: list) -> dict[int, dict]:
    out = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            out.setdefault(items["_step"], {}).update(items)
    return out


def _args(tmp: Path, *extra: str) -> list[str]:
    return faults_args(tmp, "run", "--parallel.world_size=1", "--parallel.cluster=cpu:1x1", "--train.eval_every=2",
                       f"--data.eval_path={tmp / 'data' / 'heldout'}", "--checkpoint.every=4", "--log.wandb=true",
                       "--log.mlflow=true", f"--log.mlflow_uri=file:{tmp / 'mlruns'}", "--log.project=tiny", *extra)


def _train(tmp: Path, *extra: str) -> str:
    code, out = _finish(_start(_args(tmp, *extra)))
    assert code == 0, out[-3000:]
    return out


def test_wandb_and_mlflow_runs_hold_the_jobs_metrics_and_a_resume_starts_a_new_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves this machine
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's local store, for the test alone
    prepare_data(load_config(None, _args(tmp_path)))
    _train(tmp_path, "--train.steps=4")
    logged = read_metrics(tmp_path / "run")
    losses = {r["step"]: r["loss"] for r in logged if "loss" in r}
    evals = {r["step"]: r["eval"]["loss"] for r in logged if "eval" in r}
    assert sorted(losses) == [0, 1, 2, 3] and sorted(evals) == [1, 3]

    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project, run.run_group) == ("run", "tiny", "run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train.steps"] == 4 and config["model.preset"] == "tiny-vlm"
    history = wandb_history(records)
    assert {s: h["loss"] for s, h in history.items()} == pytest.approx(losses)
    assert {s: h["eval/loss"] for s, h in history.items() if "eval/loss" in h} == pytest.approx(evals)
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [0]

    client = mlflow.MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    _check_mlflow(client, losses, evals)
    _train(tmp_path, "--train.steps=6")  # resumes from step-4
    experiment = client.get_experiment_by_name("tiny")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["run", "run from step-4"]
    resumed = runs["run from step-4"]
    assert resumed.data.tags["harmonia.run"] == "run" and resumed.data.tags["harmonia.from_step"] == "4"
    assert sorted(m.step for m in client.get_metric_history(resumed.info.run_id, "loss")) == [4, 5]
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 2


def _check_mlflow(client, losses: dict, evals: dict) -> None:
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "4" and run.data.tags["harmonia.run"] == "run"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == pytest.approx(losses)
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")} == pytest.approx(evals)


def test_a_tracker_without_its_setup_is_refused_before_anything_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code, out = _finish(_start(faults_args(tmp_path, "run", "--log.mlflow=true")))
    assert code == 2, out[-3000:]
    assert "error: log.mlflow=true needs a tracking URI" in out
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()
