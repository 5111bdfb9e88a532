"""Shared test fixtures."""

from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """The real traces beside the checkout (CI has ../shared)."""
    if not (SHARED_TRACES / "ai2d.csv").is_file():
        pytest.fail(f"real traces not found at {SHARED_TRACES}; clone the project beside shared/")
    return SHARED_TRACES
