"""Decoding media into encoder inputs: image tiles, video frames, audio log-mel chunks.

Every function here produces exactly the sequences `harmonia.workload.shapes.encoder_sequences` counts
for the same item, so the shapes the scheduler plans with are the tensors the executor receives.

- Images: InternVL dynamic tiling (the grid closest to the aspect ratio, plus a thumbnail when there
  is more than one tile), each tile ``image_size`` square, scaled to [-1, 1].
- Video: ``frames`` sampled uniformly, one tile per frame.
- Audio: mono float waveform, resampled to the encoder's rate, cut into ``chunk_seconds`` chunks
  (the last zero-padded, as Whisper does), each turned into a Whisper-style log-mel spectrogram.
"""

from __future__ import annotations

import io
import math
import wave
from pathlib import Path

import numpy as np
import torch

from harmonia.errors import SampleError
from harmonia.model.spec import EncoderSpec
from harmonia.workload.shapes import ModalityItem, find_tile_grid


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - pillow ships with matplotlib
        raise SampleError("reading images needs Pillow: pip install pillow") from e
    return Image


def open_image(data: bytes | str | Path):
    """A PIL image (RGB) from bytes or a path; raises `SampleError` on unreadable data."""
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        img.load()
        return img.convert("RGB")
    except Exception as e:
        raise SampleError(f"cannot decode image: {type(e).__name__}: {e}") from e


def image_size(data: bytes | str | Path) -> tuple[int, int]:
    """``(height, width)`` from the header only (no pixel decode)."""
    Image = _pil()
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as img:
            return img.height, img.width
    except Exception as e:
        raise SampleError(f"cannot read image header: {type(e).__name__}: {e}") from e


def _to_tensor(img) -> torch.Tensor:
    """PIL RGB -> ``(3, H, W)`` float in [-1, 1]."""
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float()
    return x / 127.5 - 1.0


def tile_image(img, encoder: EncoderSpec) -> torch.Tensor:
    """Cut an image into tiles: ``(n_tiles, 3, S, S)`` with ``S = encoder.image_size``."""
    S = encoder.image_size
    cols, rows = find_tile_grid(img.height, img.width, S, encoder.max_tiles)
    big = img.resize((cols * S, rows * S))
    tiles = [_to_tensor(big.crop((c * S, r * S, (c + 1) * S, (r + 1) * S))) for r in range(rows) for c in range(cols)]
    if len(tiles) > 1:
        tiles.append(_to_tensor(img.resize((S, S))))  # thumbnail
    return torch.stack(tiles)


def frame_tiles(frames: list, encoder: EncoderSpec) -> torch.Tensor:
    """One resized tile per video frame: ``(n_frames, 3, S, S)``."""
    S = encoder.image_size
    return torch.stack([_to_tensor(f.resize((S, S))) for f in frames])


def sample_frame_indices(n_available: int, max_frames: int) -> list[int]:
    """Uniformly spaced frame indices (centres of ``max_frames`` equal segments)."""
    n = min(n_available, max_frames)
    return [int((i + 0.5) * n_available / n) for i in range(n)]


def read_wav(data: bytes | str | Path) -> tuple[np.ndarray, int]:
    """Mono float32 waveform in [-1, 1] and its sample rate from 8/16/32-bit PCM WAV."""
    try:
        with wave.open(io.BytesIO(data) if isinstance(data, bytes) else str(data), "rb") as w:
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            raw = w.readframes(w.getnframes())
    except Exception as e:
        raise SampleError(f"cannot decode WAV audio: {type(e).__name__}: {e}") from e
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}.get(width)
    if dtype is None:
        raise SampleError(f"WAV sample width {width} bytes unsupported; use 8/16/32-bit PCM")
    x = np.frombuffer(raw, dtype=dtype).astype(np.float32)
    x = (x - 128.0) / 128.0 if width == 1 else x / float(np.iinfo(dtype).max)
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1)
    if x.size == 0:
        raise SampleError("WAV audio has no samples")
    return x, rate


