"""Tiny HF tokenizers with chat templates, built offline for tests.

`write_chat_tokenizer(dir, template)` trains a byte-level BPE with the ``tokenizers`` library on a
few sentences, adds the special tokens of every template below plus ``<image>``, ``<video>`` and
``<audio>``, wraps it as a ``PreTrainedTokenizerFast`` with the chat template, and saves it with a
``config.json`` holding ``image_token_index`` (and the video / audio ones), as a checkpoint does.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5 style: a default system prompt when the conversation has none.
QWEN = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    + CHATML
)
# Llama-3 style: bos, role headers, trimmed content, <|eot_id|> (and a tokenizer that adds bos itself).
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# ChatML with {% generation %} blocks around what the assistant says.
GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A processor's template (llava-hf style): typed content parts, images rendered by the template.
TYPED = (
    "{% for m in messages %}{{ m['role'].upper() }}: {% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>\n{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% if m['role'] == 'assistant' %}</s>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
)
# Qwen2-VL / Qwen2.5-VL style: typed parts, each image written as <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATES = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3, "generation": GENERATION, "typed": TYPED}
END_OF_TURN = {"chatml": "<|im_end|>", "qwen": "<|im_end|>", "llama3": "<|eot_id|>", "generation": "<|im_end|>",
               "typed": "</s>"}
SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<image>", "<video>", "<audio>"]
CORPUS = [
    "What colour is the square? The square is red.", "How many squares are there? There are two squares.",
    "Describe the picture in detail.", "A cat sits on a mat next to a dog.", "Is the tone low, mid or high?",
    "You are a helpful assistant.", "user assistant system", "Which way does the dot move? Left.",
]


def build_chat_tokenizer(template: str = "chatml", vocab_size: int = 400, extra_specials: tuple[str, ...] = ()):
    """A ``PreTrainedTokenizerFast`` with one of `TEMPLATES` (by name) or a template string (None: none),
    and ``extra_specials`` after the usual special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + list(extra_specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    llama = template == "llama3"
    bos = "<|begin_of_text|>" if llama else "<s>"
    if llama:  # Llama-3's tokenizer prepends bos itself; the processor must not add a second one
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    if template is not None:
        fast.chat_template = TEMPLATES.get(template, template)
    return fast


def write_chat_tokenizer(out: Path, template: str | None = "chatml", item_tokens: bool = True) -> Path:
    """Save `build_chat_tokenizer` to ``out`` with a ``config.json`` naming the item token ids."""
    fast = build_chat_tokenizer(template)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    config = {"model_type": "llava"}
    if item_tokens:
        config.update({f"{m}_token_index": fast.convert_tokens_to_ids(f"<{m}>") for m in ("image", "video", "audio")})
    (out / "config.json").write_text(json.dumps(config))
    return out
