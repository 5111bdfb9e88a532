"""Audio into Whisper log-mel chunks, with the model's own transformers feature extractor.

- Decoding: soundfile (libsndfile: WAV int16/int32/float32, FLAC, MP3, OGG, ...), PyAV for what
  soundfile refuses (AAC/M4A, Opus, the audio track of an MP4); channels averaged to mono.
- Resampling to the encoder's rate: ``scipy.signal.resample_poly`` with the exact rational ratio (a
  polyphase filter with a Kaiser-windowed anti-aliasing low-pass), ``ceil(n * target / rate)`` samples.
- Features: transformers' ``WhisperFeatureExtractor``, from a checkpoint's ``preprocessor_config.json``
  or built from the encoder spec. A clip is cut into ``chunk_seconds`` chunks, each zero-padded to the
  chunk (as Whisper pads to 30 s) and turned into its own log-mel; without ``chunk_seconds``, one
  sequence of the clip's own length.

Header-only durations equal decoded ones: soundfile's frame count is exact. Decoders behind PyAV may
add priming samples, so PyAV-decoded audio is cut or zero-padded to the duration its container
declares; a difference over `PYAV_SLACK_S` is a ``shape_mismatch``.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harmonia.data.media_errors import MediaError
from harmonia.errors import ConfigError
from harmonia.model.spec import EncoderSpec

PYAV_SLACK_S = 0.1
"""Largest difference between a container's declared duration and its decoded samples, in seconds."""


@dataclass(frozen=True)
class AudioInfo:
    """What an audio file's header says: sample frames, rate and channels."""

    frames: int
    rate: int
    channels: int

    def seconds(self, target_rate: int | None = None) -> float:
        """Duration, after resampling to ``target_rate`` when given (as decoding counts it)."""
        if target_rate is None:
            return self.frames / self.rate
        return resampled_length(self.frames, self.rate, target_rate) / target_rate


