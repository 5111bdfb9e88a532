"""Record schemas users hold, each normalised to a `Conversation`.

- ``harmonia``: ``{"prompt", "answer", "media": [{"type", "path" | "frames", ...}]}`` (the synthetic
  dataset's manifest; a prompt without tags gets its media first).
- ``llava``: ``{"id", "image": str | [str] or "images": [...], "video", "conversations": [{"from":
  "human" | "gpt" | "system", "value": "<image>\\n..."}]}`` (LLaVA, LLaMA-Factory's ShareGPT).
- ``messages``: ``{"messages": [{"role", "content"}], "images", "videos", "audios"}`` (OpenAI style,
  ms-swift, LLaMA-Factory); ``content`` is a string with tags or a list of ``{"type": "text", "text"}``,
  ``{"type": "image" | "video" | "audio"}`` parts (a part may name its own file).
- a caption: a webdataset key's ``.txt`` beside its media (the media, then the caption to learn).

Every assistant turn is learned unless the turn says otherwise (``"loss": false`` as in ms-swift,
``"weight": 0`` as in axolotl's ShareGPT).

``auto`` detects the schema that explains every key of the record (`SCHEMA_KEYS`; metadata such as
``id`` aside): a key no schema reads is never dropped silently. A record of no known schema is a
bad record ``unknown_schema`` (and a source whose first records all are stops the job,
`harmonia.data.sources.read_conversations`); malformed turns are ``bad_turns``; tags that do not match the media given are
``placeholder_mismatch``; a media path outside the media root is ``outside_root``.
"""

from __future__ import annotations

from harmonia.data.conversation import MARKERS, Conversation, MediaRef, Turn, place_media
from harmonia.data.records import DataError, RawRecord

FORMATS = ("auto", "harmonia", "llava", "messages", "webdataset")
SCHEMAS = ("harmonia", "llava", "messages")
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_COLUMNS = {"image": ("images", "image"), "video": ("videos", "video"), "audio": ("audios", "audio")}
_DECLARED = ("height", "width", "seconds")


METADATA_KEYS = frozenset({"id", "task", "source", "dataset", "meta", "metadata"})
"""Keys any record may carry that hold no content to learn from."""
_MEDIA_KEYS = frozenset({"image", "images", "video", "videos", "audio", "audios"})
SCHEMA_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "llava": (frozenset({"conversations"}), frozenset({"conversations", "system"}) | _MEDIA_KEYS),
    "messages": (frozenset({"messages"}), frozenset({"messages", "system"}) | _MEDIA_KEYS),
    "harmonia": (frozenset({"prompt", "answer"}), frozenset({"prompt", "answer", "media"})),
}
"""Per schema: the keys a record must have, and every key the schema reads."""


def explains(schema: str, data: dict) -> bool:
    """Whether ``schema`` reads every key of ``data`` (metadata aside) and finds the ones it needs."""
    needed, read = SCHEMA_KEYS[schema]
    return needed <= data.keys() and data.keys() <= read | METADATA_KEYS


def detect_schema(data: object) -> str | None:
    """The schema of `SCHEMAS` that fully explains a record's keys; None when none does (a record
    with a key no schema reads, such as ``question`` or ``image`` beside ``prompt``, is never guessed)."""
    if not isinstance(data, dict):
        return None
    return next((s for s in SCHEMAS if explains(s, data)), None)


def known_formats() -> str:
    """The schemas and their keys, for messages about records that match none."""
    def one(schema: str) -> str:
        needed, read = SCHEMA_KEYS[schema]
        return f"{schema} ({' + '.join(map(repr, sorted(needed)))}, with {', '.join(sorted(read - needed))})"

    return "; ".join(one(s) for s in SCHEMAS) + f"; any of them may carry {', '.join(sorted(METADATA_KEYS))}"


