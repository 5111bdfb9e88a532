"""The tokenizer interface samples are built with, and the byte tokenizer of the synthetic demo.

A `Tokenizer` turns a `Conversation` into token ids, a target flag per token (the tokens the loss
learns: every assistant turn's content and its end-of-turn tokens) and the run of tokens each
media item occupies (``n`` copies of the item's token, ``n`` from the encoder spec; a `Framed` item,
a Qwen3-VL video, several runs with text around each). Two
implement it: `ByteTokenizer` here (the synthetic demo and CPU tests) and
`harmonia.data.chat.HFTokenizer` (a checkpoint's own tokenizer and chat template).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from harmonia.data.conversation import Conversation, MediaRef


@dataclass(frozen=True)
class Framed:
    """A media item written as several runs of its token, each with its own text before and after
    (a Qwen3-VL video: ``<1.5 seconds><|vision_start|>``, one temporal group's tokens,
    ``<|vision_end|>``; `harmonia.model.video_spec.frame_texts`).

    Attributes:
        runs: tokens of each run.
        before: text before each run.
        after: text after each run.
    """

    runs: tuple[int, ...]
    before: tuple[str, ...]
    after: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.runs or not len(self.runs) == len(self.before) == len(self.after):
            raise ValueError(f"Framed: {len(self.runs)} runs, {len(self.before)} texts before and "
                             f"{len(self.after)} after; expected one of each per run, at least one run")


ItemTokens = int | Framed
"""How one media item is written: ``n`` copies of its token, or `Framed` runs."""


def runs_of(item_tokens: list[ItemTokens]) -> list[int]:
    """The tokens of every run the items are written as, in order."""
    return [n for x in item_tokens for n in (x.runs if isinstance(x, Framed) else (x,))]


@dataclass
class Encoded:
    """A tokenised conversation.

    Attributes:
        ids: ``(T,)`` token ids; an item's run holds its placeholder token.
        targets: ``(T,)`` whether token ``t`` is learned (predicted from position ``t - 1``).
        items: ``(start, length)`` of each media item's run (each `Framed` run), in sequence order.
    """

    ids: list[int]
    targets: list[bool]
    items: list[tuple[int, int]]


class Tokenizer(ABC):
    """What `harmonia.data.samples` needs from a tokenizer."""

    vocab_size: int

    @abstractmethod
    def encode_conversation(self, conversation: Conversation, item_tokens: list[ItemTokens]) -> Encoded:
        """Token ids, targets and item runs of a conversation.

        Args:
            conversation: the normalised record.
            item_tokens: LLM tokens of each media item (or its `Framed` runs), in sequence order.

        Raises:
            DataError: when the conversation cannot be rendered (a named kind).
        """

    @abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text, no special tokens."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens left out."""


class ByteTokenizer(Tokenizer):
    """Bytes as ids; ``pad`` 0, ``bos`` 1, ``eos`` 2, item ``placeholder`` 3 (never produced by text).

    Its rendering: ``bos``, then every turn's text bytes and item runs in order, with ``eos`` after
    each assistant turn; a learned assistant turn's bytes and that ``eos`` are targets. A one-question
    record is ``bos, prompt and items, answer, eos``.
    """

    pad, bos, eos, placeholder = 0, 1, 2, 3
    vocab_size = 256

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        """Same as `encode_text`."""
        return self.encode_text(text)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i > 3).decode("utf-8", errors="replace")

    def encode_conversation(self, conversation: Conversation, item_tokens: list[ItemTokens]) -> Encoded:
        ids, targets, items = [self.bos], [False], []
        lengths = iter(item_tokens)
        for turn in conversation.turns:
            learned = turn.role == "assistant" and turn.learn
            for part in turn.parts:
                if isinstance(part, MediaRef):
                    x = next(lengths)
                    framed = x if isinstance(x, Framed) else Framed((x,), ("",), ("",))
                    for n, before, after in zip(framed.runs, framed.before, framed.after):
                        ids += self.encode_text(before)
                        items.append((len(ids), n))
                        ids += [self.placeholder] * n + self.encode_text(after)
                    targets += [False] * (len(ids) - len(targets))
                else:
                    b = self.encode_text(part)
                    ids += b
                    targets += [learned] * len(b)
            if turn.role == "assistant":
                ids.append(self.eos)
                targets.append(learned)
        return Encoded(ids, targets, items)
