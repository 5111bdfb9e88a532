"""`harmonia data inspect PATH`: read every record and decode every media file, without training.

It opens the dataset as a training job would (same formats, tokenizer, chat template and model
spec), decodes each distinct record once in worker processes with a progress bar, and reports:
records read, how many are usable, bad records by kind with their first locations, items per
modality, and the distributions of LLM tokens per sample, tiles per image, frames per video and
seconds per audio clip. ``--json FILE`` writes the same report::

    {"records": N, "ok": N, "bad": {kind: count}, "bad_examples": {kind: [location: message, ...]},
     "modalities": {...}, "tokens": {...}, "tiles": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from harmonia.data.formats import FORMATS
from harmonia.data.loader import MultimodalDataset, build_tokenizer, checkpoint_preprocessors, open_dataset
from harmonia.data.samples import LoadedSample

PERCENTILES = (50, 90, 99)


def _distribution(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    x = np.asarray(values, dtype=float)
    out = {"n": int(x.size), "min": float(x.min()), "mean": round(float(x.mean()), 3), "max": float(x.max())}
    out.update({f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES})
    return out


def _histogram(values: list[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


class _Tally:
    """What the report counts over the usable samples."""

    def __init__(self) -> None:
        self.items: Counter = Counter()
        self.samples_by_mix: Counter = Counter()
        self.tokens: list[int] = []
        self.targets: list[int] = []
        self.tiles: list[int] = []
        self.frames: list[int] = []
        self.seconds: list[float] = []

    def add(self, s: LoadedSample) -> None:
        # a video written one temporal group at a time (Qwen3-VL) is one item per group: counted once
        whole = [(i, x) for i, x in zip(s.shape.items, s.tokens.items) if i.part is None or i.part[0] == 0]
        kinds = [i.modality for i, _ in whole]
        self.items.update(kinds)
        self.samples_by_mix["+".join(sorted(set(kinds))) or "text"] += 1
        self.tokens.append(len(s.tokens))
        self.targets.append(int((s.tokens.labels != -100).sum()))
        for item, inputs in whole:
            if item.modality == "image":
                self.tiles.append(int(inputs.inputs.shape[0]))
            elif item.modality == "video":
                self.frames.append(_video_frames(s.shape.items, item))
            else:
                self.seconds.append(item.seconds)


def _video_frames(items: tuple, first) -> int:
    """Frames of the video that starts at item ``first`` (all its temporal groups' when it has them)."""
    if first.part is None:
        return first.frames
    k = items.index(first)
    return sum(i.frames for i in items[k:k + first.part[1]])


def inspect_dataset(dataset: MultimodalDataset, num_workers: int = 0, progress: bool = True,
                    batch: int = 16) -> dict:
    """Decode every distinct record of ``dataset`` once and report (see the module docstring).

    Args:
        dataset: an opened dataset (its policy should be ``skip`` to see every bad record).
        num_workers: decoding worker processes.
        progress: show a rich progress bar.
        batch: records per worker task.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    first = {}
    for i, conv in enumerate(dataset.records):
        first.setdefault(id(conv), i)
    indices = sorted(first.values())
    batches = [indices[k:k + batch] for k in range(0, len(indices), batch)]
    tally = _Tally()
    columns = (TextColumn("decoding records"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("decode", total=len(indices))
        for k, samples in enumerate(dataset.iter_load(batches, num_workers=num_workers)):
            for s in samples:
                tally.add(s)
            bar.advance(task, len(batches[k]))
    stats = dataset.stats
    return {
        "path": str(dataset.path), "sources": [s.name for s in dataset.sources],
        "records": dataset.n_read, "ok": stats.loaded, "bad": dict(sorted(stats.skipped.items())),
        "bad_examples": {k: v for k, v in sorted(stats.examples.items())},
        "samples_after_mixing": len(dataset.records),
        "modalities": {"items": dict(sorted(tally.items.items())), "samples": dict(sorted(tally.samples_by_mix.items()))},
        "tokens": _distribution(tally.tokens), "targets": _distribution(tally.targets),
        "tiles": {**_distribution(tally.tiles), "histogram": _histogram(tally.tiles)},
        "frames": {**_distribution(tally.frames), "histogram": _histogram(tally.frames)},
        "audio_seconds": _distribution(tally.seconds),
    }


def print_report(report: dict, console, model: str) -> None:
    """The report as rich tables."""
    from rich.table import Table

    console.print(f"{report['path']}: {report['records']} records, {report['ok']} usable, "
                  f"{sum(report['bad'].values())} bad (token counts for {model})", markup=False, highlight=False)
    t = Table(title="modalities")
    for col in ("", "items", "samples"):
        t.add_column(col)
    for k in sorted({*report["modalities"]["items"], *report["modalities"]["samples"]}):
        t.add_row(k, str(report["modalities"]["items"].get(k, "")), str(report["modalities"]["samples"].get(k, "")))
    console.print(t)
    d = Table(title="distributions")
    for col in ("", "n", "min", "p50", "p90", "p99", "max", "mean"):
        d.add_column(col, justify="right")
    for name in ("tokens", "targets", "tiles", "frames", "audio_seconds"):
        r = report[name]
        d.add_row(name, *(f"{r[k]:g}" if k in r else "-" for k in ("n", "min", "p50", "p90", "p99", "max", "mean")))
    console.print(d)
    if report["bad"]:
        b = Table(title="bad records")
        for col in ("kind", "count", "first locations"):
            b.add_column(col)
        for kind, n in report["bad"].items():
            b.add_row(kind, str(n), "\n".join(report["bad_examples"].get(kind, [])[:3]))
        console.print(b)


def _model_args(args: argparse.Namespace) -> argparse.Namespace:
    """``--model`` (as ``plan`` and ``simulate`` spell it: a preset name or an HF checkpoint directory)
    read into the older ``--model-hf`` / ``--preset``; giving two of them is an error."""
    from harmonia.errors import ConfigError
    from harmonia.model.resolve import is_checkpoint_dir

    given = [f for f, v in (("--model", args.model), ("--model-hf", args.model_hf), ("--preset", args.preset)) if v]
    if len(given) > 1:
        raise ConfigError(f"data inspect: give one of --model, --model-hf, --preset, not {' and '.join(given)}")
    if args.model is not None:
        args.model_hf, args.preset = (args.model, None) if is_checkpoint_dir(args.model) else (None, args.model)
    return args


def _open(args: argparse.Namespace) -> tuple[MultimodalDataset, str]:
    from harmonia.model.resolve import resolve_mllm

    args = _model_args(args)
    spec = resolve_mllm(args.preset or args.model_hf or "tiny-omni")
    preprocessors = checkpoint_preprocessors(spec, args.model_hf)
    tok = build_tokenizer(args.model_hf, args.chat_template)
    ds = open_dataset(args.path, spec, tokenizer=tok, format=args.format, max_tokens=args.max_tokens,
                      max_frames=args.max_frames, on_error="skip", media_root=args.media_root,
                      allow_outside_root=args.allow_outside_root, preprocessors=preprocessors)
    what = f"{spec.name} with {'the tokenizer of ' + args.model_hf if args.model_hf else 'the byte tokenizer'}"
    return ds, what


def main(argv: list[str] | None = None) -> None:
    """``harmonia data inspect PATH [--json FILE] [--format F] [--model PRESET|DIR] ...``."""
    import logging

    from rich.console import Console

    p = argparse.ArgumentParser(prog="harmonia data inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="dataset file or directory (manifest, LLaVA JSON/JSONL, messages JSONL, tar "
                   "shards, mixture YAML/JSON)")
    p.add_argument("--json", default=None, help="write the report as JSON to this file")
    p.add_argument("--format", default="auto", help=", ".join(FORMATS[:-1]) + f" or {FORMATS[-1]}")
    p.add_argument("--model", default=None, help="MLLM preset or an HF checkpoint directory (its spec, tokenizer, "
                   "chat template and image processor), as `harmonia plan --model`; default tiny-omni")
    p.add_argument("--model-hf", default=None, help="an HF checkpoint directory (the older spelling of --model DIR)")
    p.add_argument("--preset", default=None, help="an MLLM preset (the older spelling of --model NAME)")
    p.add_argument("--chat-template", default=None, help="a chat template file replacing the checkpoint's")
    p.add_argument("--media-root", default=None, help="media root (default: each annotation file's directory)")
    p.add_argument("--allow-outside-root", action="store_true", help="accept media paths outside the media root")
    p.add_argument("--max-tokens", type=int, default=1 << 20, help="samples longer than this are bad (too_long)")
    p.add_argument("--max-frames", type=int, default=8, help="frames sampled per video")
    p.add_argument("--workers", type=int, default=2, help="decoding worker processes")
    a = p.parse_args(argv)
    console = Console()
    loader_log = logging.getLogger("harmonia.data.loader")
    level = loader_log.level
    loader_log.setLevel(logging.ERROR)  # bad records go in the report instead of one warning each
    try:
        ds, model = _open(a)
        report = inspect_dataset(ds, num_workers=a.workers)
    finally:
        loader_log.setLevel(level)
    print_report(report, console, model)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
        console.print(f"report written to {a.json}", markup=False, highlight=False)
