"""Blocks compiled per block (``train.compile``): the same outputs and gradients as eager on CPU, and
microbatches of new lengths run without recompiling."""

import dataclasses

import pytest
import torch

from harmonia.config import load_config
from harmonia.errors import ConfigError
from harmonia.model.attention import PackedAttention
from harmonia.model.attention_mask import TokenLayout
from harmonia.model.llm import build_llm
from harmonia.model.presets import mllm_preset
from harmonia.runtime.parallelize import apply_compile


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_do_not_recompile_as_lengths_change() -> None:
    import torch._dynamo

    spec = mllm_preset("tiny-omni").llm
    spec = dataclasses.replace(spec, body=dataclasses.replace(spec.body, n_layers=1))
    torch.manual_seed(0)
    compiled, eager = build_llm(spec), build_llm(spec)
    eager.load_state_dict(compiled.state_dict())
    torch._dynamo.reset()
    assert apply_compile(compiled) == 1
    graphs = []
    for T in (37, 53, 91, 160):  # text, a bidirectional item, text: new lengths every step
        layout = TokenLayout.from_segments([[("text", T // 3), ("item", T // 3), ("text", T - 2 * (T // 3))]])
        ids = torch.randint(0, spec.vocab_size, (1, T))
        outs = []
        for model in (compiled, eager):
            y = model(ids, layout.position[None], PackedAttention(layout))
            y.square().mean().backward()
            outs.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad()
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
        for a, b in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == graphs[:1] * 3, graphs  # compiled once, for every length


def test_compile_is_a_known_choice() -> None:
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["--train.compile=yes"])
    assert load_config(None, []).train.compile == "auto"
