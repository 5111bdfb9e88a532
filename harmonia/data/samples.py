"""From a conversation to what the scheduler and the executor need.

`SampleBuilder.shape` reads only media headers (image size, audio length, frame count; or takes them
from the shape index), or nothing when the record declares sizes (``height``/``width`` of an image,
``seconds`` of audio), and returns the `SampleShape` the scheduler balances with.
`SampleBuilder.build` decodes the media (harmonia.data.media, with the model's preprocessing) and
returns the same shape with the `TokenizedSample` the executor packs; decoding checks declared sizes
against the file. A shape's rendering (`Rendered`: token count, item runs, learned tokens) can come
from a `harmonia.data.token_cache.TokenCountCache` instead of the tokenizer; with it,
`SampleBuilder.outline` gives what a rank needs of a sample it does not decode (`SampleOutline`). Item token counts come from `harmonia.workload.shapes` for the model spec; the
tokenizer (harmonia.data.tokenizer) renders the conversation around them and marks learned tokens.

Labels are next-token targets aligned with ``input_ids``: ``labels[t] = input_ids[t + 1]`` where
token ``t + 1`` is learned (assistant content and end-of-turn), else ``-100``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harmonia.data import media as M
from harmonia.data.conversation import Conversation, MediaRef
from harmonia.data.encoded_cache import EncodedCache
from harmonia.data.records import DataError, TarSource
from harmonia.data.shape_index import MediaFile
from harmonia.data.token_cache import Rendered, TokenCountCache
from harmonia.data.tokenizer import ByteTokenizer, Encoded, Framed, ItemTokens, Tokenizer
from harmonia.errors import HarmoniaError
from harmonia.model.anyres import anyres_order
from harmonia.model.batch import ItemInputs, TokenizedSample, frame_groups
from harmonia.model.llm import IGNORE_INDEX
from harmonia.model.spec import MLLMSpec
from harmonia.model.mrope import item_rope_positions
from harmonia.model.video_spec import frame_texts
from harmonia.workload.shapes import ModalityItem, SampleShape, item_parts, llm_tokens_of_item, native_grid


@dataclass(frozen=True)
class ItemOutline:
    """An undecoded item: only the encoder that takes it."""

    module: str


@dataclass
class SampleOutline:
    """A sample a rank does not decode: its token runs and items' encoders, as a `TokenizedSample`
    shows them to the batch builder (`harmonia.runtime.mllm_inputs.build_rank_batch`), no tensors.

    Attributes:
        segments: ``(kind, length)`` runs, kind ``text`` or ``item``.
        items: the encoder of each ``item`` segment.
        n_targets: tokens with a next-token label.
        sample_id: dataset identifier.
    """

    segments: list[tuple[str, int]]
    items: list[ItemOutline]
    n_targets: int
    sample_id: int | str | None = None

    def __len__(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass
class LoadedSample:
    """A decoded sample: its shape (for the scheduler) and tensors (for the executor)."""

    index: int
    shape: SampleShape
    tokens: TokenizedSample
    answer: str
    task: str | None = None


def _kind(ref: MediaRef) -> str:
    """The media module's kind of an item: ``image``, ``audio``, ``video`` (a container) or ``frames``."""
    return "frames" if ref.frames is not None else ref.modality


def media_file(ref: MediaRef, conv: Conversation) -> MediaFile:
    """The shape index's name of an item's file(s)."""
    source = conv.source
    if isinstance(source, TarSource):
        return MediaFile(_kind(ref), ref.path, ref.frames or (), str(source.path))
    names = [str(source.root / n) for n in (ref.frames or (ref.path,))]
    return MediaFile(_kind(ref), None, tuple(names)) if ref.frames is not None else MediaFile(_kind(ref), names[0])


def _declared_item(ref: MediaRef) -> ModalityItem | None:
    declared = dict(ref.declared)
    if ref.modality == "image" and "height" in declared and "width" in declared:
        return ModalityItem.image(height=int(declared["height"]), width=int(declared["width"]))
    if ref.modality == "audio" and "seconds" in declared:
        return ModalityItem.audio(declared["seconds"])
    return None


