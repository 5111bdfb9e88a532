"""Workload traces: real per-sample sizes from CSV, and synthesized multimodal mixtures.

Real traces (``../shared/traces/*.csv``) have one row per sample with columns ``image_tiles`` and
``llm_tokens`` (InternVL-style tiling, 256 LLM tokens per 448px tile), so
``text_tokens = llm_tokens - tokens_per_tile * image_tiles``. A richer form with columns
``text_tokens, image_tiles, video_frames, video_tiles, audio_seconds`` (any subset, ``text_tokens``
required) is read too, and written by `write_trace`.

Synthesized traces draw each sample from one of several kinds whose distributions follow published
dataset statistics; each kind's docstring names its source. A fixed-length text trace ``text:N``
(every sample ``N`` text tokens, no items) is the pretraining regime of LLM-only benchmarks.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harmonia.errors import TraceError
from harmonia.workload.shapes import ModalityItem, SampleShape

TILE_TOKENS = 256  # LLM tokens per 448px tile in the shared traces (1024 patches, 4x pixel shuffle)
RICH_COLUMNS = ("text_tokens", "image_tiles", "video_frames", "video_tiles", "audio_seconds")


def _int_field(row: dict, name: str, where: str, minimum: int = 0) -> int:
    raw = (row.get(name) or "").strip()
    try:
        value = int(raw)
    except ValueError:
        raise TraceError(f"{where}: column {name!r} is {raw!r}, expected an integer >= {minimum}") from None
    if value < minimum:
        raise TraceError(f"{where}: column {name!r} is {value}, expected an integer >= {minimum}")
    return value


def _float_field(row: dict, name: str, where: str) -> float:
    raw = (row.get(name) or "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise TraceError(f"{where}: column {name!r} is {raw!r}, expected a number >= 0") from None
    if not value >= 0:
        raise TraceError(f"{where}: column {name!r} is {value}, expected a number >= 0")
    return value


def _row_tiles_tokens(row: dict, where: str, index: int, tokens_per_tile: int) -> SampleShape:
    tiles = _int_field(row, "image_tiles", where)
    total = _int_field(row, "llm_tokens", where, minimum=1)
    text = total - tokens_per_tile * tiles
    if text < 0:
        raise TraceError(
            f"{where}: llm_tokens={total} is less than image_tiles*{tokens_per_tile}={tiles * tokens_per_tile}; "
            "expected llm_tokens to include the image tokens"
        )
    items = (ModalityItem.image(tiles=tiles),) if tiles else ()
    return SampleShape(text, items, sample_id=index)


def _row_rich(row: dict, where: str, index: int) -> SampleShape:
    text = _int_field(row, "text_tokens", where)
    items: list[ModalityItem] = []
    if (row.get("image_tiles") or "").strip() not in ("", "0"):
        items.append(ModalityItem.image(tiles=_int_field(row, "image_tiles", where, 1)))
    if (row.get("video_frames") or "").strip() not in ("", "0"):
        frames = _int_field(row, "video_frames", where, 1)
        tiles = _int_field(row, "video_tiles", where, 1) if (row.get("video_tiles") or "").strip() else 1
        items.append(ModalityItem.video(frames=frames, tiles=tiles))
    if (row.get("audio_seconds") or "").strip() not in ("", "0", "0.0"):
        seconds = _float_field(row, "audio_seconds", where)
        if seconds > 0:
            items.append(ModalityItem.audio(seconds))
    try:
        return SampleShape(text, tuple(items), sample_id=index)
    except Exception as err:
        raise TraceError(f"{where}: {err}") from None


DATASET_SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".tar", ".parquet")
"""File kinds that hold datasets, not traces (named in the error when one is given as a trace)."""


def read_trace(path: str | Path, tokens_per_tile: int = TILE_TOKENS) -> list[SampleShape]:
    """Read a trace CSV into sample shapes.

    Args:
        path: a CSV with header ``image_tiles,llm_tokens`` or a subset of `RICH_COLUMNS`.
        tokens_per_tile: LLM tokens per tile in ``llm_tokens`` (256 in the shared traces).

    Raises:
        TraceError: naming the file, row and column of the first malformed value.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {path} does not exist; pass a CSV file path, synthetic[:mix] or text:N")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = set(reader.fieldnames or ())
        if {"image_tiles", "llm_tokens"} <= columns:
            def parse(row, where, i):
                return _row_tiles_tokens(row, where, i, tokens_per_tile)
        elif "text_tokens" in columns and columns <= set(RICH_COLUMNS):
            parse = _row_rich
        else:
            dataset = path.suffix.lower() in DATASET_SUFFIXES
            raise TraceError(
                f"trace {path}: header {sorted(columns)} is not a known form; expected "
                f"'image_tiles,llm_tokens' or a subset of {RICH_COLUMNS} including text_tokens"
                + ("; it looks like a dataset: `harmonia plan` and `harmonia simulate` profile a dataset's own "
                   f"samples given as the job's data.path (--data.path={path} with no --trace, or --config JOB.toml)"
                   if dataset else "")
            )
        samples = []
        for i, row in enumerate(reader):
            where = f"trace {path.name} row {i + 2}"  # +1 for the header, +1 for 1-based lines
            if None in row or any(v is None for v in row.values()):
                raise TraceError(f"{where}: expected {len(columns)} comma-separated fields")
            samples.append(parse(row, where, i))
    if not samples:
        raise TraceError(f"trace {path} has no rows")
    return samples


