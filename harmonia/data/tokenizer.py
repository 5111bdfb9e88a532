"""A byte-level tokenizer: every UTF-8 byte is a token, control bytes double as special tokens.

Enough for the synthetic dataset and CPU tests with a 256-token vocabulary; a real run swaps in the
LLM's own tokenizer behind the same three methods.
"""

from __future__ import annotations


class ByteTokenizer:
    """Bytes as ids; ``pad`` 0, ``bos`` 1, ``eos`` 2, item ``placeholder`` 3 (never produced by text)."""

    pad, bos, eos, placeholder = 0, 1, 2, 3
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i > 3).decode("utf-8", errors="replace")