def _unknown_schema(raw: RawRecord, schema: str) -> DataError:
    if not isinstance(raw.data, dict):
        return DataError("unknown_schema", raw.where, f"record is a JSON {type(raw.data).__name__}, not an object")
    keys = set(raw.data)
    candidates = [schema] if schema != "auto" else [s for s in SCHEMAS if SCHEMA_KEYS[s][0] & keys] or list(SCHEMAS)
    reasons = []
    for s in candidates:
        needed, read = SCHEMA_KEYS[s]
        missing, extra = sorted(needed - keys), sorted(keys - read - METADATA_KEYS)
        parts = ([f"lacks {missing}"] if missing else []) + ([f"has {extra}, which it does not read"] if extra else [])
        reasons.append(f"as {s} it {' and '.join(parts)}")
    return DataError("unknown_schema", raw.where, f"record has keys {sorted(keys)}: {'; '.join(reasons)}. Known "
                     f"formats: {known_formats()}. Convert the records, or choose the format that matches "
                     "(data.format=...)")


def to_conversation(raw: RawRecord, schema: str = "auto") -> Conversation:
    """Normalise one raw record; raises `DataError` of a named kind for an unusable one.

    Args:
        raw: the record as read.
        schema: ``auto`` (detect), or one of `SCHEMAS` to require.
    """
    found = detect_schema(raw.data)
    if raw.caption is not None and (raw.data is None or (found is None and schema == "auto")):
        return _caption(raw)
    want = found if schema == "auto" else schema
    if want is None or not isinstance(raw.data, dict) or not explains(want, raw.data):
        raise _unknown_schema(raw, schema)
    data = raw.data
    if want == "harmonia":
        turns = _harmonia_turns(raw)
    else:
        turns = _chat_turns(raw, "conversations" if want == "llava" else "messages")
    return Conversation(turns, raw.where, raw.source, data.get("id"), data.get("task"))


def _media_ref(raw: RawRecord, modality: str, name: object, **extra) -> MediaRef:
    if not isinstance(name, str):
        raise DataError("bad_media", raw.where, f"{modality} path {name!r} is not a string")
    if name.startswith(("http://", "https://", "data:", "s3://")):
        raise DataError("unsupported_media", raw.where, f"{modality} {name[:60]!r} is not a local file; download "
                        "it and give its path relative to the media root")
    return MediaRef(modality, raw.source.locate(name.removeprefix("file://"), raw.where, raw.key), **extra)


def _columns(raw: RawRecord) -> dict[str, list[MediaRef]]:
    """Media listed beside the turns (``images`` / ``image`` ...), or a shard key's media members."""
    data, out = raw.data, {}
    for modality, keys in _COLUMNS.items():
        present = [k for k in keys if data.get(k) not in (None, [], "")]
        if len(present) > 1:
            raise DataError("bad_media", raw.where, f"both {present[0]!r} and {present[1]!r} are given; keep one")
        if present:
            names = data[present[0]]
            names = names if isinstance(names, list) else [names]
            out[modality] = [_media_ref(raw, modality, n) for n in names]
    if not out and raw.members:
        out = {m: [MediaRef(m, name) for name in names] for m, names in raw.members.items()}
    return out


def _content_parts(raw: RawRecord, content: object) -> list[str | MediaRef]:
    """A message's content: a string (with tags) or a list of typed parts."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise DataError("bad_turns", raw.where, f"message content is a {type(content).__name__}; expected a "
                        "string or a list of {'type': ...} parts")
    parts: list[str | MediaRef] = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            parts.append(p["text"])
            continue
        modality = kind.removesuffix("_url") if isinstance(kind, str) else None
        if modality not in MARKERS:
            raise DataError("bad_turns", raw.where, f"content part {str(p)[:80]} is not a text, image, video or "
                            "audio part")
        named = p.get(kind) or p.get("path") or p.get("url")
        if isinstance(named, dict):  # OpenAI {"type": "image_url", "image_url": {"url": ...}}
            named = named.get("url")
        parts.append(_media_ref(raw, modality, named) if named else MARKERS[modality])
    return parts


def _chat_turns(raw: RawRecord, key: str) -> list[Turn]:
    data = raw.data
    messages = data.get(key)
    if not isinstance(messages, list) or not messages:
        raise DataError("bad_turns", raw.where, f"{key!r} must be a non-empty list of turns")
    roles, contents, learn = [], [], []
    if isinstance(data.get("system"), str) and data["system"]:
        roles.append("system")
        contents.append([data["system"]])
        learn.append(True)
    for i, m in enumerate(messages):
        role = (m.get("from", m.get("role")) if isinstance(m, dict) else None)
        if ROLE_NAMES.get(role) is None:
            raise DataError("bad_turns", raw.where, f"turn {i} has role {role!r}; expected one of "
                            f"{sorted(ROLE_NAMES)} under 'from' or 'role'")
        roles.append(ROLE_NAMES[role])
        contents.append(_content_parts(raw, m.get("value", m.get("content"))))
        learn.append(_learn(raw, i, m))
    turns = [Turn(r, p, keep) for r, p, keep in zip(roles, place_media(contents, _columns(raw), raw.where), learn)]
    _check_turns(turns, raw.where)
    return turns


def _learn(raw: RawRecord, i: int, message: dict) -> bool:
    """A turn's ``loss`` (ms-swift: true / false) or ``weight`` (axolotl: 0 / 1); learned when absent."""
    value = message.get("loss", message.get("weight"))
    if value is None:
        return True
    if value not in (0, 1):  # True / False compare equal to 1 / 0
        raise DataError("bad_turns", raw.where, f"turn {i} has loss/weight {value!r}; only true/false (1/0) "
                        "is implemented, not a scaled loss")
    return bool(value)


