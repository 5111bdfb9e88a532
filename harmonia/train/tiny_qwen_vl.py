"""A tiny random-weight HF Qwen2-VL / Qwen2.5-VL checkpoint, made offline: model, tokenizer, chat
template and image processor.

It is a real ``Qwen2_5_VLForConditionalGeneration`` (or ``Qwen2VLForConditionalGeneration``)
directory, so it exercises the whole real-model path (`harmonia plan` -> `harmonia train` ->
`harmonia export` -> transformers) on a laptop CPU: the native-resolution tower with windows, its
merger, multimodal RoPE. The tokenizer is `harmonia.train.tiny_llava`'s byte-level BPE with Qwen-VL's
special tokens and a ChatML template that writes each image as
``<|vision_start|><|image_pad|><|vision_end|>`` and each video as
``<|vision_start|><|video_pad|><|vision_end|>``, as Qwen-VL's does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harmonia.errors import ConfigError
from harmonia.train.tiny_llava import build_tokenizer

IMAGE_PAD, VIDEO_PAD, START, END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", START, END, IMAGE_PAD, VIDEO_PAD]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")


def write_tiny_qwen_vl(out: str | Path, family: str = "qwen2_5_vl", seed: int = 0, patch_size: int = 8,
                       min_pixels: int = 32 * 32, max_pixels: int = 64 * 64) -> Path:
    """Write a tiny random-weight Qwen-VL checkpoint with tokenizer and image processor to ``out``.

    Args:
        out: a new or empty directory.
        family: ``qwen2_5_vl`` (RMSNorm, SwiGLU, window attention), ``qwen2_vl`` or ``qwen3_vl``
            (learned tower positions, DeepStack, interleaved multimodal RoPE).
        seed: weight seed.
        patch_size: the tower's patch side (merge size 2, temporal patch 2).
        min_pixels: the image processor's smallest resized image, in pixels.
        max_pixels: its largest.
    """
    import torch
    import transformers as tf

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty; pass a new directory for the checkpoint")
    if family not in FAMILIES:
        raise ConfigError(f"family={family!r}: expected one of {FAMILIES}")
    tokenizer = build_tokenizer(specials=SPECIALS, template=CHAT_TEMPLATE, image_token=IMAGE_PAD)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VIDEO_PAD, START, END)}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    common = dict(depth=3, num_heads=4, patch_size=patch_size, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        vision = dict(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=4 * patch_size,
                      fullatt_block_indexes=[2], **common)
        config_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl":  # learned positions, DeepStack after the LLM's first 2 blocks, interleaved rows
        vision = dict(hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1], **common)
        text = {**text, "head_dim": 16, "rope_parameters": {**text["rope_parameters"], "mrope_interleaved": True}}
        config_cls, model_cls = tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration
    else:
        vision = dict(embed_dim=32, mlp_ratio=2, hidden_size=64, **common)
        config_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
                        video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[START], vision_end_token_id=ids[END])
    torch.manual_seed(seed)
    model_cls(config).eval().save_pretrained(out)
    processor = tf.Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                             patch_size=patch_size, merge_size=2, temporal_patch_size=2)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """``harmonia hf tiny-qwen-vl OUT [--family qwen2_5_vl|qwen2_vl|qwen3_vl] [--seed S]``."""
    p = argparse.ArgumentParser(prog="harmonia hf tiny-qwen-vl", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="a new directory for the checkpoint")
    p.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote a tiny {a.family} to {write_tiny_qwen_vl(a.out, a.family, a.seed)}")


if __name__ == "__main__":
    main()
