"""Under context parallelism each rank's token shard carries all three multimodal rotary rows of its
tokens, and the shards' logits are the whole sequence's (two gloo processes, Qwen2.5-VL's text model)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._spawn import run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


def token_ranks(n: int) -> torch.Tensor:
    """A balanced, scattered assignment: token ``i`` on CP rank ``i % 2``."""
    return torch.arange(n) % 2


def cp_rank_logits(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    from harmonia.model.batch import pack_samples
    from harmonia.runtime.context_parallel import build_cp_shard
    from tests.unit.test_mrope_llm import hf_model, our_llm, samples

    llm = our_llm(hf_model("qwen2_5_vl"), "qwen2_5_vl")
    batch = pack_samples(samples("qwen2_5_vl"))
    shard = build_cp_shard(batch, token_ranks(batch.n_tokens), rank, dist.group.WORLD, world, "segments")
    assert shard.positions.shape == (3, 1, shard.tokens.numel())
    with torch.no_grad():
        logits = llm(batch.input_ids[:, shard.tokens], shard.positions, shard.attention)[0]
    return shard.tokens, logits


def test_cp_shards_give_the_whole_sequence_logits() -> None:
    from harmonia.model.batch import pack_samples
    from tests.unit.test_mrope_llm import hf_model, our_llm, samples

    llm = our_llm(hf_model("qwen2_5_vl"), "qwen2_5_vl")
    batch = pack_samples(samples("qwen2_5_vl"))
    with torch.no_grad():
        whole = llm(batch.input_ids, batch.positions(), batch.attention("segments"))[0]  # (T, V)
    shards = run_workers(cp_rank_logits, 2)
    assert sorted(torch.cat([t for t, _ in shards]).tolist()) == list(range(batch.n_tokens))
    for tokens, logits in shards:
        torch.testing.assert_close(logits, whole[tokens], atol=1e-5, rtol=1e-5)
