"""An LLM with multimodal RoPE (Qwen2.5-VL's and Qwen3-VL's text model) computes transformers' logits,
with each packed sample's three rotary rows restarting at its own start (context parallelism:
`tests/distributed/test_mrope_cp.py`)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harmonia.errors import ConfigError, SampleError  # noqa: E402
from harmonia.model.batch import TokenizedSample, pack_samples  # noqa: E402
from harmonia.model.hf.llama import llm_state_from_hf  # noqa: E402
from harmonia.model.llm import DecoderLM  # noqa: E402
from harmonia.model.mrope import rope_index  # noqa: E402
from harmonia.model.spec import LLMSpec, TransformerSpec  # noqa: E402

HIDDEN, HEADS, KV, LAYERS, VOCAB = 64, 4, 2, 2, 300
SECTION = (2, 3, 3)  # head_dim 16: 8 frequencies
SEGMENTS = [  # two samples: text, a 4x6 image grid and a 2-frame video (Qwen2.5-VL), text
    [("text", 3), ("image", (1, 4, 6)), ("text", 2)],
    [("text", 2), ("video", (2, 4, 4), 0.5), ("text", 4), ("image", (1, 6, 2)), ("text", 1)],
]


def hf_model(variant: str):
    torch.manual_seed(0)
    text = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=LAYERS,
                intermediate_size=96, vocab_size=VOCAB, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(SECTION),
                                 **({"mrope_interleaved": True} if variant == "qwen3_vl" else {})})
    vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=HIDDEN, intermediate_size=32)
    if variant == "qwen3_vl":
        text.update(head_dim=HIDDEN // HEADS)
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision)
        model = transformers.Qwen3VLForConditionalGeneration(config)
    else:
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def our_llm(model, variant: str) -> DecoderLM:
    qwen3 = variant == "qwen3_vl"
    body = TransformerSpec(LAYERS, HIDDEN, HEADS, 96, KV, mlp="swiglu", norm="rmsnorm", qkv_bias=not qwen3,
                           out_bias=False, mlp_bias=False, qk_norm=qwen3, qk_norm_per_head=qwen3)
    spec = LLMSpec("qwen-vl-text", body, VOCAB, tie_embeddings=False, mrope_section=SECTION, mrope_interleaved=qwen3)
    llm = DecoderLM(spec).eval()
    state = {k: v for k, v in model.state_dict().items() if ".visual." not in k and not k.startswith("visual.")}
    llm.load_state_dict(llm_state_from_hf(state, spec), strict=True)
    return llm


def samples(variant: str) -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, segments in enumerate(SEGMENTS):
        segs = [s if variant != "qwen3_vl" or s[0] != "video" else ("image", (1, *s[1][1:])) for s in segments]
        positions = rope_index(segs, 2, variant, tokens_per_second=2.0)  # (3, T)
        n = positions.shape[1]
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        out.append(TokenizedSample(ids, torch.roll(ids, -1), [("text", n)], sample_id=i, rope_positions=positions))
    return out


@pytest.mark.parametrize("variant", ["qwen2_5_vl", "qwen3_vl"])
def test_packed_samples_give_each_sample_transformers_logits(variant) -> None:
    model = hf_model(variant)
    llm = our_llm(model, variant)
    batch = pack_samples(samples(variant))
    assert batch.positions().shape == (3, 1, batch.n_tokens)
    with torch.no_grad():
        ours = llm(batch.input_ids, batch.positions(), batch.attention("segments"))[0]  # (T, V)
        start = 0
        for s in samples(variant):
            n = len(s)
            want = model(input_ids=s.input_ids[None], position_ids=s.rope_positions[:, None]).logits[0]
            torch.testing.assert_close(ours[start:start + n], want, atol=1e-5, rtol=1e-5)
            start += n
        plain = llm(batch.input_ids, batch.layout.position[None].expand(3, 1, -1), batch.attention("segments"))[0]
    assert not torch.allclose(plain, ours, atol=1e-3)  # the three rows matter: text-only positions differ


def test_bad_multimodal_rope_inputs_are_refused() -> None:
    body = TransformerSpec(LAYERS, HIDDEN, HEADS, 96, KV)
    with pytest.raises(ConfigError, match="mrope_section"):
        LLMSpec("x", body, VOCAB, mrope_section=(2, 3, 4))
    ids = torch.zeros(4, dtype=torch.long)
    with pytest.raises(SampleError, match=r"expected \(3, 4\)"):
        TokenizedSample(ids, ids, [("text", 4)], rope_positions=torch.zeros(3, 5, dtype=torch.long))
    a = TokenizedSample(ids, ids, [("text", 4)], rope_positions=torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(SampleError, match="with and without multimodal rotary positions"):
        pack_samples([a, TokenizedSample(ids, ids, [("text", 4)])])
