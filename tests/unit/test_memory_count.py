"""Counting a step's tensor bytes on the CPU: what is held, what operators create, what is freed."""

import torch

from harmonia.runtime.memory_count import TensorBytes


def test_the_count_follows_a_training_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    weights = sum(p.numel() * 4 for p in model.parameters())
    counter = TensorBytes()
    for step in range(2):
        held = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
                *(v for s in opt.state.values() for v in s.values())]
        counter.begin(held)
        assert counter.live == (weights if step == 0 else 4 * weights + 2 * 4)  # + Adam's step counters
        with counter:
            x = torch.randn(64, 256)
            y = torch.relu(model(x))
            assert counter.live > 4 * weights if step else counter.live > weights  # inputs and kept outputs
            y.sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            del x, y
        assert counter.peak >= counter.live + 64 * 128 * 4  # the activations were counted, then freed
    assert counter.live == 4 * weights + 8


def test_a_view_and_an_in_place_op_add_nothing() -> None:
    counter = TensorBytes()
    counter.begin([])
    with counter:
        a = torch.zeros(1000)
        a.add_(1)
        b = a.view(10, 100)[3]
        c = a[:10]
    assert counter.live == counter.peak == 4000
    del a, b, c
    assert counter.live == 0


def test_a_storage_freed_by_resizing_and_gathered_again_is_counted_once_at_its_size() -> None:
    """FSDP2 frees a gathered weight with ``storage.resize_(0)`` and gathers into the same storage again."""
    counter = TensorBytes()
    counter.begin([])
    with counter:
        a = torch.zeros(1000)
        assert counter.live == 4000
        a.untyped_storage().resize_(0)
        assert counter.live == 0
        a.untyped_storage().resize_(4000)
        a.copy_(torch.ones(1000))  # the ones: 4000 more until freed
        assert counter.live == 4000 and counter.peak == 8000
        a.untyped_storage().resize_(0)
    assert counter.live == 0 and torch.UntypedStorage.resize_.__name__ == "resize_"