def resampled_length(n: int, rate: int, target: int) -> int:
    """Samples `resample` returns for ``n`` samples: ``ceil(n * target / rate)``."""
    return -(-n * target // rate)


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Resample a mono waveform with an anti-aliasing polyphase filter: ``(n,) -> (ceil(n * target / rate),)``."""
    if rate == target:
        return x.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    g = math.gcd(rate, target)
    return resample_poly(x, target // g, rate // g).astype(np.float32)


def _source(data: bytes | str | Path):
    return io.BytesIO(data) if isinstance(data, bytes) else str(data)


def _av_stream(container):
    if not container.streams.audio:
        raise MediaError("unsupported_media", "the file has no audio stream")
    return container.streams.audio[0]


def _av_frames(container, stream) -> int | None:
    """Sample frames the container declares for its first audio stream, or None."""
    if stream.duration is not None and stream.time_base is not None:
        return round(float(stream.duration * stream.time_base) * stream.rate)
    if container.duration is not None:
        return round(container.duration / 1_000_000 * stream.rate)  # AV_TIME_BASE
    return None


def _av_decode(container, stream) -> np.ndarray:
    """All samples of the stream, ``(channels, n)`` float32."""
    import av

    resampler = av.AudioResampler(format="fltp")
    parts = [f.to_ndarray() for frame in container.decode(stream) for f in resampler.resample(frame)]
    parts += [f.to_ndarray() for f in resampler.resample(None)]
    if not parts:
        return np.zeros((stream.channels or 1, 0), np.float32)
    return np.concatenate(parts, axis=1).astype(np.float32)


def _pyav(data: bytes | str | Path, decode: bool) -> tuple[AudioInfo, np.ndarray | None]:
    import av

    try:
        with av.open(_source(data)) as container:
            stream = _av_stream(container)
            frames = _av_frames(container, stream)
            x = _av_decode(container, stream) if decode or frames is None else None
            channels = stream.channels or (x.shape[0] if x is not None else 1)
            info = AudioInfo(frames if frames is not None else x.shape[1], stream.rate, channels)
    except MediaError:
        raise
    except Exception as e:
        raise MediaError("corrupt_media", f"PyAV cannot decode audio: {type(e).__name__}: {e}") from e
    if x is not None:
        x = _fit(x, info)
    return info, x


def _fit(x: np.ndarray, info: AudioInfo) -> np.ndarray:
    """Cut or zero-pad ``(channels, n)`` samples to the declared frame count."""
    n = x.shape[1]
    if abs(n - info.frames) > PYAV_SLACK_S * info.rate:
        raise MediaError("shape_mismatch", f"the container declares {info.frames / info.rate:.3f} s of audio but "
                         f"{n / info.rate:.3f} s decode; re-encode the file")
    if n >= info.frames:
        return x[:, :info.frames]
    return np.pad(x, ((0, 0), (0, info.frames - n)))


def _soundfile(data: bytes | str | Path, decode: bool) -> tuple[AudioInfo, np.ndarray | None]:
    import soundfile as sf

    if not decode:
        i = sf.info(_source(data))
        return AudioInfo(i.frames, i.samplerate, i.channels), None
    x, rate = sf.read(_source(data), dtype="float32", always_2d=True)  # (n, channels)
    return AudioInfo(x.shape[0], rate, x.shape[1]), x.T


def _read(data: bytes | str | Path, decode: bool) -> tuple[AudioInfo, np.ndarray | None]:
    try:
        info, x = _soundfile(data, decode)
    except Exception as sf_error:
        try:
            info, x = _pyav(data, decode)
        except MediaError as e:
            raise MediaError(e.kind, f"{e} (soundfile: {type(sf_error).__name__}: {sf_error})") from e
    if info.frames <= 0 or info.rate <= 0:
        raise MediaError("corrupt_media", f"audio has {info.frames} samples at {info.rate} Hz; nothing to encode")
    return info, x


def audio_header(data: bytes | str | Path) -> AudioInfo:
    """Frames, rate and channels from the header (soundfile), or the container (PyAV); no decode."""
    return _read(data, decode=False)[0]


def decode_audio(data: bytes | str | Path) -> tuple[np.ndarray, int]:
    """A mono float32 waveform (channels averaged) and its sample rate.

    Raises:
        MediaError: ``corrupt_media`` when neither soundfile nor PyAV decodes it.
    """
    info, x = _read(data, decode=True)
    return x.mean(axis=0).astype(np.float32), info.rate


class AudioPreprocessor:
    """Waveforms into the ``(n_chunks, n_mels, frames)`` log-mel chunks an audio encoder takes.

    Args:
        extractor: the model's ``WhisperFeatureExtractor``.
        chunk_seconds: the encoder's chunk length (None: one sequence of the clip's own length).
    """

    def __init__(self, extractor, chunk_seconds: float | None) -> None:
        from transformers import WhisperFeatureExtractor

        if not isinstance(extractor, WhisperFeatureExtractor):
            raise ConfigError(f"audio feature extractor {type(extractor).__name__} is not a WhisperFeatureExtractor; "
                              "harmonia's audio encoder takes Whisper log-mel features")
        self.extractor, self.chunk_seconds = extractor, chunk_seconds
        self.rate: int = extractor.sampling_rate

    @classmethod
    def for_encoder(cls, encoder: EncoderSpec) -> AudioPreprocessor:
        """Whisper's feature extractor with the spec's mels, rate and hop (``n_fft = 2.5 hop``: 400 at 160)."""
        from transformers import WhisperFeatureExtractor

        chunk = encoder.chunk_seconds
        extractor = WhisperFeatureExtractor(
            feature_size=encoder.n_mels, sampling_rate=encoder.sample_rate, hop_length=encoder.hop_length,
            chunk_length=int(chunk) if chunk is not None and float(chunk).is_integer() else 30,
            n_fft=round(2.5 * encoder.hop_length),
        )
        return cls(extractor, chunk)

    @classmethod
    def from_pretrained(cls, path: str | Path, encoder: EncoderSpec) -> AudioPreprocessor:
        """The checkpoint's own feature extractor (``preprocessor_config.json``), checked against the spec."""
        from transformers import AutoFeatureExtractor

        if not (Path(path) / "preprocessor_config.json").is_file():
            raise ConfigError(f"{path} has no preprocessor_config.json: the audio features of a checkpoint come "
                              "from it (save the model's feature extractor there)")
        fe = AutoFeatureExtractor.from_pretrained(str(path), local_files_only=True)
        theirs = {"n_mels": getattr(fe, "feature_size", None), "sample_rate": getattr(fe, "sampling_rate", None),
                  "hop_length": getattr(fe, "hop_length", None), "chunk_seconds": getattr(fe, "chunk_length", None)}
        ours = {k: getattr(encoder, k) for k in theirs}
        if theirs != ours:
            raise ConfigError(f"{path}/preprocessor_config.json gives {theirs} but encoder {encoder.name!r} has "
                              f"{ours}; the encoder spec must match its checkpoint's feature extractor")
        return cls(fe, encoder.chunk_seconds)

    def n_chunks(self, seconds: float) -> int:
        """Chunks of a clip of ``seconds`` (at this rate), as `features` returns them."""
        return 1 if self.chunk_seconds is None else math.ceil(seconds / self.chunk_seconds)

    def features(self, x: np.ndarray) -> torch.Tensor:
        """A mono waveform at ``self.rate`` -> ``(n_chunks, n_mels, frames)`` float32 log-mel."""
        x = np.asarray(x, dtype=np.float32)
        if self.chunk_seconds is None:
            out = self.extractor(x, sampling_rate=self.rate, padding="longest", truncation=False,
                                 return_tensors="pt")
            return out["input_features"].float()
        n = round(self.chunk_seconds * self.rate)
        k = self.n_chunks(len(x) / self.rate)
        pieces = [x[i * n:(i + 1) * n] for i in range(k)]
        out = self.extractor(pieces, sampling_rate=self.rate, padding="max_length", max_length=n, truncation=True,
                             return_tensors="pt")
        return out["input_features"].float()

    def __call__(self, x: np.ndarray, rate: int) -> tuple[torch.Tensor, float]:
        """A mono waveform at ``rate`` -> its log-mel chunks and its duration in seconds at ``self.rate``."""
        y = resample(x, rate, self.rate)
        return self.features(y), len(y) / self.rate
