"""HF checkpoint adapters against `transformers` models built from tiny configs with random weights."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from harmonia.model.attention_mask import TokenLayout, multimodal_mask
from harmonia.model.hf import (
    load_hf_llm,
    load_hf_siglip,
    load_hf_whisper,
    save_hf_llm,
    save_hf_siglip,
    save_hf_whisper,
)
from harmonia.model.lora import apply_lora
from tests.unit._hf_load import load_cleanly

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _randomize(model: torch.nn.Module) -> None:
    """Non-trivial norms and biases too, so that a swapped or dropped tensor shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 and p.numel() == p.shape[0] else 0.0))


LLM_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True),
}


@pytest.mark.parametrize("family", sorted(LLM_CONFIGS))
def test_llm_matches_transformers_and_round_trips(family, tmp_path):
    config = LLM_CONFIGS[family]()
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_llm(tmp_path / "hf").eval()
    ids = torch.randint(0, config.vocab_size, (1, 11))
    layout = TokenLayout.from_segments([[("text", 11)]])
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids, layout.position[None], multimodal_mask(layout))
    torch.testing.assert_close(got, want, **TOL)
    # Stages built from the same checkpoint compose to the whole model.
    first, last = load_hf_llm(tmp_path / "hf", layers=(0, 1)), load_hf_llm(tmp_path / "hf", layers=(1, config.num_hidden_layers))
    with torch.no_grad():
        args = (layout.position[None], multimodal_mask(layout))
        torch.testing.assert_close(last(first(ids, *args), *args), want, **TOL)
    save_hf_llm(ours, tmp_path / "back")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, **TOL)


def test_saving_merges_lora(tmp_path):
    config = LLM_CONFIGS["llama"]()
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_llm(tmp_path / "hf").eval()
    apply_lora(ours, rank=4)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_b" in n:
                p.normal_(std=0.05)
    ids = torch.randint(0, config.vocab_size, (1, 7))
    layout = TokenLayout.from_segments([[("text", 7)]])
    with torch.no_grad():
        adapted = ours(ids, layout.position[None], multimodal_mask(layout))
    save_hf_llm(ours, tmp_path / "merged")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, adapted, **TOL)


def test_siglip_matches_transformers_and_round_trips(tmp_path):
    config = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=16, patch_size=4)
    hf = transformers.SiglipVisionModel(config).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_siglip(tmp_path / "hf").eval()
    pixels = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        want = hf(pixel_values=pixels).last_hidden_state
        torch.testing.assert_close(ours(pixels), want, **TOL)
    save_hf_siglip(ours, tmp_path / "back")
    again = load_cleanly(transformers.SiglipVisionModel, tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(pixel_values=pixels).last_hidden_state, want, **TOL)


def test_whisper_encoder_matches_transformers_and_round_trips(tmp_path):
    config = transformers.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=48, decoder_ffn_dim=48, num_mel_bins=16, max_source_positions=25, vocab_size=64,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    hf = transformers.WhisperForConditionalGeneration(config).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf_whisper(tmp_path / "hf").eval()
    assert ours.spec.chunk_seconds == pytest.approx(0.5)
    mel = torch.randn(2, 16, 50)
    with torch.no_grad():
        want = hf.get_encoder()(mel).last_hidden_state
        torch.testing.assert_close(ours(mel), want, **TOL)
    save_hf_whisper(ours, tmp_path / "back", source=tmp_path / "hf")
    again = load_cleanly(transformers.WhisperForConditionalGeneration, tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again.get_encoder()(mel).last_hidden_state, want, **TOL)