def wav_seconds(data: bytes | str | Path, target_rate: int | None = None) -> float:
    """Duration from the WAV header (after resampling to ``target_rate``, as `audio_chunks` counts it)."""
    try:
        with wave.open(io.BytesIO(data) if isinstance(data, bytes) else str(data), "rb") as w:
            n, rate = w.getnframes(), w.getframerate()
            if n == 0:
                raise SampleError("WAV audio has no samples")
            if target_rate is None or target_rate == rate:
                return n / rate
            return round(n * target_rate / rate) / target_rate
    except SampleError:
        raise
    except Exception as e:
        raise SampleError(f"cannot read WAV header: {type(e).__name__}: {e}") from e


def write_wav(path: str | Path | io.BytesIO, x: np.ndarray, rate: int) -> None:
    """16-bit PCM mono WAV to a path or a binary file object."""
    pcm = (np.clip(x, -1, 1) * 32767).astype(np.int16)
    with wave.open(path if isinstance(path, io.BytesIO) else str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Linear-interpolation resampling (enough for features; use a proper filter upstream for quality)."""
    if rate == target:
        return x
    n = round(len(x) * target / rate)
    return np.interp(np.linspace(0, len(x) - 1, n), np.arange(len(x)), x).astype(np.float32)


def mel_filters(n_mels: int, n_fft: int, rate: int) -> torch.Tensor:
    """Triangular filters on the HTK mel scale, area-normalised: ``(n_mels, n_fft // 2 + 1)``."""
    def to_mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def to_hz(m):
        return 700.0 * (10 ** (m / 2595.0) - 1.0)

    freqs = np.linspace(0, rate / 2, n_fft // 2 + 1)
    edges = to_hz(np.linspace(to_mel(0.0), to_mel(rate / 2), n_mels + 2))
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    fb = np.maximum(0, np.minimum((freqs - lower) / (centre - lower), (upper - freqs) / (upper - centre)))
    fb *= (2.0 / (upper - lower))
    return torch.from_numpy(fb.astype(np.float32))


def log_mel(x: torch.Tensor, encoder: EncoderSpec) -> torch.Tensor:
    """Whisper-style log-mel of a waveform: ``(samples,) -> (n_mels, samples // hop_length)``.

    STFT with a Hann window of ``n_fft = 2.5 * hop`` (400 at hop 160), power spectrum, mel filters,
    ``log10`` clamped to 8 below the maximum, then ``(x + 4) / 4``.
    """
    hop = encoder.hop_length
    n_fft = round(2.5 * hop)
    spec = torch.stft(x, n_fft, hop, window=torch.hann_window(n_fft), return_complex=True)
    power = spec[..., :-1].abs() ** 2  # (n_fft/2+1, samples // hop)
    mel = mel_filters(encoder.n_mels, n_fft, encoder.sample_rate) @ power
    logm = torch.clamp(mel, min=1e-10).log10()
    logm = torch.maximum(logm, logm.max() - 8.0)
    return (logm + 4.0) / 4.0


def audio_chunks(x: np.ndarray, rate: int, encoder: EncoderSpec) -> tuple[torch.Tensor, ModalityItem]:
    """Waveform -> ``(n_chunks, n_mels, frames)`` log-mel chunks and the item's shape.

    With ``chunk_seconds`` the clip is cut into ``ceil(seconds / chunk_seconds)`` chunks, the last
    zero-padded; without it, one chunk of the clip's own length.
    """
    x = resample(x, rate, encoder.sample_rate)
    seconds = len(x) / encoder.sample_rate
    item = ModalityItem.audio(seconds)
    if encoder.chunk_seconds is None:
        return log_mel(torch.from_numpy(x), encoder)[None], item
    chunk = round(encoder.chunk_seconds * encoder.sample_rate)
    n = math.ceil(item.seconds / encoder.chunk_seconds)
    padded = np.zeros(n * chunk, dtype=np.float32)
    padded[: len(x)] = x[: n * chunk]
    return torch.stack([log_mel(torch.from_numpy(padded[i * chunk:(i + 1) * chunk]), encoder) for i in range(n)]), item
