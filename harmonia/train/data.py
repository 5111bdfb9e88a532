"""The job's dataset: the user's data as they hold it, or the synthetic learnable set.

``data.path`` is any dataset `harmonia.data.sources` reads (harmonia's manifest, LLaVA JSON/JSONL,
messages JSONL, webdataset shards, a mixture file) or the synthetic layout (``train/`` and
``heldout/``). A path that holds no dataset is an error; data is synthesized only where
``data.synthesize`` asks for it, into a directory harmonia creates (marked by `SYNTHETIC_MARKER`):
a user's directory is never written into. Samples are rendered with the model's own tokenizer and
chat template and its processor's media numbers when the model comes from HF checkpoints, and with
the byte tokenizer for presets.

The job's caches of the training split (its media header shapes and rendered token counts) live
under ``checkpoint.dir`` (`data_cache_dir`), never in the user's dataset directory: the launcher's
shape pass writes them, the ranks and a resumed job read them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from harmonia.config import Config
from harmonia.train.planning import model_spec


def tokenizer_dir(config: Config) -> str | None:
    """Where the job's tokenizer lives: the HF checkpoint, or a composition's LLM; None for presets."""
    return config.model.hf or config.model.llm or None


def job_tokenizer(config: Config):
    """The job's `harmonia.data.tokenizer.Tokenizer` (the checkpoint's with its chat template, or bytes)."""
    from harmonia.data.loader import build_tokenizer

    return build_tokenizer(tokenizer_dir(config), config.data.chat_template or None)


def job_preprocessors(config: Config, spec) -> dict:
    """Media preprocessing per encoder: a whole checkpoint's processor (LLaVA's image processor), an
    encoder checkpoint's processor files, or each encoder's family constants for presets."""
    from harmonia.data.media import build_media_preprocessors

    has_processor = ("preprocessor_config.json", "processor_config.json")
    if config.model.hf:
        given = {m: config.model.hf for m, e in spec.encoders.items() if e.is_vision}
    else:
        given = dict(config.model.encoders)
    given = {m: d for m, d in given.items() if any((Path(d) / f).is_file() for f in has_processor)}
    return build_media_preprocessors(spec, given, max_pixels=config.data.max_pixels)


def data_cache_dir(config: Config) -> Path:
    """Where the job caches its training data's shapes and token counts: under ``checkpoint.dir``."""
    return Path(config.checkpoint.dir) / "data-cache"


def _shape_cache(cache_dir: str | Path, dataset: str | Path) -> Path:
    """The shape index cache file of one dataset path inside ``cache_dir``."""
    path = Path(dataset).resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{path.name}-{digest}.shapes.json"


def open_split(config: Config, split: str = "train", spec=None, tokenizer=None, *,
               cache_dir: str | Path | None = None, log_skips: bool = True):
    """The ``train`` or ``heldout`` split of ``data.path`` as a `MultimodalDataset`, or None when the
    dataset has no such split (only the synthetic layout holds one out).

    Args:
        config: the job.
        split: ``train`` or ``heldout``.
        spec: the model spec (default: the config's).
        tokenizer: the job's tokenizer (default: `job_tokenizer`).
        cache_dir: where its shape index and token counts are cached (None: not cached).
        log_skips: log each bad record (False: count them only).
    """
    from harmonia.data.sources import dataset_splits

    train, heldout = dataset_splits(config.data.path)
    path = train if split == "train" else heldout
    if path is None:
        return None
    return _open(config, path, split == "train", spec, tokenizer, cache_dir, log_skips)


def _open(config: Config, path: Path, training: bool, spec, tokenizer, cache_dir, log_skips: bool):
    """The dataset at ``path`` as the job reads its data (`open_split`); bad records of a set it
    does not train on are skipped and counted whatever ``data.on_error`` says."""
    from harmonia.data.loader import open_dataset

    spec = spec or model_spec(config)
    d = config.data
    return open_dataset(path, spec, tokenizer=tokenizer or job_tokenizer(config), format=d.format,
                        max_tokens=d.max_tokens, max_frames=d.max_frames, frames_fps=d.frames_fps or None,
                        on_error=d.on_error if training else "skip",
                        media_root=d.media_root or None, allow_outside_root=d.allow_outside_root,
                        seed=config.train.seed, num_workers=d.num_workers, truncate=d.truncation == "truncate",
                        preprocessors=job_preprocessors(config, spec), log_skips=log_skips,
                        shape_cache=_shape_cache(cache_dir, path) if cache_dir is not None else None)


def open_training_data(config: Config, spec, rank: int):
    """One rank's training set and the shape of every usable sample (dataset index -> `SampleShape`).

    The shape pass reads the caches the launcher's pass wrote and logs nothing (the launcher
    reported its bad records); samples that fail while training are logged by rank 0 only.
    """
    dataset = open_split(config, "train", spec, cache_dir=data_cache_dir(config), log_skips=False)
    shapes = {s.sample_id: s for s in dataset.shapes()}
    dataset.log_skips = rank == 0
    return dataset, shapes


