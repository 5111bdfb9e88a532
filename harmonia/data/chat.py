"""A checkpoint's own tokenizer and chat template, with labels on every assistant turn.

`HFTokenizer.from_pretrained(dir)` loads ``transformers.AutoTokenizer`` from local files only, the
chat template (the tokenizer's, or the checkpoint's ``chat_template.json``, or a file given), and
each modality's item token (``image_token_index`` / ``image_token_id`` of the checkpoint's
``config.json``, likewise ``video_`` and ``audio_``; else the tokenizer's ``image_token``).

Encoding a conversation, as transformers' LLaVA-style processors do:

1. render it with the chat template (``render_jinja_template``, what ``apply_chat_template`` uses),
   each media item written as its item token (in the text, or as a ``{"type": "image"}`` part when
   the template renders typed parts itself);
2. replace the ``k``-th item token by ``n_k`` copies of it (a `harmonia.data.tokenizer.Framed`
   item, a Qwen3-VL video: by each run's text before, copies and text after, as
   ``Qwen3VLProcessor.replace_video_token`` writes it) and tokenise the whole string
   (no special tokens added when the text starts with ``bos``, as ``ProcessorMixin`` does);
3. mark as targets the tokens inside assistant spans: the template's ``{% generation %}`` blocks
   when it has them, else, for each assistant turn ``i``, the characters between the rendering of
   turns ``< i`` with the generation prompt and the rendering of turns ``<= i`` (trailing whitespace
   dropped): the assistant's content and the end-of-turn token(s) the template puts after it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from harmonia.data.conversation import MARKERS, Conversation, MediaRef, Turn
from harmonia.data.records import DataError
from harmonia.data.tokenizer import Encoded, Framed, ItemTokens, Tokenizer, runs_of
from harmonia.errors import ConfigError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _read_template(path: Path) -> str:
    if path.suffix == ".json":
        return json.loads(path.read_text())["chat_template"]
    return path.read_text()


def _checkpoint_template(path: Path, hf) -> str | None:
    """The tokenizer's template, else the processor's (``chat_template.json`` / ``.jinja``)."""
    if isinstance(hf.chat_template, str):
        return hf.chat_template
    for name in ("chat_template.jinja", "chat_template.json"):
        if (path / name).is_file():
            return _read_template(path / name)
    return None


def _item_tokens(path: Path, hf) -> dict[str, str]:
    """Item token string per modality from ``config.json``, else the tokenizer's ``<m>_token``."""
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    out = {}
    for m in MARKERS:
        idx = config.get(f"{m}_token_index", config.get(f"{m}_token_id"))
        if isinstance(idx, int):
            out[m] = hf.convert_ids_to_tokens(idx)
        elif isinstance(getattr(hf, f"{m}_token", None), str):
            out[m] = getattr(hf, f"{m}_token")
    return out


