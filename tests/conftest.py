"""Shared test fixtures and the hypothesis profiles.

CI runs hypothesis derandomized (the ``ci`` profile: a fixed seed, no example database), so a run is
repeatable; ``make test-random`` (``HYPOTHESIS_PROFILE=random``) explores with fresh seeds.
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("random", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The real traces beside the checkout (CI has ../shared)."""
    if not (SHARED_TRACES / "ai2d.csv").is_file():
        pytest.fail(f"real traces not found at {SHARED_TRACES}; clone the project beside shared/")
    return SHARED_TRACES


@pytest.fixture(scope="module")
def equal_image_samples():
    """internvl-8b on H100, one image sample repeated 64 times and its profile in batches of 16:
    every microbatch alike, so memory estimates are exact in microbatches."""
    from harmonia.model.presets import mllm_preset
    from harmonia.plan.profiling import profile_batches
    from harmonia.workload.cost import CostModel
    from harmonia.workload.devices import device_preset
    from harmonia.workload.traces import synthesize_trace

    cost = CostModel(mllm_preset("internvl-8b"), device_preset("h100"))
    samples = [synthesize_trace(1, {"image": 1.0}, seed=3)[0]] * 64
    return cost, samples, profile_batches(samples, cost, 16, 1)