def write_trace(samples: list[SampleShape], path: str | Path) -> None:
    """Write samples with at most one item of each modality in the rich CSV form."""
    with Path(path).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(RICH_COLUMNS)
        for s in samples:
            by = {}
            for item in s.items:
                if item.modality in by or item.tiles is None and item.modality != "audio":
                    raise TraceError(
                        f"sample {s.sample_id}: the CSV form holds one tiled item per modality; "
                        "save richer samples with another format"
                    )
                by[item.modality] = item
            img, vid, aud = by.get("image"), by.get("video"), by.get("audio")
            writer.writerow([
                s.text_tokens, img.tiles if img else 0, vid.frames if vid else 0,
                vid.tiles if vid else 0, aud.seconds if aud else 0,
            ])


def _lognormal_int(rng: np.random.Generator, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal draw with the given arithmetic mean, clipped to [lo, hi]."""
    mu = np.log(mean) - sigma**2 / 2
    return int(np.clip(round(rng.lognormal(mu, sigma)), lo, hi))


def synth_text_only(rng: np.random.Generator) -> SampleShape:
    """Text-only chat: ShareGPT conversations average ~600 tokens with a long tail (Zheng et al.
    2023, Vicuna / LMSYS-Chat); log-normal, sigma 0.9, clipped to 16..8192."""
    return SampleShape(_lognormal_int(rng, 600, 0.9, 16, 8192))


def synth_single_image(rng: np.random.Generator) -> SampleShape:
    """One image with dynamic tiling: tile counts {1, 3, 5, 7, 9, 13} with the frequencies of
    InternVL-1.5-style tiling over the ai2d/chartqa traces and LLaVA-665K images (most 1-5 tiles,
    documents up to 13); text ~150 tokens (LLaVA-1.5 mix, Liu et al. 2023), log-normal sigma 0.7."""
    tiles = int(rng.choice([1, 3, 5, 7, 9, 13], p=[0.30, 0.25, 0.30, 0.07, 0.05, 0.03]))
    return SampleShape(_lognormal_int(rng, 150, 0.7, 8, 2048), (ModalityItem.image(tiles=tiles),))


def synth_multi_image(rng: np.random.Generator) -> SampleShape:
    """2-8 images, 1-2 tiles each: Mantis-Instruct averages 4.7 images per sample (Jiang et al.
    2024); InternVL gives each image max_tiles / n_images tiles. Text ~250 tokens, sigma 0.6."""
    n = int(np.clip(rng.poisson(3.7) + 1, 2, 8))
    items = tuple(ModalityItem.image(tiles=int(rng.integers(1, 3))) for _ in range(n))
    text = _lognormal_int(rng, 250, 0.6, 16, 4096)
    offsets = tuple(sorted(int(x) for x in rng.integers(0, text + 1, size=n)))
    return SampleShape(text, items, item_offsets=offsets)


def synth_video(rng: np.random.Generator) -> SampleShape:
    """A video clip: LLaVA-Video-178K clips last 0-3 min (mean ~40 s, Zhang et al. 2024); frames at
    1 fps, capped at 8..32 as InternVL 2.5 samples them, one 448px tile per frame. Text ~200 tokens."""
    seconds = rng.lognormal(np.log(40) - 0.5, 1.0)
    frames = int(np.clip(round(seconds), 8, 32))
    return SampleShape(_lognormal_int(rng, 200, 0.6, 16, 4096), (ModalityItem.video(frames=frames, tiles=1),))


def synth_long_video(rng: np.random.Generator) -> SampleShape:
    """A long video for long-context training: LLaVA-Video-178K's longer clips (up to 3 min, Zhang et
    al. 2024) sampled at about 1 fps as long-video recipes keep them (LongVA, Zhang et al. 2024,
    trains on up to hundreds of frames), here 32-160 frames, uniform; one 448px tile per frame, so
    8k-40k LLM tokens at InternVL's 256 per tile. Text ~200 tokens, as `synth_video`."""
    frames = int(rng.integers(32, 161))
    return SampleShape(_lognormal_int(rng, 200, 0.6, 16, 4096), (ModalityItem.video(frames=frames, tiles=1),))