def _check_declared(ref: MediaRef, item: ModalityItem, where: str) -> None:
    """Sizes declared in the record (used for shapes without reading files) must match the file."""
    actual = {"height": item.height, "width": item.width, "seconds": item.seconds}
    for key, value in ref.declared:
        if actual.get(key) is not None and abs(value - actual[key]) > (1e-3 if key == "seconds" else 0):
            raise DataError("shape_mismatch", where, f"the record says {key}={value:g} but the file has "
                            f"{actual[key]:g}; fix or drop the declared size")


@dataclass
class SampleBuilder:
    """Builds shapes and samples of conversations for one model.

    Attributes:
        mllm: the model; its encoders decide which modalities are known and their token counts.
        tokenizer: renders conversations (`ByteTokenizer` or `harmonia.data.chat.HFTokenizer`).
        max_tokens: longest LLM sequence a sample may have.
        truncate: a longer sample is cut to its first ``max_tokens`` tokens (items after the cut
            dropped; a cut inside an item, or one that leaves nothing learned, is a bad record)
            instead of being a bad record (``too_long``).
        preprocessors: encoder module -> its media preprocessing (`M.build_media_preprocessors`).
        sampling: video frame sampling.
        frames_fps: the frame rate of videos given as lists of frame files (None: unknown; a tower
            that samples by rate refuses them).
    """

    mllm: MLLMSpec
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    max_tokens: int = 4096
    preprocessors: dict = field(default_factory=dict)
    sampling: M.FrameSampling = field(default_factory=M.FrameSampling)
    token_cache: TokenCountCache | None = None
    truncate: bool = False
    encoded: EncodedCache = field(default_factory=EncodedCache, compare=False, repr=False)
    frames_fps: float | None = None

    def _module(self, ref: MediaRef, where: str) -> str:
        try:
            return self.mllm.encoder_for(ref.modality)
        except HarmoniaError as e:
            raise DataError("unknown_modality", where, str(e)) from e

    def _prep(self, module: str):
        return self.preprocessors.get(module) or self.mllm.encoders[module]

    def _read(self, ref: MediaRef, conv: Conversation):
        if ref.frames is not None:
            return [conv.source.read(n) for n in ref.frames]
        return conv.source.read(ref.path)

    def item_shape(self, ref: MediaRef, conv: Conversation, header: dict | None = None) -> ModalityItem:
        """An item's shape from its declared sizes, a header dict (`M.media_shape`), or its file's header."""
        module = self._module(ref, conv.where)
        where = f"{conv.where} ({ref.modality} {ref.name})"
        declared = _declared_item(ref)
        if declared is not None:
            return declared
        try:
            if header is None:
                header = M.media_shape(_kind(ref), self._read(ref, conv))
            return M.shape_item(_kind(ref), header, self._prep(module), self.sampling, self.frames_fps or None)
        except (M.MediaError, DataError) as e:  # the record's location, then the file's message
            raise DataError(e.kind, where, str(e)) from e

    def decode(self, ref: MediaRef, conv: Conversation) -> tuple[ModalityItem, ItemInputs]:
        """An item's shape and encoder inputs; declared sizes are checked against the file."""
        module = self._module(ref, conv.where)
        where = f"{conv.where} ({ref.modality} {ref.name})"
        enc, kind, step = self.mllm.encoders[module], _kind(ref), None
        try:
            if enc.native is not None and kind in ("video", "frames"):
                item, x, step = M.decode_native_video(kind, self._read(ref, conv), M.image_preprocessor(
                    self._prep(module)), self.sampling, self.frames_fps or None)
            else:
                item, x = M.decode_item(kind, self._read(ref, conv), self._prep(module), self.sampling,
                                        self.frames_fps or None)
        except (M.MediaError, DataError) as e:  # the record's location, then the file's message
            raise DataError(e.kind, where, str(e)) from e
        _check_declared(ref, item, where)
        if enc.native is not None:  # patch rows and their grid (Qwen-VL); a video's seconds per grid step
            return item, ItemInputs(module, x, grid=torch.tensor([native_grid(item, enc)]), second_per_grid=step)
        groups = frame_groups(item.frames, 1, enc.temporal_merge) if item.modality == "video" else None
        order = anyres_order(item.height, item.width, enc) if enc.grid_pinpoints else None  # LLaVA-NeXT
        return item, ItemInputs(module, x, groups, order)

    def _encoder(self, item: ModalityItem):
        return self.mllm.encoders[self.mllm.encoder_for(item.modality)]

    def _split(self, item: ModalityItem, x: ItemInputs) -> list[tuple[ModalityItem, ItemInputs]]:
        """A decoded item as the sample's items (`_parts`): itself, or a video's temporal groups."""
        parts = self._parts([item])
        if len(parts) == 1 and parts[0] is item:
            return [(item, x)]
        return list(zip(parts, _split_rows(parts, x)))

    def _lengths(self, parts: list[ModalityItem]) -> list[int]:
        """LLM tokens of each item of a sample (`_parts`)."""
        return [llm_tokens_of_item(i, self._encoder(i)) for i in parts]

    def _parts(self, items: list[ModalityItem]) -> list[ModalityItem]:
        """A sample's items as its sequence holds them: a video written one temporal group at a time
        (Qwen3-VL) as one item per group (`harmonia.workload.shapes.item_parts`)."""
        return [p for i in items for p in item_parts(i, self._encoder(i))]

    def _writing(self, parts: list[ModalityItem]) -> list[ItemTokens]:
        """How the tokenizer writes each media reference of a sample of items ``parts``: its LLM
        tokens, or a video's runs with each temporal group's timestamp text (`Framed`)."""
        out: list[ItemTokens] = []
        for item, n in zip(parts, self._lengths(parts)):
            if item.part is None:
                out.append(n)
                continue
            before, after = frame_texts(item.times[0])
            if item.part[0] == 0:
                out.append(Framed((n,), (before,), (after,)))
            else:
                last = out[-1]
                out[-1] = Framed(last.runs + (n,), last.before + (before,), last.after + (after,))
        return out

    def _fitted(self, conv: Conversation, r: Rendered) -> Rendered:
        """``r`` within ``max_tokens``: as it is, or cut (`truncate`); else a `DataError`."""
        if r.n_ids <= self.max_tokens:
            return r
        if not self.truncate:
            raise DataError("too_long", conv.where, f"sample has {r.n_ids} LLM tokens, more than "
                            f"max_tokens={self.max_tokens}; raise the limit, drop it, or truncate")
        cut = r.cut(self.max_tokens)
        if any(a + n > self.max_tokens for a, n in cut.items):
            raise DataError("too_long", conv.where, f"cutting the sample's {r.n_ids} LLM tokens at max_tokens="
                            f"{self.max_tokens} would split a media item; raise the limit or drop it")
        if not cut.n_targets:
            raise DataError("too_long", conv.where, f"the first max_tokens={self.max_tokens} of its {r.n_ids} tokens "
                            "hold nothing learned; raise the limit or drop it")
        return cut

    def _shape_of(self, conv: Conversation, index: int, items: list[ModalityItem], lengths: list[int],
                  r: Rendered) -> SampleShape:
        """The shape of a sample of items ``items`` (`_parts`) of ``lengths`` LLM tokens, rendered ``r``."""
        r = self._fitted(conv, r)
        if not r.learned:
            raise DataError("no_targets", conv.where, "no token of the sample is learned (empty assistant turns)")
        k = len(r.items)  # items after a cut are dropped
        if k < len(items) and items[k].part is not None and items[k].part[0] > 0:
            raise DataError("too_long", conv.where, f"cutting the sample at max_tokens={self.max_tokens} would "
                            "split a video's frames; raise the limit or drop it")
        offsets = tuple(start - sum(lengths[:j]) for j, (start, _) in enumerate(r.items))
        return SampleShape(r.n_ids - sum(lengths[:k]), tuple(items[:k]), offsets, sample_id=index)

    def _encode(self, conv: Conversation, index: int, parts: list[ModalityItem]) -> tuple[SampleShape, Encoded]:
        writing = self._writing(parts)
        enc = self.encoded.get(index, writing)  # a sample decoded before (an earlier epoch)
        if enc is None:
            enc = self.tokenizer.encode_conversation(conv, writing)
            self.encoded.put(index, writing, enc)
        return self._shape_of(conv, index, parts, self._lengths(parts), Rendered.of(enc)), enc

    def render(self, conv: Conversation, lengths: list[ItemTokens]) -> Rendered:
        """The rendering summary of a conversation with items written as ``lengths`` (`_writing`), from
        the token cache when it holds it (else rendered, and remembered by the cache)."""
        if self.token_cache is not None:
            cached = self.token_cache.get(conv, lengths)
            if cached is not None:
                return cached
        r = Rendered.of(self.tokenizer.encode_conversation(conv, lengths))
        if self.token_cache is not None:
            self.token_cache.put(conv, lengths, r)
        return r

    def shape(self, conv: Conversation, index: int, headers: list[dict] | None = None) -> SampleShape:
        """The sample's shape from media headers only; raises `DataError` for an unusable sample.

        Args:
            conv: the conversation.
            index: its dataset index (the shape's ``sample_id``).
            headers: its items' `M.media_shape` dicts (from the shape index); None reads the headers.
        """
        refs = conv.media()
        parts = self._parts([self.item_shape(r, conv, headers[k] if headers else None) for k, r in enumerate(refs)])
        rendered = self.render(conv, self._writing(parts))
        return self._shape_of(conv, index, parts, self._lengths(parts), rendered)

    def n_targets(self, conv: Conversation, shape: SampleShape) -> int:
        """Tokens with a next-token label of a sample of ``shape`` (from the token cache when it holds it)."""
        parts = list(shape.items)  # a truncated sample's shape lacks the items after the cut: their headers
        whole = sum(1 for p in parts if p.part is None or p.part[0] == 0)  # media references covered
        parts += self._parts([self.item_shape(r, conv) for r in conv.media()[whole:]])
        return self._fitted(conv, self.render(conv, self._writing(parts))).n_targets

    def outline(self, shape: SampleShape, n_targets: int) -> SampleOutline:
        """What the batch builder needs of a sample this rank does not decode: the token runs of its
        shape (the same runs decoding gives) and its items' encoders."""
        lengths = self._lengths(list(shape.items))
        segments, text = [], 0
        for offset, n in zip(shape.offsets(), lengths):
            if offset > text:
                segments.append(("text", offset - text))
            segments.append(("item", n))
            text = offset
        if shape.text_tokens > text:
            segments.append(("text", shape.text_tokens - text))
        items = [ItemOutline(self.mllm.encoder_for(i.modality)) for i in shape.items]
        return SampleOutline(segments, items, n_targets, shape.sample_id)

    def build(self, conv: Conversation, index: int) -> LoadedSample:
        """Decode a conversation into its shape and tensors; raises `DataError` for an unusable sample."""
        decoded = [part for r in conv.media() for part in self._split(*self.decode(r, conv))]
        shape, enc = self._encode(conv, index, [item for item, _ in decoded])
        if len(enc.ids) > self.max_tokens:  # truncated (`_shape_of` refused it otherwise)
            n = self.max_tokens
            enc = Encoded(enc.ids[:n], enc.targets[:n], [r for r in enc.items if r[0] < n])
            decoded = decoded[:len(shape.items)]
        input_ids = torch.tensor(enc.ids, dtype=torch.long)  # (T,)
        target = torch.tensor(enc.targets, dtype=torch.bool)  # (T,)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:-1] = torch.where(target[1:], input_ids[1:], IGNORE_INDEX)  # position t predicts token t + 1
        segments, items = _segments(enc), [x for _, x in decoded]
        tokens = TokenizedSample(input_ids, labels, segments, items,
                                 sample_id=conv.id if conv.id is not None else index,
                                 causal_items=self.mllm.item_attention == "causal",
                                 rope_positions=item_rope_positions(self.mllm, segments, items))
        return LoadedSample(index, shape, tokens, conv.answer(), conv.task)


def _split_rows(parts: list[ModalityItem], x: ItemInputs) -> list[ItemInputs]:
    """A decoded video's patch rows cut into its temporal groups' (`item_parts`), each of grid ``(1, h, w)``."""
    _, h, w = (int(v) for v in x.grid[0])
    if x.inputs.shape[0] != len(parts) * h * w:
        raise DataError("shape_mismatch", "video", f"{x.inputs.shape[0]} patch rows for {len(parts)} temporal groups "
                        f"of {h}x{w} patches")
    return [ItemInputs(x.module, rows, grid=torch.tensor([[1, h, w]])) for rows in x.inputs.split(h * w)]


def _segments(enc: Encoded) -> list[tuple[str, int]]:
    """``(kind, length)`` runs of text and items covering the sequence."""
    segments, pos = [], 0
    for start, n in enc.items:
        if start > pos:
            segments.append(("text", start - pos))
        segments.append(("item", n))
        pos = start + n
    if pos < len(enc.ids):
        segments.append(("text", len(enc.ids) - pos))
    return segments
