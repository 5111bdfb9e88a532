"""Shape index speed: header-only shapes of a 100k-record dataset, cold (read headers) and warm (cached).

The dataset reuses 200 distinct small media files (PNG, WAV, FLAC, MP3, MP4) across 100k records, as
captioning and QA sets reuse their images; the index reads each distinct file once. A second dataset
gives every record its own file (5k records), to show the per-file header cost without that reuse.

    python benchmarks/data_index.py
"""

from __future__ import annotations

import datetime
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import soundfile as sf
from PIL import Image
from rich.console import Console
from rich.table import Table

from harmonia.data.shape_index import MediaFile, build_shape_index, shape_cache_path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"png": "image", "wav": "audio", "flac": "audio", "mp3": "audio", "mp4": "video"}


def _mp4(path: Path, frames: int) -> None:
    with av.open(str(path), "w", format="mp4") as out:
        s = out.add_stream("mpeg4", rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            img = np.full((48, 64, 3), 20 * i % 255, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in s.encode(None):
            out.mux(p)


def write_media(root: Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` small media files: 60% PNG, 20% WAV, 10% FLAC, 5% MP3, 5% MP4."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    plan = ["png"] * 12 + ["wav"] * 4 + ["flac"] * 2 + ["mp3", "mp4"]
    out = []
    for i in range(n):
        ext = plan[i % len(plan)]
        path = root / f"m{i:06d}.{ext}"
        if ext == "png":
            h, w = (int(v) for v in rng.integers(16, 256, 2))
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
        elif ext == "mp4":
            _mp4(path, int(rng.integers(5, 30)))
        else:
            x = 0.1 * rng.standard_normal(int(rng.integers(4000, 32000))).astype(np.float32)
            sf.write(path, x, 16000, format=ext.upper(), subtype="MPEG_LAYER_III" if ext == "mp3" else "PCM_16")
        out.append(path)
    return out


def write_manifest(root: Path, media: list[Path], n_records: int, seed: int = 0) -> tuple[Path, list[list[MediaFile]]]:
    """A JSONL manifest of ``n_records`` records, each naming one or two of ``media``, and its index items."""
    rng = np.random.default_rng(seed)
    items, lines = [], []
    for r in range(n_records):
        picks = [media[r % len(media)]] + ([media[int(rng.integers(len(media)))]] if r % 4 == 0 else [])
        items.append([MediaFile(KINDS[p.suffix[1:]], str(p)) for p in picks])
        lines.append(json.dumps({"id": r, "media": [{"type": KINDS[p.suffix[1:]], "path": p.name} for p in picks]}))
    manifest = root / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest, items


def best_of(fn, before=lambda: None, repeats: int = 3) -> tuple[float, object]:
    """Least wall time of ``repeats`` runs of ``fn`` (``before`` runs untimed before each) and its result."""
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> int:
    console = Console(record=True, width=120)
    table = Table(title=f"shape index: header-only media shapes, best of 3 ({os.cpu_count()} CPU cores, "
                        f"load average {os.getloadavg()[0]:.1f} at start)")
    for col in ("dataset", "run", "workers", "seconds", "records/s", "distinct files/s"):
        table.add_column(col)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = []
        media = write_media(tmp / "reused" / "media", 200)
        cases.append(("100k records, 200 files", *write_manifest(tmp / "reused", media, 100_000), 200))
        media = write_media(tmp / "distinct" / "media", 5_000, seed=1)
        cases.append(("5k records, 5k files", *write_manifest(tmp / "distinct", media, 5_000), 5_000))
        for name, manifest, items, n_files in cases:
            cache = shape_cache_path(manifest)
            for workers in (0, 2):
                secs, cold = best_of(lambda: build_shape_index(items, workers, cache, manifest, progress=False),
                                     before=lambda: cache.unlink(missing_ok=True))
                table.add_row(name, "cold", str(workers), f"{secs:.2f}", f"{len(items) / secs:,.0f}",
                              f"{n_files / secs:,.0f}")
            secs, warm = best_of(lambda: build_shape_index(items, 0, cache, manifest, progress=False))
            assert warm == cold and not any("error" in s for rec in cold for s in rec)
            table.add_row(name, "warm (cached)", "-", f"{secs:.2f}", f"{len(items) / secs:,.0f}", "")
    console.print(table)
    out = ROOT / "benchmarks" / "results" / f"data-index-{datetime.date.today()}.txt"
    out.write_text(console.export_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
