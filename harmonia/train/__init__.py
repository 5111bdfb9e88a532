# The trainer: plan, data, launch, per-rank loop, checkpoints, reports (`harmonia train`).
from harmonia.train.job import TrainResult, run_training
from harmonia.train.loop import Trainer, TrainingError
from harmonia.train.worker import train_worker

__all__ = ["TrainResult", "Trainer", "TrainingError", "run_training", "train_worker"]
