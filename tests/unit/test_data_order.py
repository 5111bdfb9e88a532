"""The data order: epoch-wise permutations cut into global batches, and a resumed run's stream
continuing where the checkpoint stopped, whatever its global batch."""

from __future__ import annotations

import pytest

from harmonia.errors import SampleError
from harmonia.train.iteration import DataOrder


def _stream(order: DataOrder, steps: range) -> list[int]:
    return [i for k in steps for i in order.batch(k)]


def test_every_epoch_takes_every_sample_once() -> None:
    order = DataOrder(list(range(10, 22)), 4, seed=3)
    first, second = _stream(order, range(3)), _stream(order, range(3, 6))
    assert sorted(first) == sorted(second) == list(range(10, 22)) and first != second
    assert order.epoch_of(3) == 1.0 and order.position(3) == 12


@pytest.mark.parametrize("before, after", [(4, 8), (8, 4), (4, 6)])
def test_a_resumed_run_continues_the_stream_whatever_its_batch(before, after) -> None:
    """Steps 0-4 at one global batch, then 5 more at another from the checkpoint's position: the samples
    are the uninterrupted stream's, none skipped, none repeated."""
    indices = list(range(30))
    ran = DataOrder(indices, before, seed=1)
    resumed = DataOrder(indices, after, seed=1)
    resumed.resume_at(5, ran.position(5))
    assert resumed.position(5) == 5 * before and resumed.epoch_of(5) == 5 * before / 30
    whole = _stream(DataOrder(indices, 1, seed=1), range(5 * before + 5 * after))
    assert _stream(ran, range(5)) + _stream(resumed, range(5, 10)) == whole


def test_fewer_samples_than_a_batch_are_refused() -> None:
    with pytest.raises(SampleError, match="fewer than train.global_batch=8"):
        DataOrder(list(range(5)), 8, seed=0)
