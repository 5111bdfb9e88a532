"""Activation recomputation: the blocks run their forward again in backward, with the same gradients."""

import torch

from harmonia.model.llm import build_llm
from harmonia.model.presets import mllm_preset
from harmonia.runtime.parallelize import apply_recompute


def _grads(recompute: bool) -> tuple[dict[str, torch.Tensor], int]:
    spec = mllm_preset("tiny-omni").llm
    torch.manual_seed(0)
    model = build_llm(spec)
    calls = []
    for block in model.layers.values():
        block.attn.register_forward_hook(lambda *_: calls.append(1))
    if recompute:
        assert apply_recompute(model) == spec.body.n_layers
    ids = torch.randint(0, spec.vocab_size, (1, 9))
    positions = torch.arange(9)[None]
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    model(ids, positions, mask).logsumexp(-1).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(calls)


def test_recomputed_blocks_run_twice_and_give_the_same_gradients() -> None:
    plain, plain_calls = _grads(False)
    again, again_calls = _grads(True)
    assert again_calls == 2 * plain_calls
    for name, grad in plain.items():
        torch.testing.assert_close(again[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_share_recomputes_the_first_blocks_of_the_stage() -> None:
    spec = mllm_preset("tiny-omni").llm
    n = spec.body.n_layers
    for share, expected in ((0.25, -(-n // 4)), (0.5, -(-n // 2)), (1.0, n), (0.0, 0)):
        model = build_llm(spec)
        assert apply_recompute(model, share) == expected
        flags = [block.recompute for block in model.layers.values()]
        assert flags == [True] * expected + [False] * (n - expected)  # the first blocks of the stage