class HFTokenizer(Tokenizer):
    """A transformers tokenizer with a chat template behind harmonia's `Tokenizer` interface.

    Args:
        hf: a ``PreTrainedTokenizerBase`` (a fast tokenizer: offsets are needed).
        chat_template: the Jinja chat template.
        item_tokens: modality -> its item token string (one token of the vocabulary).
        name: where it came from, for messages.
    """

    def __init__(self, hf, chat_template: str, item_tokens: dict[str, str], name: str = "tokenizer") -> None:
        if not getattr(hf, "is_fast", False):
            raise ConfigError(f"{name}: a fast tokenizer (tokenizer.json) is needed for character offsets")
        self.hf, self.template, self.name = hf, chat_template, name
        self.item_token_ids: dict[str, int] = {}
        for m, tok in item_tokens.items():
            ids = hf.encode(tok, add_special_tokens=False)
            if len(ids) != 1:
                raise ConfigError(f"{name}: the {m} token {tok!r} is not one token of the vocabulary ({ids}); "
                                  "add it as a special token")
            self.item_token_ids[m] = ids[0]
        self.item_tokens = dict(item_tokens)
        self._item_re = re.compile("|".join(re.escape(t) for t in sorted(set(item_tokens.values()), key=len,
                                                                           reverse=True))) if item_tokens else None
        self._generation = bool(_GENERATION.search(chat_template))
        self.vocab_size = len(hf)
        self._specials = dict(hf.special_tokens_map)
        self.typed_parts = self._renders_typed_parts()
        self._check_template()

    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | Path | None = None) -> HFTokenizer:
        """Load from a local checkpoint directory (offline).

        Args:
            path: directory with the tokenizer files (and ``config.json`` for item token ids).
            chat_template: a ``.jinja`` / ``.json`` template file replacing the checkpoint's.
        """
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise ConfigError(f"cannot load a tokenizer from {path}: {type(e).__name__}: {e}; give a checkpoint "
                              "directory with tokenizer.json and tokenizer_config.json") from e
        template = _read_template(Path(chat_template)) if chat_template else _checkpoint_template(path, hf)
        if not template:
            raise ConfigError(f"the tokenizer in {path} has no chat template, so conversations cannot be rendered "
                              "the way the model was trained; use a checkpoint with a chat_template, or set "
                              "data.chat_template = FILE (a .jinja template)")
        return cls(hf, template, _item_tokens(path, hf), str(path))

    def encode_text(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    # rendering -------------------------------------------------------------------------------

    def _message(self, turn: Turn, where: str) -> dict:
        if not self.typed_parts:
            return {"role": turn.role, "content": "".join(p if isinstance(p, str) else self._token_of(p, where)
                                                          for p in turn.parts)}
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": p.modality} for p in turn.parts]
        for p in turn.parts:
            if isinstance(p, MediaRef):
                self._token_of(p, where)
        return {"role": turn.role, "content": content}

    def _token_of(self, ref: MediaRef, where: str) -> str:
        if ref.modality not in self.item_tokens:
            raise DataError("unknown_modality", where, f"{self.name} has no {ref.modality} token (no "
                            f"{ref.modality}_token_index in config.json); the model cannot take {ref.modality} items")
        return self.item_tokens[ref.modality]

    def _render(self, messages: list[dict], generation_prompt: bool = False, spans: bool = False):
        from transformers.utils.chat_template_utils import render_jinja_template

        prompts, indices = render_jinja_template(
            conversations=[messages], chat_template=self.template, add_generation_prompt=generation_prompt,
            return_assistant_tokens_mask=spans, **self._specials)
        return (prompts[0], indices[0]) if spans else prompts[0]

    def render(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text (one item token per item) and the character spans of its learned
        assistant turns (content and end-of-turn)."""
        where = conversation.where
        messages = [self._message(t, where) for t in conversation.turns]
        try:
            if self._generation:
                text, spans = self._render(messages, spans=True)
            else:
                text = self._render(messages)
                spans = self._prefix_spans(messages, text, where)
        except DataError:
            raise
        except Exception as e:
            raise DataError("template_error", where, f"the chat template cannot render this conversation: "
                            f"{type(e).__name__}: {e}") from e
        learn = [t.learn for t in conversation.turns if t.role == "assistant"]
        if len(spans) != len(learn):
            raise DataError("template_mismatch", where, f"the chat template marks {len(spans)} assistant spans for "
                            f"{len(learn)} assistant turns; give each assistant turn one {{% generation %}} block")
        return text, [(a, b) for (a, b), keep in zip(spans, learn) if keep]

    def _prefix_spans(self, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], generation_prompt=True)
            upto = self._render(messages[: i + 1])
            if not (text.startswith(before) and text.startswith(upto) and len(before) <= len(upto)):
                raise DataError("template_mismatch", where,
                                f"the chat template renders turns 0..{i} differently inside the whole conversation, "
                                "so assistant spans cannot be found; add {% generation %} blocks around assistant "
                                "content in the template (data.chat_template = FILE)")
            spans.append((len(before), len(upto.rstrip())))
        return spans

    # tokenising ------------------------------------------------------------------------------

    def encode_conversation(self, conversation: Conversation, item_tokens: list[ItemTokens]) -> Encoded:
        where = conversation.where
        text, spans = self.render(conversation)
        media = conversation.media()
        found = list(self._item_re.finditer(text)) if self._item_re else []
        if [self._modality_of(m.group()) for m in found] != [r.modality for r in media]:
            raise DataError("placeholder_mismatch", where,
                            f"the chat template rendered {len(found)} item token(s) for {len(media)} media item(s); "
                            "a text that writes an item token itself, or a template that drops media")
        pieces, shifts, pos = [], [], 0
        for m, n in zip(found, item_tokens):
            written = _written(m.group(), n)
            pieces += [text[pos:m.start()], written]
            shifts.append((m.end(), len(written) - len(m.group())))
            pos = m.end()
        expanded = "".join(pieces) + text[pos:]
        spans = [(_shift(a, shifts), _shift(b, shifts)) for a, b in spans]
        bos = self.hf.bos_token
        enc = self.hf(expanded, add_special_tokens=not (bos and expanded.startswith(bos)),
                      return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        starts, ends = np.array(offsets, dtype=np.int64).reshape(-1, 2).T  # (T,) each
        learned = np.zeros(len(ids), dtype=bool)
        for a, b in spans:  # a token is learned when it overlaps an assistant span
            learned |= (starts < b) & (ends > a)
        targets = learned.tolist()
        items = self._item_runs(ids, media, item_tokens, where)
        for start, n in items:
            targets[start:start + n] = [False] * n
        return Encoded(list(ids), targets, items)

    def _modality_of(self, token: str) -> str:
        return next(m for m, t in self.item_tokens.items() if t == token)

    def _item_runs(self, ids: list[int], media: list[MediaRef], item_tokens: list[ItemTokens],
                   where: str) -> list[tuple[int, int]]:
        """Where each item's runs of tokens landed; raises unless they are exactly where expected."""
        item_ids = set(self.item_token_ids.values())
        modalities = [r.modality for r, x in zip(media, item_tokens)
                      for _ in (x.runs if isinstance(x, Framed) else (x,))]
        lengths = runs_of(item_tokens)
        runs, t, k = [], 0, 0
        while t < len(ids):
            if ids[t] not in item_ids:
                t += 1
                continue
            if k == len(lengths):
                raise DataError("placeholder_mismatch", where, "more item tokens than media items after tokenising")
            want, n = self.item_token_ids[modalities[k]], lengths[k]
            if ids[t:t + n] != [want] * n:
                raise DataError("placeholder_mismatch", where, f"item run {k} ({modalities[k]}) does not tokenise "
                                f"to {n} copies of token {want}")
            runs.append((t, n))
            t, k = t + n, k + 1
        if k != len(lengths):
            raise DataError("placeholder_mismatch", where, f"{k} item runs after tokenising, {len(lengths)} expected "
                            f"of {len(media)} media items")
        return runs

    # checks at load time ---------------------------------------------------------------------

    def _renders_typed_parts(self) -> bool:
        """Whether the template renders ``{"type": "image"}`` parts itself (a processor's template)."""
        image = self.item_tokens.get("image")
        if image is None:
            return False
        probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Probe"}]},
                 {"role": "assistant", "content": [{"type": "text", "text": "Answer"}]}]
        try:
            text = self._render(probe)
        except Exception:
            return False
        return text.count(image) == 1 and "Probe" in text and "Answer" in text and "'type'" not in text

    def _check_template(self) -> None:
        probe = Conversation([Turn("user", ["Probe question"]), Turn("assistant", ["Probe answer"]),
                              Turn("user", ["Second question"]), Turn("assistant", ["Second answer"])],
                             "chat template probe", None)
        try:
            text, spans = self.render(probe)
        except DataError as e:
            raise ConfigError(f"{self.name}: {e}") from e
        learned = "".join(text[a:b] for a, b in spans)
        if len(spans) != 2 or "Probe answer" not in learned or "Second answer" not in learned or "Probe question" in learned:
            raise ConfigError(f"{self.name}: the chat template's assistant spans {spans} do not cover the assistant "
                              "turns of a probe conversation; fix the template's {% generation %} blocks")


def _written(token: str, x: ItemTokens) -> str:
    """An item token as the expanded text writes it: ``n`` copies, or each `Framed` run's."""
    if isinstance(x, Framed):
        return "".join(b + token * n + a for n, b, a in zip(x.runs, x.before, x.after))
    return token * x


def _shift(pos: int, shifts: list[tuple[int, int]]) -> int:
    """A character position of the rendered text in the expanded text (item tokens repeated)."""
    return pos + sum(d for end, d in shifts if end <= pos)
