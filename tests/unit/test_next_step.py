"""`NextStep`: a step prepared during the one before, its error raised at its own start, and the
agreement it owes joined even when its preparation failed."""

import pytest
import torch

from harmonia.train.next_step import NextStep
from harmonia.train.rank_data import StepAgreement


class _Builder:
    def __init__(self):
        self.settled = []

    def settle(self, it, stop, row, extra):
        self.settled.append((it, stop, row, extra))
        it.summed = extra * 2  # what two ranks with the same values would sum
        return it


class _Prepared:
    summed = None


def test_a_prepared_step_is_settled_with_the_extra_values() -> None:
    prepared, builder = _Prepared(), _Builder()
    nxt = NextStep(lambda step: prepared if step == 5 else None, 5)
    nxt.prepare()
    extra = torch.tensor([0.5, 4.0], dtype=torch.float64)
    summed = nxt.agree(builder, lambda *a: pytest.fail("the builder settles it"), 15, extra)
    assert torch.equal(summed, torch.tensor([1.0, 8.0], dtype=torch.float64))
    assert builder.settled == [(prepared, 15, None, extra)] and nxt.settled
    assert nxt.take() is prepared and nxt.prepare_s >= 0.0


def test_a_failed_preparation_still_joins_its_agreement_and_raises_at_its_step() -> None:
    def get(step):
        raise ValueError(f"step {step}: only 3 of 8 samples usable")

    nxt = NextStep(get, 2)
    nxt.prepare()  # kept, not raised: the step before still has its optimizer step to take
    calls = []
    extra = torch.tensor([1.0, 2.0], dtype=torch.float64)
    summed = nxt.agree(_Builder(), lambda *a: calls.append(a) or StepAgreement([], {}, None, a[3] + 1), 0, extra)
    assert calls == [([], 0, None, extra)] and torch.equal(summed, extra + 1) and not nxt.settled
    with pytest.raises(ValueError, match="step 2: only 3 of 8"):
        nxt.take()