def _check_turns(turns: list[Turn], where: str) -> None:
    if any(t.role == "system" for t in turns[1:]):
        raise DataError("bad_turns", where, "a system turn may only come first")
    if not any(t.role == "assistant" and t.learn for t in turns):
        raise DataError("bad_turns", where, "no learned assistant turn: the record has nothing to learn")
    empty = [i for i, t in enumerate(turns)
             if t.role == "assistant" and not t.text().strip() and not any(isinstance(p, MediaRef) for p in t.parts)]
    if empty:
        raise DataError("bad_turns", where, f"assistant turn(s) {empty} are empty; drop them or fill them in")


def _harmonia_turns(raw: RawRecord) -> list[Turn]:
    data = raw.data
    prompt, answer, media = data.get("prompt", ""), data.get("answer"), data.get("media", [])
    if not isinstance(prompt, str) or not isinstance(answer, str):
        raise DataError("bad_turns", raw.where, "'prompt' and 'answer' must be strings")
    if not isinstance(media, list) or not all(isinstance(m, dict) for m in media):
        raise DataError("bad_media", raw.where, "'media' must be a list of objects")
    refs = [_harmonia_media(raw, m) for m in media]
    if not any(tag in prompt for tag in MARKERS.values()):
        user: list[str | MediaRef] = [*refs, prompt] if prompt else list(refs)
    else:
        by_kind: dict[str, list[MediaRef]] = {}
        for r in refs:
            by_kind.setdefault(r.modality, []).append(r)
        user = place_media([[prompt]], by_kind, raw.where)[0]
    turns = [Turn("user", user), Turn("assistant", [answer])]
    _check_turns(turns, raw.where)
    return turns


def _harmonia_media(raw: RawRecord, entry: dict) -> MediaRef:
    modality = entry.get("type")
    if modality not in MARKERS:
        raise DataError("unknown_modality", raw.where, f"media type {modality!r} is not one of {sorted(MARKERS)}")
    declared = tuple((k, float(entry[k])) for k in _DECLARED if k in entry)
    if modality == "video" and "frames" in entry:
        frames = entry["frames"]
        if not isinstance(frames, list) or not frames:
            raise DataError("bad_media", raw.where, "video entry needs a non-empty 'frames' list")
        return MediaRef("video", None, tuple(raw.source.locate(f, raw.where, raw.key) for f in frames), declared)
    if "path" not in entry:
        raise DataError("bad_media", raw.where, f"{modality} entry lacks 'path'")
    return _media_ref(raw, modality, entry["path"], declared=declared)


def _caption(raw: RawRecord) -> Conversation:
    if not raw.caption:
        raise DataError("bad_turns", raw.where, "the key's .txt caption is empty")
    media = [MediaRef(m, name) for m in MARKERS for name in raw.members.get(m, [])]
    return Conversation([Turn("user", list(media)), Turn("assistant", [raw.caption])], raw.where, raw.source,
                        raw.key)
