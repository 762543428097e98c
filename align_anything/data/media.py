"""Media references in records (images, audio) and their lazy decoding.

Records keep references, never decoded media: an image is a file path (relative to the dataset
file's folder, or absolute), raw bytes, or a ``{"path": ..., "bytes": ...}`` dict (the layout
`datasets` uses for undecoded images); audio is a WAV file path, a ``{"path": ...}`` dict, or
``{"array": [...], "sampling_rate": N}``. Decoding happens per batch in the collate step.

`probe_image` / `probe_audio` read only what a data check needs (an image's header for its size,
a WAV header for its length), so the check over every row at data preparation is cheap and
loads nothing into memory.
"""

from __future__ import annotations

import io
import wave
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Record keys that hold media, and the modality each holds.
MEDIA_KEYS = {"images": "image", "audio": "audio"}


class MediaUnreadable(Exception):
    """A media reference that points at nothing or cannot be decoded; the message says why."""


def as_list(value: Any) -> list[Any]:
    """A record's media value as a list (one item or a list of items; None is no media)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _resolve(path: str, base_dir: Path | None) -> Path:
    candidate = Path(path).expanduser()
    if not candidate.is_absolute() and base_dir is not None:
        candidate = base_dir / candidate
    return candidate


def describe(ref: Any) -> str:
    """A short human name for a media reference (its path, or what kind of embedded data)."""
    if isinstance(ref, str):
        return ref
    if isinstance(ref, Mapping):
        if ref.get("path"):
            return str(ref["path"])
        if ref.get("bytes") is not None:
            return f"embedded bytes ({len(ref['bytes'])} B)"
        if ref.get("array") is not None:
            return f"embedded array ({len(ref['array'])} samples)"
    if isinstance(ref, (bytes, bytearray)):
        return f"embedded bytes ({len(ref)} B)"
    return type(ref).__name__


def _image_source(ref: Any, base_dir: Path | None) -> Any:
    """A file path or a bytes buffer PIL can open."""
    if isinstance(ref, Mapping):
        if ref.get("bytes") is not None:
            return io.BytesIO(ref["bytes"])
        ref = ref.get("path")
    if isinstance(ref, (bytes, bytearray)):
        return io.BytesIO(bytes(ref))
    if isinstance(ref, str) and ref:
        return _existing_file(_resolve(ref, base_dir), "image")
    raise MediaUnreadable(f"image reference {describe(ref)!r} is neither a path nor bytes")


def _existing_file(path: Path, kind: str) -> Path:
    if path.is_dir():
        raise MediaUnreadable(f"{kind} path {path} is a folder, not a file")
    if not path.is_file():
        raise MediaUnreadable(f"{kind} file {path} does not exist")
    return path


# How much of a JPEG's end is searched for its end-of-image marker (FF D9).
JPEG_TAIL = 1024


def _jpeg_is_whole(source: Any) -> bool:
    """Whether a JPEG ends with its end-of-image marker (a cut file ends inside its data, where
    FF D9 cannot occur: 0xFF is stuffed there). A marker followed by more than `JPEG_TAIL`
    bytes of padding is not found here; `probe_image` then decodes the image instead."""
    if isinstance(source, io.BytesIO):
        tail = source.getvalue()[-JPEG_TAIL:]
    else:
        with open(source, "rb") as handle:
            handle.seek(max(0, handle.seek(0, io.SEEK_END) - JPEG_TAIL))
            tail = handle.read()
    return b"\xff\xd9" in tail


def probe_image(ref: Any, base_dir: Path | None) -> tuple[int, int]:
    """(width, height) from the image header, after checking that the file is whole without
    decoding it: a PNG's chunks and checksums (PIL's `verify`), a JPEG's end marker (where it
    is missing, the image is decoded). Raises `MediaUnreadable`."""
    from PIL import Image, UnidentifiedImageError

    source = _image_source(ref, base_dir)
    try:
        with Image.open(source) as image:  # reads the header, not the pixels
            size, kind = image.size, image.format
            if kind == "PNG":
                image.verify()
        if kind == "JPEG" and not _jpeg_is_whole(source):
            if isinstance(source, io.BytesIO):
                source.seek(0)
            with Image.open(source) as image:
                image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as err:  # verify raises SyntaxError
        raise MediaUnreadable(f"image {describe(ref)} cannot be read: {err}") from None
    return size


def load_image(ref: Any, base_dir: Path | None) -> Any:
    """The decoded RGB image (PIL)."""
    from PIL import Image

    source = _image_source(ref, base_dir)
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except OSError as err:
        raise MediaUnreadable(f"image {describe(ref)} cannot be decoded: {err}") from None


def _wav_path(ref: Any, base_dir: Path | None) -> Path:
    path_value = ref.get("path") if isinstance(ref, Mapping) else ref
    if not isinstance(path_value, str) or not path_value:
        raise MediaUnreadable(
            f"audio reference {describe(ref)!r} is neither a path nor "
            "{'array': [...], 'sampling_rate': N}"
        )
    path = _existing_file(_resolve(path_value, base_dir), "audio")
    if path.suffix.lower() != ".wav":
        raise MediaUnreadable(
            f"audio file {path}: only WAV files are read (no extra decoder needed); convert "
            "it to WAV or give {'array': [...], 'sampling_rate': N}"
        )
    return path


def probe_audio(ref: Any, base_dir: Path | None) -> tuple[int, int]:
    """(number of samples, sampling rate) from a WAV header or an embedded array."""
    if isinstance(ref, Mapping) and ref.get("array") is not None:
        rate = ref.get("sampling_rate")
        if not isinstance(rate, int) or rate <= 0:
            raise MediaUnreadable("embedded audio array without a positive integer 'sampling_rate'")
        return len(ref["array"]), rate
    path = _wav_path(ref, base_dir)
    try:
        with wave.open(str(path), "rb") as wav:
            return wav.getnframes(), wav.getframerate()
    except (wave.Error, EOFError, OSError) as err:
        raise MediaUnreadable(f"audio file {path} cannot be read as WAV: {err}") from None


def resample(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Linear-interpolation resampling. Written here because the libraries that do it well
    (librosa, torchaudio, scipy) are not dependencies; for speech features at 16 kHz the
    difference is below what the mel filterbank resolves."""
    if rate == target_rate:
        return samples
    n_out = target_samples(len(samples), rate, target_rate)
    positions = np.arange(n_out) * (rate / target_rate)
    return np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)


def target_samples(n: int, rate: int, target_rate: int) -> int:
    """How many samples `n` samples at `rate` become at `target_rate`."""
    return n if rate == target_rate else max(1, round(n * target_rate / rate))


def load_audio(ref: Any, base_dir: Path | None, target_rate: int) -> np.ndarray:
    """Mono float32 samples in [-1, 1] at `target_rate`."""
    if isinstance(ref, Mapping) and ref.get("array") is not None:
        _, rate = probe_audio(ref, base_dir)
        samples = np.asarray(ref["array"], dtype=np.float32)
        if samples.ndim > 1:
            samples = samples.mean(axis=-1)
        return resample(samples, rate, target_rate)
    path = _wav_path(ref, base_dir)
    try:
        with wave.open(str(path), "rb") as wav:
            width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
            raw = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError, OSError) as err:
        raise MediaUnreadable(f"audio file {path} cannot be read as WAV: {err}") from None
    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(raw, dtype=dtype).astype(np.float32) / float(2 ** (8 * width - 1))
    else:
        raise MediaUnreadable(f"audio file {path}: {8 * width}-bit WAV is not supported")
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    return resample(samples, rate, target_rate)


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    """Write mono float samples in [-1, 1] as a 16-bit PCM WAV file."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
