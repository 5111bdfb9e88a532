"""Background schedule preparation: order, overlap, errors."""

import time

import pytest

from harmonia.schedule.prefetch import SchedulePrefetcher


def test_results_in_order_and_hidden_behind_work() -> None:
    def prepare(step):
        time.sleep(0.02)
        return step * step

    with SchedulePrefetcher(prepare, first_step=0, last_step=6) as pre:
        out = []
        for step in range(6):
            out.append(pre.get(step))
            time.sleep(0.04)  # the training step, longer than the preparation
    assert out == [0, 1, 4, 9, 16, 25]
    assert pre.stats.steps == 6 and pre.stats.hidden_frac > 0.6


def test_error_reaches_the_consumer_of_that_step() -> None:
    def prepare(step):
        if step == 2:
            raise RuntimeError("sample 7 is over the token cap")
        return step

    with SchedulePrefetcher(prepare, last_step=4) as pre:
        assert pre.get(0) == 0 and pre.get(1) == 1
        with pytest.raises(RuntimeError, match="token cap"):
            pre.get(2)


def test_steps_must_be_consumed_in_order() -> None:
    with SchedulePrefetcher(lambda s: s, last_step=10) as pre:
        assert pre.get(0) == 0
        with pytest.raises(ValueError, match="in order"):
            pre.get(5)


def test_inline_preparation_runs_in_the_consumers_thread_when_asked() -> None:
    import threading

    seen = []

    def prepare(step):
        seen.append((step, threading.current_thread() is threading.main_thread()))
        if step == 2:
            raise RuntimeError("sample 7 is over the token cap")
        return step * 10

    with SchedulePrefetcher(prepare, last_step=4, background=False) as pre:
        assert seen == []  # nothing prepared before it is asked for
        assert pre.get(0) == 0 and pre.get(1) == 10
        with pytest.raises(RuntimeError, match="token cap"):
            pre.get(2)
        with pytest.raises(ValueError, match="in order"):
            pre.get(5)
    assert seen == [(0, True), (1, True), (2, True)]
    assert pre.stats.steps == 3 and pre.stats.hidden_frac == 0.0
