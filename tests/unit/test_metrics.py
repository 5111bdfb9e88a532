"""Metrics: JSON lines and TensorBoard events, nothing from other ranks."""

from harmonia.metrics import MetricsWriter, read_metrics


def test_jsonl_and_tensorboard(tmp_path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.log(1, {"loss": 2.5, "module_s": {"llm": 0.3, "vision": 0.1}, "skipped": 0})
    writer.log(2, {"loss": 2.0, "module_s": {"llm": 0.3, "vision": 0.1}, "skipped": 1})
    writer.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and records[1]["module_s"]["llm"] == 0.3
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    silent = MetricsWriter(tmp_path / "other", enabled=False)
    silent.log(1, {"loss": 1.0})
    assert not (tmp_path / "other").exists()


def test_resume_cuts_metrics_back_and_a_torn_line_goes(tmp_path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(5):
        writer.log(step, {"loss": 1.0})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # a write cut short by a crash
    resumed = MetricsWriter(tmp_path, tensorboard=False, start_step=3)
    resumed.log(3, {"loss": 0.5})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    MetricsWriter(tmp_path, tensorboard=False).close()  # a fresh run starts an empty file
    assert read_metrics(tmp_path) == []


def test_a_full_disk_warns_once_and_logging_goes_on(tmp_path, caplog) -> None:
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(3):
        writer.log(step, {"loss": 1.0})
    writer.close()
    warnings = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


class _Tracker:
    name = "Tracker"

    def __init__(self, fail_at: int | None = None) -> None:
        self.logged, self.closed, self.fail_at = [], None, fail_at

    def log(self, step: int, scalars: dict) -> None:
        if step == self.fail_at:
            raise ConnectionError("server gone")
        self.logged.append((step, scalars))

    def close(self, failed: bool) -> None:
        self.closed = failed


def test_trackers_get_the_finite_scalars_and_one_that_fails_is_dropped_with_one_warning(tmp_path, caplog) -> None:
    good, bad = _Tracker(), _Tracker(fail_at=1)
    writer = MetricsWriter(tmp_path, tensorboard=False, trackers=[good, bad])
    for step in range(3):
        writer.log(step, {"loss": 1.0 / (step + 1), "module_s": {"llm": 0.5}, "note": "x", "nan": float("nan")})
    writer.close(failed=True)
    assert [s for s, _ in good.logged] == [0, 1, 2] and [s for s, _ in bad.logged] == [0]
    assert good.logged[2][1] == {"loss": 1.0 / 3, "module_s/llm": 0.5}
    assert good.closed is True and bad.closed is None  # a dropped tracker is not called again
    warnings = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
    assert len(warnings) == 1 and "Tracker metrics" in warnings[0] and "server gone" in warnings[0]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]  # metrics.jsonl unaffected


def test_a_tracker_that_cannot_start_is_one_line(tmp_path) -> None:
    import pytest

    from harmonia.config import load_config
    from harmonia.errors import HarmoniaError
    from harmonia.train.trackers import config_params, open_trackers

    pytest.importorskip("mlflow")
    config = load_config(None, [f"--log.dir={tmp_path}", "--log.mlflow=true", "--log.mlflow_uri=nosuch://x"])
    with pytest.raises(HarmoniaError, match=r"^log\.mlflow: could not start a run: \w+: .*nosuch") as err:
        open_trackers(config, 0)
    assert "\n" not in str(err.value)
    params = config_params(config)
    assert params["log.mlflow_uri"] == "nosuch://x" and params["train.steps"] == config.train.steps
