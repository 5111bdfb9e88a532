"""From a record to what the scheduler and the executor need.

`read_shape` reads only headers (image size, WAV length, frame count), or nothing when the manifest
declares sizes (``height``/``width`` of an image, ``seconds`` of audio), and returns the `SampleShape`
the scheduler balances with; decoding checks declared sizes against the file. `build_sample` decodes the media and returns the same shape together
with the `TokenizedSample` the executor packs. Token counts come from `harmonia.workload.shapes`.

A sample's LLM sequence is ``bos, prompt text and items, answer, eos``; only the answer and ``eos``
are targets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from harmonia.data import media as M
from harmonia.data.records import MARKERS, DataError, Record
from harmonia.data.tokenizer import ByteTokenizer
from harmonia.errors import HarmoniaError, SampleError
from harmonia.model.batch import ItemInputs, TokenizedSample, frame_groups
from harmonia.model.llm import IGNORE_INDEX
from harmonia.model.spec import MLLMSpec
from harmonia.workload.shapes import ModalityItem, SampleShape, llm_tokens_of_item

_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS.values()))


@dataclass
class LoadedSample:
    """A decoded sample: its shape (for the scheduler) and tensors (for the executor)."""

    index: int
    shape: SampleShape
    tokens: TokenizedSample
    answer: str
    task: str | None = None


def _pieces(record: Record) -> list[str | dict]:
    """Prompt text runs and media entries in sequence order."""
    prompt, media = record.data.get("prompt", ""), record.data.get("media", [])
    markers = _MARKER_RE.findall(prompt)
    if not markers:
        return [*media, prompt]
    kinds = [m["type"] for m in media]
    if markers != [MARKERS[k] for k in kinds]:
        raise DataError("bad_record", record.where,
                        f"prompt markers {markers} do not match the media types {kinds} in order")
    texts = _MARKER_RE.split(prompt)
    out: list[str | dict] = [texts[0]]
    for m, t in zip(media, texts[1:]):
        out += [m, t]
    return out


def _check_declared(entry: dict, actual: dict[str, int], where: str) -> None:
    """Sizes declared in the manifest (used for shapes without reading files) must match the file."""
    for key, value in actual.items():
        if key in entry and int(entry[key]) != value:
            raise DataError("shape_mismatch", where, f"manifest says {key}={entry[key]} but the file has "
                            f"{value}; fix or drop the declared size")


def _decode_item(entry: dict, record: Record, mllm: MLLMSpec, max_frames: int,
                 headers_only: bool) -> tuple[ModalityItem, ItemInputs | None]:
    modality = entry["type"]
    try:
        module = mllm.encoder_for(modality)
    except HarmoniaError as e:
        raise DataError("unknown_modality", record.where, str(e)) from e
    enc = mllm.encoders[module]
    where = f"{record.where} ({modality} {entry.get('path') or entry.get('frames')})"
    try:
        if modality == "image":
            if headers_only and "height" in entry and "width" in entry:
                return ModalityItem.image(height=int(entry["height"]), width=int(entry["width"])), None
            data = record.source.read(entry["path"])
            if headers_only:
                h, w = M.image_size(data)
                return ModalityItem.image(height=h, width=w), None
            img = M.open_image(data)
            item = ModalityItem.image(height=img.height, width=img.width)
            _check_declared(entry, {"height": img.height, "width": img.width}, where)
            return item, ItemInputs(module, M.tile_image(img, enc))
        if modality == "audio":
            if headers_only and "seconds" in entry:
                return ModalityItem.audio(float(entry["seconds"])), None
            data = record.source.read(entry["path"])
            if headers_only:
                return ModalityItem.audio(M.wav_seconds(data, enc.sample_rate)), None
            x, rate = M.read_wav(data)
            chunks, item = M.audio_chunks(x, rate, enc)
            if "seconds" in entry and abs(float(entry["seconds"]) - item.seconds) > 1e-3:
                raise DataError("shape_mismatch", where, f"manifest says seconds={entry['seconds']} but the "
                                f"file holds {item.seconds:.3f} s; fix or drop the declared size")
            return item, ItemInputs(module, chunks)
        names = entry.get("frames") or []
        if not names:
            raise DataError("bad_record", where, "video entry needs a non-empty 'frames' list")
        names = [names[i] for i in M.sample_frame_indices(len(names), max_frames)]
        item = ModalityItem.video(frames=len(names), tiles=1)
        if headers_only:
            return item, None
        frames = [M.open_image(record.source.read(n)) for n in names]
        groups = frame_groups(len(frames), 1, enc.temporal_merge)
        return item, ItemInputs(module, M.frame_tiles(frames, enc), groups)
    except KeyError as e:
        raise DataError("bad_record", where, f"media entry lacks {e}") from e
    except DataError:
        raise
    except SampleError as e:
        raise DataError("corrupt_media", where, str(e)) from e


def _assemble(record: Record, index: int, mllm: MLLMSpec, tok: ByteTokenizer, max_tokens: int,
              max_frames: int, headers_only: bool):
    prompt_ids: list = [[tok.bos]]  # text id lists and (item, inputs) pairs; always ends with a list
    for piece in _pieces(record):
        if isinstance(piece, str):
            prompt_ids[-1] += tok.encode(piece)
        else:
            prompt_ids.append(_decode_item(piece, record, mllm, max_frames, headers_only))
            prompt_ids.append([])
    answer = tok.encode(record.data.get("answer", "")) + [tok.eos]
    prompt_ids[-1] += answer
    n_answer = len(answer)
    items, offsets, segments, text = [], [], [], 0
    for part in prompt_ids:
        if isinstance(part, list):
            if part:
                segments.append(("text", len(part)))
            text += len(part)
        else:
            item = part[0]
            items.append(part)
            offsets.append(text)
            segments.append(("item", llm_tokens_of_item(item, mllm.encoders[mllm.encoder_for(item.modality)])))
    shape = SampleShape(text, tuple(i for i, _ in items), tuple(offsets), sample_id=index)
    total = sum(n for _, n in segments)
    if total > max_tokens:
        raise DataError("too_long", record.where,
                        f"sample has {total} LLM tokens, more than max_tokens={max_tokens}; raise the limit or drop it")
    return shape, prompt_ids, segments, items, n_answer


def read_shape(record: Record, index: int, mllm: MLLMSpec, max_tokens: int, max_frames: int = 8,
               tok: ByteTokenizer | None = None) -> SampleShape:
    """The sample's shape from media headers only; raises `DataError` for an unusable sample."""
    return _assemble(record, index, mllm, tok or ByteTokenizer(), max_tokens, max_frames, True)[0]


def build_sample(record: Record, index: int, mllm: MLLMSpec, max_tokens: int, max_frames: int = 8,
                 tok: ByteTokenizer | None = None) -> LoadedSample:
    """Decode a record into its shape and tensors; raises `DataError` for an unusable sample."""
    tok = tok or ByteTokenizer()
    shape, parts, segments, items, n_answer = _assemble(record, index, mllm, tok, max_tokens, max_frames, False)
    ids: list[int] = []
    for part in parts:
        if isinstance(part, list):
            ids += part
        else:
            enc = mllm.encoders[mllm.encoder_for(part[0].modality)]
            ids += [tok.placeholder] * llm_tokens_of_item(part[0], enc)
    input_ids = torch.tensor(ids, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    T = len(ids)
    labels[T - n_answer - 1: T - 1] = input_ids[T - n_answer:]  # position t predicts token t + 1
    tokens = TokenizedSample(input_ids, labels, segments, [inp for _, inp in items],
                             sample_id=record.data.get("id", index))
    return LoadedSample(index, shape, tokens, record.data.get("answer", ""), record.data.get("task"))
