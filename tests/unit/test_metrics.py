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
