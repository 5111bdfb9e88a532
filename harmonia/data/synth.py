"""A synthetic, learnable multimodal dataset written to disk in the real dataset format.

Each task's answer depends on its media, so held-out accuracy above the best media-blind guess shows
that the encoders, projectors and the splice into the LLM sequence all work:

- ``colour`` (image): a large square of one of five colours; "What colour is the square?"
- ``count`` (image): 1-4 small squares; "How many squares?"
- ``pitch`` (audio): a low / mid / high tone of varied length; "Is the tone low, mid or high?"
- ``direction`` (video): a dot moving left or right over 4 frames; "Which way does the dot move?"
- ``arith`` (text only): "What is 3+4?"

Image sizes vary (so tile counts vary); with a trace, each sample copies the modality, tile count,
frame count or audio length of a trace sample, so the size mix follows the trace.

Run ``python -m harmonia.data.synth OUT --n 2000`` (manifest + files) or add ``--shards 4`` (tar).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np

from harmonia.data.media import _pil, write_wav
from harmonia.errors import ConfigError
from harmonia.workload.shapes import SampleShape

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
           "purple": (150, 60, 200)}
PITCHES = {"low": 300.0, "mid": 1200.0, "high": 4000.0}
TASK_ANSWERS: dict[str, tuple[str, ...]] = {
    "colour": tuple(COLOURS), "count": ("1", "2", "3", "4"), "pitch": tuple(PITCHES),
    "direction": ("left", "right"), "arith": tuple(str(i) for i in range(9)),
}
DEFAULT_MIX = {"colour": 0.3, "count": 0.15, "pitch": 0.2, "direction": 0.15, "arith": 0.2}
TASK_MODALITY: dict[str, str | None] = {"colour": "image", "count": "image", "pitch": "audio", "direction": "video",
                                        "arith": None}
_TASK_OF_MODALITY = {"image": "colour", "video": "direction", "audio": "pitch"}


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    _pil().fromarray(arr.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _image_dims(rng: np.random.Generator, tile: int, tiles: int | None) -> tuple[int, int]:
    """(height, width): a grid of about ``tiles`` tiles (a thumbnail is added beyond one), or random."""
    if tiles is None:
        return int(rng.integers(tile, 4 * tile + 1)), int(rng.integers(tile, 4 * tile + 1))
    n = max(1, tiles - 1 if tiles > 1 else 1)
    cols = int(rng.integers(1, n + 1))
    rows = max(1, round(n / cols))
    return rows * tile, cols * tile


def _colour_image(rng, h, w) -> tuple[np.ndarray, str]:
    name = str(rng.choice(list(COLOURS)))
    img = np.full((h, w, 3), rng.integers(90, 140), dtype=np.int64)
    y0, x0 = h // 6, w // 6
    img[y0:h - y0, x0:w - x0] = COLOURS[name]
    return img, name


def _count_image(rng, h, w) -> tuple[np.ndarray, str]:
    k = int(rng.integers(1, 5))
    img = np.zeros((h, w, 3), dtype=np.int64)
    side = max(2, min(h, w) // 5)
    cells = rng.permutation(4)[:k]  # one square per quadrant, so they never overlap
    for c in cells:
        cy, cx = (c // 2) * h // 2, (c % 2) * w // 2
        y = cy + int(rng.integers(0, max(1, h // 2 - side)))
        x = cx + int(rng.integers(0, max(1, w // 2 - side)))
        img[y:y + side, x:x + side] = 255
    return img, str(k)


def _tone(rng, seconds: float, rate: int) -> tuple[np.ndarray, str]:
    name = str(rng.choice(list(PITCHES)))
    t = np.arange(int(seconds * rate)) / rate
    x = 0.5 * np.sin(2 * np.pi * PITCHES[name] * t) + 0.02 * rng.standard_normal(t.size)
    return x.astype(np.float32), name


def _moving_dot(rng, frames: int, side: int) -> tuple[list[np.ndarray], str]:
    name = str(rng.choice(["left", "right"]))
    y = int(rng.integers(side // 4, 3 * side // 4))
    r = max(1, side // 8)
    out = []
    for f in range(frames):
        x = int((f + 0.5) / frames * side)
        x = x if name == "right" else side - 1 - x
        img = np.zeros((side, side, 3), dtype=np.int64)
        img[max(0, y - r):y + r, max(0, x - r):x + r] = 255
        out.append(img)
    return out, name


def make_sample(rng: np.random.Generator, key: str, task: str, tile: int = 16, rate: int = 16000,
                like: SampleShape | None = None) -> tuple[dict, dict[str, bytes]]:
    """One record (media paths relative to its root) and its files by path."""
    item = like.items[0] if like is not None and like.items else None
    files: dict[str, bytes] = {}
    if task in ("colour", "count"):
        h, w = _image_dims(rng, tile, item.tiles if item is not None else None)
        img, answer = (_colour_image if task == "colour" else _count_image)(rng, h, w)
        files[f"{key}.png"] = _png(img)
        question = "What colour is the square?" if task == "colour" else "How many squares?"
        media = [{"type": "image", "path": f"{key}.png"}]
        prompt = f"<image>\n{question}"
    elif task == "pitch":
        seconds = item.seconds if item is not None and item.seconds else float(rng.uniform(0.5, 3.0))
        x, answer = _tone(rng, min(seconds, 30.0), rate)
        buf = io.BytesIO()
        write_wav(buf, x, rate)
        files[f"{key}.wav"] = buf.getvalue()
        media = [{"type": "audio", "path": f"{key}.wav"}]
        prompt = "<audio>\nIs the tone low, mid or high?"
    elif task == "direction":
        frames = min(item.frames or 4, 8) if item is not None and item.frames else 4
        imgs, answer = _moving_dot(rng, max(frames, 2), 2 * tile)
        names = [f"{key}.f{i}.png" for i in range(len(imgs))]
        files.update({n: _png(im) for n, im in zip(names, imgs)})
        media = [{"type": "video", "frames": names}]
        prompt = "<video>\nWhich way does the dot move?"
    elif task == "arith":
        a, b = int(rng.integers(0, 5)), int(rng.integers(0, 5))
        media, prompt, answer = [], f"What is {a}+{b}?", str(a + b)
    else:
        raise ConfigError(f"unknown synthetic task {task!r}; tasks are {sorted(TASK_ANSWERS)}")
    return {"id": key, "task": task, "prompt": prompt, "answer": answer, "media": media}, files


LLAVA_TASKS = tuple(t for t, m in TASK_MODALITY.items() if m in (None, "image"))  # no audio, no video


def _write_llava(out: Path, records: list[tuple[dict, dict[str, bytes]]]) -> None:
    """``out/llava.json`` (a JSON list in LLaVA's format: ``image``, ``conversations`` human/gpt) and
    ``out/images/``; the task is kept as an extra field for evaluation."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for rec, files in records:
        for name, data in files.items():
            (out / "images" / name).write_bytes(data)
        row = {"id": rec["id"], "task": rec["task"],
               "conversations": [{"from": "human", "value": rec["prompt"]}, {"from": "gpt", "value": rec["answer"]}]}
        if rec["media"]:
            row["image"] = f"images/{rec['media'][0]['path']}"
        rows.append(row)
    (out / "llava.json").write_text(json.dumps(rows, indent=1))


def _write_split(out: Path, records: list[tuple[dict, dict[str, bytes]]], shards: int, fmt: str = "harmonia") -> None:
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "llava":
        _write_llava(out, records)
        return
    if shards <= 0:
        (out / "media").mkdir(exist_ok=True)
        with open(out / "manifest.jsonl", "w") as f:
            for rec, files in records:
                for name, data in files.items():
                    (out / "media" / name).write_bytes(data)
                rec = json.loads(json.dumps(rec))
                for m in rec["media"]:
                    if "path" in m:
                        m["path"] = f"media/{m['path']}"
                    if "frames" in m:
                        m["frames"] = [f"media/{n}" for n in m["frames"]]
                f.write(json.dumps(rec) + "\n")
        return
    per = math.ceil(len(records) / shards)
    for s in range(shards):
        with tarfile.open(out / f"shard-{s:05d}.tar", "w") as tar:
            for rec, files in records[s * per:(s + 1) * per]:
                for name, data in {f"{rec['id']}.json": json.dumps(rec).encode(), **files}.items():
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def write_synthetic_dataset(out: str | Path, n_samples: int, seed: int = 0, heldout: float = 0.1,
                            mix: dict[str, float] | None = None, trace: list[SampleShape] | None = None,
                            tile: int = 16, shards: int = 0, fmt: str = "harmonia") -> Path:
    """Write ``out/train`` and ``out/heldout`` (manifest + media, or ``shards`` tar files each).

    Args:
        out: output directory.
        n_samples: samples in total (``heldout`` of them held out).
        seed: random seed.
        mix: task -> weight (default `DEFAULT_MIX`); with ``trace``, only the colour/count split of
            image samples follows it.
        trace: sample shapes whose modality and sizes the samples copy (cycled).
        tile: the vision encoder's ``image_size``; images are whole multiples of it.
        shards: tar shards per split; 0 writes a manifest and files.
        fmt: ``harmonia`` (manifest or shards) or ``llava`` (``llava.json`` and ``images/`` per split;
            image and text tasks only).
    """
    if fmt not in ("harmonia", "llava"):
        raise ConfigError(f"synthetic dataset format {fmt!r}: expected harmonia or llava")
    rng = np.random.default_rng(seed)
    mix = mix or (DEFAULT_MIX if fmt == "harmonia" else {"colour": 0.45, "count": 0.3, "arith": 0.25})
    if fmt == "llava" and set(mix) - set(LLAVA_TASKS):
        raise ConfigError(f"a LLaVA dataset holds the tasks {LLAVA_TASKS} only, not {sorted(set(mix) - set(LLAVA_TASKS))}")
    unknown = set(mix) - set(TASK_ANSWERS)
    if unknown:
        raise ConfigError(f"unknown tasks {sorted(unknown)} in mix; tasks are {sorted(TASK_ANSWERS)}")
    tasks, weights = list(mix), np.array(list(mix.values()), dtype=float)
    samples = []
    for i in range(n_samples):
        like = trace[i % len(trace)] if trace else None
        if like is not None:
            task = _TASK_OF_MODALITY[like.items[0].modality] if like.items else "arith"
            image_tasks = {t: mix.get(t, 0.0) for t in ("colour", "count")}
            if task == "colour" and sum(image_tasks.values()) > 0:
                task = "count" if rng.random() * sum(image_tasks.values()) < image_tasks["count"] else "colour"
        else:
            task = tasks[int(rng.choice(len(tasks), p=weights / weights.sum()))]
        samples.append(make_sample(rng, f"s{i:06d}", task, tile, like=like))
    others = sorted({rec["task"] for rec, _ in samples} - set(LLAVA_TASKS)) if fmt == "llava" else []
    if others:  # refused before anything is written
        raise ConfigError(f"a LLaVA dataset holds the tasks {LLAVA_TASKS} only, but the trace asks for {others} "
                          "(videos, audio); write it in the harmonia format (--format harmonia), or use a trace of "
                          "images and text")
    n_held = round(n_samples * heldout)
    out = Path(out)
    _write_split(out / "train", samples[n_held:], shards, fmt)
    _write_split(out / "heldout", samples[:n_held], shards, fmt)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m harmonia.data.synth OUT [--n N] [--seed S] [--trace SPEC] [--shards K]``."""
    p = argparse.ArgumentParser(prog="harmonia data synth", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="output directory (train/ and heldout/ are written inside)")
    p.add_argument("--n", type=int, default=2000, help="number of samples")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--heldout", type=float, default=0.1, help="fraction held out for evaluation")
    p.add_argument("--trace", default=None, help="trace spec whose size mix to follow (see harmonia workload)")
    p.add_argument("--tile", type=int, default=16, help="vision tile size in pixels (encoder image_size)")
    p.add_argument("--shards", type=int, default=0, help="tar shards per split; 0 = manifest + files")
    p.add_argument("--format", default="harmonia", choices=("harmonia", "llava"),
                   help="harmonia's manifest (all tasks) or LLaVA JSON (image and text tasks)")
    a = p.parse_args(argv)
    trace = None
    if a.trace:
        from harmonia.workload.traces import load_trace

        trace = load_trace(a.trace, n_samples=a.n, seed=a.seed)
    path = write_synthetic_dataset(a.out, a.n, a.seed, a.heldout, trace=trace, tile=a.tile, shards=a.shards,
                                  fmt=a.format)
    print(f"wrote {a.n} samples to {path}/train and {path}/heldout")


if __name__ == "__main__":
    main()
