"""Rendered token counts of a dataset's conversations, cached beside its shape index.

Rendering a conversation with a chat template costs about a millisecond, so the shape pass of a
large dataset spends most of its time there. The scheduler needs only what `harmonia.data.samples.
Rendered` keeps (sequence length, item runs, learned-token count), and that depends only on the
conversation, its items' LLM token counts and the renderer. `TokenCountCache` keys each entry by a
digest of exactly these (the conversation's turns and the item lengths), in a file keyed by the
renderer's identity (`renderer_identity`: the tokenizer files and the chat template in use), so a
second epoch, a resume or a rank's own shape pass reads the counts instead of rendering, and an
edited record, a changed tokenizer or a model with other item token counts renders again.
Failing to write the file only logs a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harmonia.data.conversation import Conversation
from harmonia.data.tokenizer import ByteTokenizer, Encoded, Tokenizer

log = logging.getLogger(__name__)
CACHE_VERSION = 2


@dataclass(frozen=True)
class Rendered:
    """What the scheduler needs of a conversation's rendering, without the token ids.

    Attributes:
        n_ids: tokens of the rendered sequence, item runs included.
        items: ``(start, length)`` of each media item's run, in sequence order.
        n_targets: tokens with a next-token label (``labels != -100``): the sample's loss normalizer share.
        learned: whether any token is learned.
        target_runs: ``[start, stop)`` of each run of learned tokens, in order.
    """

    n_ids: int
    items: tuple[tuple[int, int], ...]
    n_targets: int
    learned: bool
    target_runs: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, enc: Encoded) -> Rendered:
        """The rendering summary of an encoded conversation."""
        runs, start = [], None
        for t, learned in enumerate([*enc.targets, False]):
            if learned and start is None:
                start = t
            elif not learned and start is not None:
                runs.append((start, t))
                start = None
        return cls(len(enc.ids), tuple(map(tuple, enc.items)), sum(enc.targets[1:]), any(enc.targets), tuple(runs))

    def cut(self, n: int) -> Rendered:
        """The rendering of the first ``n`` tokens (items that start at ``n`` or later dropped; an item
        running past ``n`` is the caller's to refuse)."""
        if n >= self.n_ids:
            return self
        runs = tuple((a, min(b, n)) for a, b in self.target_runs if a < n)
        targets = sum(min(b, n) - max(a, 1) for a, b in runs if min(b, n) > max(a, 1))
        return Rendered(n, tuple(r for r in self.items if r[0] < n), targets, bool(runs), runs)


def renderer_identity(tokenizer: Tokenizer) -> str | None:
    """A digest of what decides a rendering: the byte tokenizer's version, or an HF tokenizer's files
    (`harmonia.model.resolve.tokenizer_identity`), its chat template and item tokens; None for a
    tokenizer this module does not know (nothing is cached for it)."""
    if type(tokenizer) is ByteTokenizer:
        return "bytes-1"
    from harmonia.data.chat import HFTokenizer
    from harmonia.model.resolve import tokenizer_identity

    if type(tokenizer) is not HFTokenizer:
        return None
    digest = hashlib.sha256()
    for part in (tokenizer_identity(tokenizer.name) or "", tokenizer.template,
                 json.dumps(tokenizer.item_tokens, sort_keys=True)):
        digest.update(part.encode() + b"\0")
    return "hf-" + digest.hexdigest()[:24]


def token_cache_path(shape_cache: str | Path) -> Path:
    """The token-count cache that goes with a shape index cache file."""
    shape_cache = Path(shape_cache)
    return shape_cache.with_name(shape_cache.name.removesuffix(".json") + ".tokens.json")


def record_digest(conv: Conversation, lengths: Sequence[int]) -> str:
    """A digest of what a conversation's rendering depends on: its turns (roles, text, media, learned
    flags) and its items' LLM token counts."""
    text = repr([(t.role, t.learn, t.parts) for t in conv.turns]) + repr(list(lengths))
    return hashlib.sha1(text.encode()).hexdigest()[:20]


class TokenCountCache:
    """Renderings by record digest, read from and written to one JSON file.

    Args:
        path: the cache file (None: kept in memory only).
        identity: `renderer_identity` of the tokenizer; entries of another renderer are ignored.
    """

    def __init__(self, path: str | Path | None, identity: str) -> None:
        self.path, self.identity = (Path(path) if path is not None else None), identity
        self._entries: dict[str, list[int]] = {}
        self._used: set[str] = set()
        self.added = 0
        self.hits = 0
        if self.path is not None:
            self._entries = self._read()

    def _read(self) -> dict[str, list[int]]:
        try:
            payload = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if payload.get("key") != {"version": CACHE_VERSION, "renderer": self.identity}:
            return {}
        return dict(payload.get("records", {}))

    def get(self, conv: Conversation, lengths: Sequence[int]) -> Rendered | None:
        """The cached rendering of ``conv`` with items of ``lengths`` tokens, or None."""
        key = record_digest(conv, lengths)
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._used.add(key)
        self.hits += 1
        n_ids, n_targets, learned, n_items, *runs = entry
        pairs = tuple(zip(runs[::2], runs[1::2]))
        return Rendered(n_ids, pairs[:n_items], n_targets, bool(learned), pairs[n_items:])

    def put(self, conv: Conversation, lengths: Sequence[int], rendered: Rendered) -> None:
        """Remember a rendering."""
        key = record_digest(conv, lengths)
        self._entries[key] = [rendered.n_ids, rendered.n_targets, int(rendered.learned), len(rendered.items),
                              *(x for run in (*rendered.items, *rendered.target_runs) for x in run)]
        self._used.add(key)
        self.added += 1

    def save(self) -> Path | None:
        """Write the entries used since opening (when any was added); returns the file, or None."""
        if self.path is None or not self.added:
            return None
        records = {k: self._entries[k] for k in sorted(self._used)}
        text = json.dumps({"key": {"version": CACHE_VERSION, "renderer": self.identity}, "records": records},
                          separators=(",", ":"))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not cache rendered token counts at %s (%s); they will be rendered again next time",
                        self.path, e)
            return None
        self.added = 0
        return self.path
