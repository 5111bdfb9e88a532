"""A tiny random-weight HF LLaVA checkpoint, made offline: model, tokenizer, chat template, processor.

It is a real ``LlavaForConditionalGeneration`` directory (CLIP or SigLIP vision tower, Llama or
Qwen2 text model, ``vision_feature_layer=-2``), so it exercises the whole real-model path
(`harmonia plan` -> `harmonia train` -> `harmonia export` -> transformers) on a laptop CPU. The
tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the synthetic dataset's
questions and answers, wrapped as a ``PreTrainedTokenizerFast`` with a ChatML chat template and the
``<image>`` token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from harmonia.errors import ConfigError

IMAGE_TOKEN = "<image>"
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """Text the tokenizer is trained on: the synthetic tasks' questions, answers and digits."""
    from harmonia.data.synth import TASK_ANSWERS

    lines = ["What colour is the square?", "How many squares?", "Is the tone low, mid or high?",
             "Which way does the dot move?", "user", "assistant", "system"]
    lines += [f"What is {a}+{b}?" for a in range(10) for b in range(10)]
    lines += [a for answers in TASK_ANSWERS.values() for a in answers]
    return lines * 4


def build_tokenizer(vocab_size: int = 320, specials: list[str] = SPECIALS, template: str = CHAT_TEMPLATE,
                    image_token: str = IMAGE_TOKEN):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with a ChatML template (``template``) and its
    ``specials`` (LLaVA's: ``<image>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   bos_token=None, extra_special_tokens={"image_token": image_token})
    fast.chat_template = template
    return fast


def write_tiny_llava(out: str | Path, vision: str = "clip", text: str = "llama", seed: int = 0,
                     image_size: int = 32, patch_size: int = 8) -> Path:
    """Write a tiny random-weight LLaVA checkpoint with tokenizer and processor to ``out``.

    Args:
        out: a new or empty directory.
        vision: ``clip`` or ``siglip`` vision tower.
        text: ``llama`` or ``qwen2`` text model.
        seed: weight seed.
        image_size: the vision tower's input size (one tile per image, LLaVA-1.5 style).
        patch_size: its patch size.
    """
    import torch
    import transformers as tf

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty; pass a new directory for the checkpoint")
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    vis_kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  image_size=image_size, patch_size=patch_size)
    if vision == "clip":
        vision_config = tf.CLIPVisionConfig(projection_dim=32, **vis_kw)
        processor = tf.CLIPImageProcessor(size={"shortest_edge": image_size},
                                          crop_size={"height": image_size, "width": image_size})
    elif vision == "siglip":
        vision_config = tf.SiglipVisionConfig(**vis_kw)
        processor = tf.SiglipImageProcessor(size={"height": image_size, "width": image_size})
    else:
        raise ConfigError(f"vision={vision!r}: expected clip or siglip")
    txt_kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if text == "llama":
        text_config = tf.LlamaConfig(**txt_kw)
    elif text == "qwen2":
        text_config = tf.Qwen2Config(**txt_kw)
    else:
        raise ConfigError(f"text={text!r}: expected llama or qwen2")
    config = tf.LlavaConfig(vision_config=vision_config, text_config=text_config,
                            image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                            vision_feature_layer=-2,
                            vision_feature_select_strategy="default" if vision == "clip" else "full")
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    llava_processor = tf.LlavaProcessor(image_processor=processor, tokenizer=tokenizer, patch_size=patch_size,
                                        vision_feature_select_strategy=config.vision_feature_select_strategy,
                                        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
                                        num_additional_image_tokens=1 if vision == "clip" else 0)
    llava_processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """``harmonia hf tiny-llava OUT [--vision clip|siglip] [--text llama|qwen2] [--seed S]``."""
    p = argparse.ArgumentParser(prog="harmonia hf tiny-llava", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="a new directory for the checkpoint")
    p.add_argument("--vision", default="clip", choices=("clip", "siglip"))
    p.add_argument("--text", default="llama", choices=("llama", "qwen2"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote a tiny LLaVA ({a.vision} + {a.text}) to {write_tiny_llava(a.out, a.vision, a.text, a.seed)}")


if __name__ == "__main__":
    main()
