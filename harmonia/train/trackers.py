"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases and MLflow, on rank 0 only.

``log.wandb`` and ``log.mlflow`` send every logged step's scalars (the names ``metrics.jsonl`` and
TensorBoard use, nested names joined by ``/``) and the evaluation losses to a run named
``log.run_name`` (by default the last part of ``log.dir``) in project / experiment ``log.project``,
with the whole config as the run's config (W&B) or parameters (MLflow).

- Weights & Biases honours its own variables: ``WANDB_MODE=offline`` writes the run under
  ``<log.dir>/wandb`` for a later ``wandb sync``; ``WANDB_API_KEY``, ``WANDB_ENTITY`` and the others
  apply as usual.
- MLflow logs to ``log.mlflow_uri``, else ``MLFLOW_TRACKING_URI``; with neither the job is refused
  before it starts rather than writing ``./mlruns`` where it was launched. It is driven through an
  `mlflow.MlflowClient`, so no process-wide active run is set.

Each launch is one tracker run: a resumed job starts a new run named ``<run name> from step-N`` in
the same W&B group / under the same MLflow tag ``harmonia.run``, so no step is logged twice into one
run. A package not installed or a missing MLflow URI is refused before any process starts
(`check_trackers`); a tracker that cannot start stops the job with one line; one that fails later
warns once and is dropped, training goes on (as the other metrics do).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import time
from pathlib import Path

from harmonia.config import Config
from harmonia.errors import ConfigError, HarmoniaError

log = logging.getLogger(__name__)

PACKAGES = {"wandb": ("wandb", "pip install wandb"), "mlflow": ("mlflow", "pip install mlflow-skinny")}
"""Tracker -> (its Python package, how to install it)."""
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on one parameter's value
MLFLOW_BATCH = 100  # parameters per MlflowClient.log_batch call (MLflow's limit; metrics allow 1000)


def enabled_trackers(config: Config) -> list[str]:
    return [name for name in PACKAGES if getattr(config.log, name)]


def check_trackers(config: Config) -> None:
    """Raise ConfigError for a tracker whose package is missing, or MLflow without a tracking URI."""
    for name in enabled_trackers(config):
        package, install = PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"log.{name}=true needs the {package} package, which is not installed here: "
                              f"{install} (or set log.{name}=false)")
    if config.log.mlflow and not mlflow_uri(config):
        raise ConfigError("log.mlflow=true needs a tracking URI: set log.mlflow_uri (a server http://host:5000, or "
                          "sqlite:///path/mlflow.db) or MLFLOW_TRACKING_URI")


def mlflow_uri(config: Config) -> str:
    return config.log.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def run_name(config: Config) -> str:
    return config.log.run_name or Path(config.log.dir).resolve().name


def config_params(config: Config) -> dict[str, object]:
    """The config flattened to ``section.field`` -> value (lists and dicts as JSON)."""
    out = {}
    for section, values in dataclasses.asdict(config).items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            name = f"{section}.{key}" if key else section
            out[name] = value if isinstance(value, (str, int, float, bool)) or value is None else json.dumps(value)
    return out


class WandbTracker:
    """One W&B run; ``dir`` is ``log.dir`` (offline runs land in ``<log.dir>/wandb``)."""

    name = "Weights & Biases"

    def __init__(self, config: Config, start_step: int) -> None:
        import wandb

        name = run_name(config)
        self.run = wandb.init(project=config.log.project, name=_launch_name(name, start_step), group=name,
                              dir=config.log.dir, config=config_params(config), job_type="train",
                              tags=[f"from-step-{start_step}"] if start_step else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """One MLflow run in experiment ``log.project``, through a client (no active-run global)."""

    name = "MLflow"

    def __init__(self, config: Config, start_step: int) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=mlflow_uri(config))
        experiment = self.client.get_experiment_by_name(config.log.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(config.log.project))
        name = run_name(config)
        tags = {"harmonia.run": name, **({"harmonia.from_step": str(start_step)} if start_step else {})}
        self.run_id = self.client.create_run(experiment_id, run_name=_launch_name(name, start_step),
                                             tags=tags).info.run_id
        params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in config_params(config).items()]
        for i in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_BATCH])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def _launch_name(name: str, start_step: int) -> str:
    return f"{name} from step-{start_step}" if start_step else name


def open_trackers(config: Config, start_step: int) -> list:
    """Start each enabled tracker's run; raise HarmoniaError (one line) for one that cannot start."""
    opened = []
    for key in enabled_trackers(config):
        try:
            opened.append(TRACKERS[key](config, start_step))
        except Exception as err:  # noqa: BLE001 - any tracker failure becomes one line
            for tracker in opened:
                with contextlib.suppress(Exception):
                    tracker.close(True)
            hint = " (WANDB_MODE=offline logs without an account)" if key == "wandb" else ""
            raise HarmoniaError(f"log.{key}: could not start a run: {type(err).__name__}: "
                                f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}{hint}") from None
    return opened

