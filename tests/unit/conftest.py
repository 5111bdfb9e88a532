"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group():
    """A gloo process group of this process alone, for code that runs collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
