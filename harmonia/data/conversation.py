"""The one conversation form every dataset format is normalised to.

A `Conversation` is a list of `Turn`s (``system``, ``user``, ``assistant``), each an ordered list of
text runs and `MediaRef`s (an image, a video or an audio clip named by a path inside its source).
Formats differ only in how they spell this; tokenizers render it (harmonia.data.tokenizer,
harmonia.data.chat) and `harmonia.data.samples` turns it into a sample.

Placeholders: ``<image>``, ``<video>`` and ``<audio>`` in a turn's text mark where its media go;
`place_media` splits text at them and consumes the media given for the record, in order, and
raises ``placeholder_mismatch`` when the count of tags of a modality differs from its media.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from harmonia.data.records import DataError, MediaSource

ROLES = ("system", "user", "assistant")
MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in MARKERS.values()) + ")")
_KIND_OF_MARKER = {m: k for k, m in MARKERS.items()}


@dataclass(frozen=True)
class MediaRef:
    """One modality item of a record.

    Attributes:
        modality: ``image``, ``video`` or ``audio``.
        path: the file, relative to its source's media root (a member name in a tar shard); None for
            a video given as ``frames``.
        frames: a video given as image files, in order.
        declared: sizes the record states (``height``/``width`` of an image, ``seconds`` of audio),
            used for shapes without reading the file and checked when it is decoded.
    """

    modality: str
    path: str | None = None
    frames: tuple[str, ...] | None = None
    declared: tuple[tuple[str, float], ...] = ()

    @property
    def name(self) -> str:
        return self.path if self.path is not None else f"{len(self.frames or ())} frames from {self.frames[0]}"


@dataclass
class Turn:
    """One message: its role, its text runs and media in order, and whether an assistant turn is learned
    (a record may exclude some turns from the loss: ms-swift's ``loss``, axolotl's ``weight``)."""

    role: str
    parts: list[str | MediaRef] = field(default_factory=list)
    learn: bool = True

    def text(self) -> str:
        """The turn's text with media left out."""
        return "".join(p for p in self.parts if isinstance(p, str))


@dataclass
class Conversation:
    """A normalised record: turns, where it came from, and its media source.

    Attributes:
        turns: system (optional, first), then user / assistant messages.
        where: ``file:line``, ``file[index]`` or ``shard:key``, for messages.
        source: where its media paths are read from.
        id: the record's own id, or None.
        task: the synthetic dataset's task name, or None.
    """

    turns: list[Turn]
    where: str
    source: MediaSource
    id: str | int | None = None
    task: str | None = None

    def media(self) -> list[MediaRef]:
        """Every media item in sequence order."""
        return [p for t in self.turns for p in t.parts if isinstance(p, MediaRef)]

    def answer(self) -> str:
        """Text of the last assistant turn (what held-out evaluation compares)."""
        return next((t.text() for t in reversed(self.turns) if t.role == "assistant"), "")


def place_media(turns: list[list[str | MediaRef]], media: dict[str, list[MediaRef]],
                where: str) -> list[list[str | MediaRef]]:
    """Split each turn's text at its placeholders and put the next item of that modality in each place.

    Args:
        turns: each turn's parts in order; text is split at tags, `MediaRef` parts are kept as they are.
        media: modality -> its items in order (each list is consumed by that modality's tags).
        where: record location for errors.

    Returns:
        The parts of each turn with tags replaced by items.

    Raises:
        DataError: ``placeholder_mismatch`` when a modality has more or fewer tags than items.
    """
    queues = {k: list(v) for k, v in media.items()}
    tags = dict.fromkeys(MARKERS, 0)
    out = []
    for turn in turns:
        parts: list[str | MediaRef] = []
        for part in turn:
            if isinstance(part, MediaRef):
                parts.append(part)
                continue
            for piece in _MARKER_RE.split(part):
                kind = _KIND_OF_MARKER.get(piece)
                if kind is None:
                    if piece:
                        parts.append(piece)
                    continue
                tags[kind] += 1
                if queues.get(kind):
                    parts.append(queues[kind].pop(0))
        out.append(parts)
    for kind in MARKERS:
        given = len(media.get(kind, ()))
        if tags[kind] != given:
            raise DataError("placeholder_mismatch", where,
                            f"{tags[kind]} {MARKERS[kind]} tag(s) in the text but {given} {kind}(s) given; "
                            f"put one {MARKERS[kind]} where each {kind} goes")
    return out