def open_eval_data(config: Config, spec, log_skips: bool = False):
    """The evaluation set of ``train.eval_every`` and the shape of each usable sample: ``data.eval_path``,
    else the held-out split beside a synthesized set; ``(None, {})`` where the job has none. The
    launcher opens it first (`harmonia.train.job.check_eval_data`: its bad records logged there, its
    shapes cached for the ranks, which log nothing)."""
    if config.data.eval_path:
        dataset = _open(config, Path(config.data.eval_path), False, spec, None, data_cache_dir(config), log_skips)
    else:
        dataset = open_split(config, "heldout", spec, cache_dir=data_cache_dir(config), log_skips=log_skips)
    if dataset is None:
        return None, {}
    return dataset, {s.sample_id: s for s in dataset.shapes()}


def check_eval_path(config: Config) -> None:
    """Fail before anything starts where ``train.eval_every`` asks for an evaluation set the job
    lacks, or ``data.eval_path`` holds no dataset.

    Raises:
        ConfigError: naming the path or the missing set.
    """
    from harmonia.data.sources import dataset_splits, is_dataset
    from harmonia.errors import ConfigError

    path = config.data.eval_path
    if path and not Path(path).exists():
        raise ConfigError(f"data.eval_path={path!r} does not exist; point it at a dataset in a format data.path takes")
    if path and not is_dataset(Path(path)):
        raise ConfigError(f"data.eval_path={path!r} is an empty directory; point it at a dataset")
    d = config.data
    held_out = d.heldout > 0 if d.synthesize else (Path(d.path).exists() and dataset_splits(d.path)[1] is not None)
    if config.train.eval_every and not path and not held_out:
        raise ConfigError(f"train.eval_every={config.train.eval_every} evaluates on data.eval_path, which is not set, "
                          f"and data.path={config.data.path!r} holds no held-out split; set data.eval_path")


SYNTHETIC_MARKER = "synthetic.json"
"""The file that marks a directory as a synthetic set harmonia wrote, with what it was written from."""


def synthetic_request(config: Config) -> dict:
    """What ``data.synthesize`` asks for, as recorded in the set's `SYNTHETIC_MARKER` (the model it
    was written for rides along: another model reads the set too, media it has no encoder for
    counted as bad records)."""
    d = config.data
    return {"samples": d.synthesize, "heldout": d.heldout, "seed": config.train.seed, "trace": d.trace}


def check_data_path(config: Config) -> None:
    """Fail before anything is created where ``data.path`` cannot be what the job trains on.

    Without ``data.synthesize`` the path must hold a dataset; with it, the path must not exist yet
    (harmonia creates it) or hold a synthetic set harmonia wrote from the same request.

    Raises:
        ConfigError: naming the path and what to do.
    """
    from harmonia.data.sources import is_dataset
    from harmonia.errors import ConfigError

    root = Path(config.data.path)
    if not config.data.synthesize:
        if not root.exists():
            raise ConfigError(f"data.path={str(root)!r} does not exist; point it at a dataset (a file or directory: "
                              "harmonia manifest, LLaVA JSON/JSONL, messages JSONL, webdataset shards, a mixture), "
                              "or ask for a synthetic set there with data.synthesize=N")
        if not is_dataset(root):
            raise ConfigError(f"data.path={str(root)!r} is an empty directory; point it at a dataset")
        return
    if not root.exists():
        return
    marker = root / SYNTHETIC_MARKER
    if not marker.is_file():
        raise ConfigError(f"data.synthesize={config.data.synthesize} writes a new synthetic set, but "
                          f"data.path={str(root)!r} already exists and is not one harmonia wrote; give a path that "
                          "does not exist yet, or drop data.synthesize to train on what is there")
    written = {k: v for k, v in json.loads(marker.read_text()).items() if k != "model"}
    if written != synthetic_request(config):
        raise ConfigError(f"data.path={str(root)!r} holds a synthetic set written from {written}, not from this "
                          f"job's {synthetic_request(config)}; give another path, or remove that directory")


def prepare_data(config: Config) -> bool:
    """Synthesize the learnable dataset at ``data.path`` where ``data.synthesize`` asks for one and it
    is not there yet; returns whether it did. Call `check_data_path` first."""
    root = Path(config.data.path)
    if not config.data.synthesize or root.exists():
        return False
    from harmonia.data.synth import DEFAULT_MIX, TASK_MODALITY, write_synthetic_dataset

    spec = model_spec(config)
    tile = next((e.image_size for e in spec.encoders.values() if not e.is_audio), 16)
    trace = None
    if config.data.trace:
        from harmonia.workload.traces import load_trace

        trace = load_trace(config.data.trace, n_samples=config.data.synthesize, seed=config.train.seed)
    n = config.data.synthesize + config.data.heldout
    encoded = {m for e in spec.encoders.values() for m in e.modalities}
    mix = {t: w for t, w in DEFAULT_MIX.items() if TASK_MODALITY[t] is None or TASK_MODALITY[t] in encoded}
    fmt = "llava" if config.model.from_checkpoint and encoded <= {"image"} else "harmonia"
    staging = root.with_name(f".{root.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    write_synthetic_dataset(staging, n, seed=config.train.seed, heldout=config.data.heldout / n, mix=mix, trace=trace,
                            tile=tile, fmt=fmt)
    (staging / SYNTHETIC_MARKER).write_text(json.dumps({**synthetic_request(config), "model": str(config.model.source)}))
    staging.rename(root)
    return True