def synth_audio(rng: np.random.Generator) -> SampleShape:
    """Speech: LibriSpeech utterances average 12.3 s, up to ~35 s (Panayotov et al. 2015);
    log-normal, sigma 0.5, clipped to 1..30 s. Text (transcript + prompt) ~60 tokens."""
    seconds = float(np.clip(rng.lognormal(np.log(12.3) - 0.125, 0.5), 1.0, 30.0))
    return SampleShape(_lognormal_int(rng, 60, 0.5, 8, 1024), (ModalityItem.audio(round(seconds, 2)),))


def synth_image_audio(rng: np.random.Generator) -> SampleShape:
    """An image with a spoken question (VQA with speech prompts, e.g. the audio variants of VQAv2
    used by omni-modal SFT): one image as `synth_single_image`, 2-10 s of audio, ~80 text tokens."""
    image = synth_single_image(rng).items[0]
    audio = ModalityItem.audio(round(float(rng.uniform(2.0, 10.0)), 2))
    return SampleShape(_lognormal_int(rng, 80, 0.5, 8, 1024), (audio, image))


KINDS: dict[str, Callable[[np.random.Generator], SampleShape]] = {
    "text": synth_text_only,
    "image": synth_single_image,
    "multi_image": synth_multi_image,
    "video": synth_video,
    "long_video": synth_long_video,
    "audio": synth_audio,
    "image_audio": synth_image_audio,
}

DEFAULT_MIX: dict[str, float] = {
    "image": 0.40, "multi_image": 0.10, "video": 0.15, "audio": 0.15, "text": 0.10, "image_audio": 0.10,
}


def synthesize_trace(n_samples: int, mix: dict[str, float] | None = None, seed: int = 0) -> list[SampleShape]:
    """Draw a mixed trace.

    Args:
        n_samples: number of samples.
        mix: kind -> proportion (normalised); kinds are the keys of `KINDS`. Default `DEFAULT_MIX`.
        seed: random seed; the same seed gives the same trace.
    """
    mix = dict(DEFAULT_MIX if mix is None else mix)
    unknown = set(mix) - set(KINDS)
    if unknown:
        raise TraceError(f"unknown sample kinds {sorted(unknown)} in the mix; known kinds: {sorted(KINDS)}")
    if n_samples < 1 or any(p < 0 for p in mix.values()) or sum(mix.values()) <= 0:
        raise TraceError(
            f"synthesize_trace: n_samples={n_samples} and proportions {mix} must be positive"
        )
    rng = np.random.default_rng(seed)
    kinds = list(mix)
    probs = np.array([mix[k] for k in kinds], dtype=float)
    choice = rng.choice(len(kinds), size=n_samples, p=probs / probs.sum())
    samples = []
    for i, k in enumerate(choice):
        s = KINDS[kinds[k]](rng)
        samples.append(SampleShape(s.text_tokens, s.items, s.item_offsets, sample_id=i))
    return samples


def parse_mix(spec: str) -> dict[str, float]:
    """Parse ``image=0.5,video=0.3,audio=0.2`` into a mix."""
    mix = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        try:
            mix[name.strip()] = float(value) if sep else 1.0
        except ValueError:
            raise TraceError(f"mix entry {part!r}: expected kind=proportion, e.g. image=0.5") from None
    return mix


def fixed_text_trace(spec: str, n_samples: int) -> list[SampleShape]:
    """``text:N``: ``n_samples`` text-only samples of exactly ``N`` tokens each (packed pretraining
    sequences, as LLM throughput benchmarks run them)."""
    _, _, length = spec.partition(":")
    try:
        tokens = int(length)
    except ValueError:
        tokens = 0
    if tokens < 1 or n_samples < 1:
        raise TraceError(f"trace {spec!r}: expected text:N with N >= 1 tokens per sample, e.g. text:8192")
    return [SampleShape(tokens, sample_id=i) for i in range(n_samples)]


def is_generated(spec: str) -> bool:
    """Whether a trace spec is generated (``synthetic[:...]``, ``text:N``) rather than a CSV path."""
    return spec.startswith("synthetic") or spec.startswith("text:")


def load_trace(spec: str, n_samples: int = 4096, seed: int = 0) -> list[SampleShape]:
    """A trace from a CSV path, ``synthetic[:kind=p,...]`` or ``text:N``."""
    if spec.startswith("synthetic"):
        _, _, rest = spec.partition(":")
        return synthesize_trace(n_samples, parse_mix(rest) if rest else None, seed)
    if spec.startswith("text:"):
        return fixed_text_trace(spec, n_samples)
    return read_trace(spec)
