"""Per-process facts every part of a job agrees on: the process-group backend and the hang timeout."""

from __future__ import annotations

from harmonia.config import Config


def backend_of(config: Config) -> str:
    """The process-group backend: the config's, or nccl where GPUs are visible and gloo elsewhere."""
    import torch

    if config.parallel.backend != "auto":
        return config.parallel.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def hang_timeout(config: Config) -> float:
    """Seconds without a heartbeat after which a rank is hung: ``parallel.hang_timeout_s``, or (auto)
    300 s on GPUs and 60 s on CPU."""
    if config.parallel.hang_timeout_s:
        return config.parallel.hang_timeout_s
    return 300.0 if backend_of(config) == "nccl" else 60.0
