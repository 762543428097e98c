"""Media references in records (images, audio) and their lazy decoding.

Records keep references, never decoded media: an image is a file path (relative to the dataset
file's folder, or absolute), raw bytes, or a ``{"path": ..., "bytes": ...}`` dict (the layout
`datasets` uses for undecoded images); audio is a WAV file path, a ``{"path": ...}`` dict,
``{"array": [...], "sampling_rate": N}``, or embedded bytes of an audio file (raw, or
``{"bytes": ...}``: the layout of `datasets`' undecoded audio) in any format libsndfile reads
(WAV, FLAC, OGG; the built-in `tones-qa` sets embed FLAC). Decoding happens per batch in the
collate step.

`probe_image` / `probe_audio` read only what a data check needs (an image's header for its size,
a WAV header for its length), so the check over every row at data preparation is cheap and
loads nothing into memory.

Images are read as they are displayed, as 8-bit RGB (`to_rgb`): the EXIF orientation a camera
or phone records is applied (`ImageOps.exif_transpose`); 16-bit (and 32-bit integer) grayscale
is scaled to 8 bits, not clipped (PIL's own conversion clips every value above 255 to white);
transparent pixels are laid on white; CMYK, palette and the other modes PIL reads go through
PIL's conversion. Floating-point images (mode F: no fixed range to map to 0..255) are refused,
as is an image of more than `MAX_IMAGE_PIXELS` pixels (`data.max_image_pixels`: the guard
against decompression bombs, checked from the header before any pixel is decoded).
"""

from __future__ import annotations

import contextlib
import io
import wave
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Record keys that hold media, and the modality each holds.
MEDIA_KEYS = {"images": "image", "audio": "audio"}
# The most pixels an image may have (`data.max_image_pixels`'s default): PIL's own guard
# against decompression bombs (a small file that decodes to gigabytes).
MAX_IMAGE_PIXELS = 89_478_485
# EXIF tag 0x0112: how the stored pixels are turned for display; 5-8 swap width and height.
_ORIENTATION = 0x0112
# Integer grayscale modes read as 16-bit values (0..65535), scaled to 8 bits by 1/257.
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_WITH_ALPHA = ("RGBA", "RGBa", "LA", "La", "PA")


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


@contextlib.contextmanager
def _opened(source: Any, ref: Any, max_pixels: int | None) -> Iterator[Any]:
    """PIL's `Image.open` with our pixel limit instead of PIL's: PIL's guard is a process-wide
    setting that warns past its limit and raises past twice it, naming no file and no way to
    allow it; here an image over `max_pixels` (None: no limit) is a `MediaUnreadable` naming
    the file and `data.max_image_pixels`."""
    from PIL import Image

    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        image = Image.open(source)  # reads the header, not the pixels
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    with image:
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise MediaUnreadable(
                f"image {describe(ref)} is {width}x{height} = {width * height:,} pixels, more "
                f"than data.max_image_pixels={max_pixels} (a guard against decompression bombs: "
                "a small file that decodes to gigabytes). If you trust the file, raise the "
                f"limit, e.g. data.max_image_pixels={width * height}; or resize the image"
            )
        yield image


def _refuse_mode(image: Any, ref: Any) -> None:
    if image.mode == "F":
        raise MediaUnreadable(
            f"image {describe(ref)} holds floating-point pixels (mode F), whose range has no "
            "fixed mapping to 0..255: save it as an 8- or 16-bit PNG"
        )


def _orientation(image: Any) -> int | None:
    """The EXIF orientation from the header. A PNG's EXIF is read only where it precedes the
    pixel data: PIL's `getexif` would decode the image to look past them (and `verify` must
    come first); `to_rgb` applies an orientation found anywhere."""
    from PIL import Image

    if image.format == "PNG":
        raw = image.info.get("exif")
        if not raw:
            return None
        exif = Image.Exif()
        exif.load(raw)
        return exif.get(_ORIENTATION)
    return image.getexif().get(_ORIENTATION)


def probe_image(
    ref: Any, base_dir: Path | None, *, max_pixels: int | None = MAX_IMAGE_PIXELS
) -> tuple[int, int]:
    """(width, height) as displayed (after the EXIF orientation) from the image header, after
    checking that the file is whole without decoding it: a PNG's chunks and checksums (PIL's
    `verify`), a JPEG's end marker (where it is missing, the image is decoded), and that it
    has at most `max_pixels` pixels and pixels `to_rgb` converts. Raises `MediaUnreadable`."""
    from PIL import UnidentifiedImageError

    source = _image_source(ref, base_dir)
    try:
        with _opened(source, ref, max_pixels) as image:
            size, kind = image.size, image.format
            _refuse_mode(image, ref)
            if _orientation(image) in (5, 6, 7, 8):
                size = (size[1], size[0])
            if kind == "PNG":
                image.verify()
        if kind == "JPEG" and not _jpeg_is_whole(source):
            if isinstance(source, io.BytesIO):
                source.seek(0)
            with _opened(source, ref, max_pixels) as image:
                image.load()
    except (UnidentifiedImageError, OSError, SyntaxError) as err:  # verify raises SyntaxError
        raise MediaUnreadable(f"image {describe(ref)} cannot be read: {err}") from None
    return size


def to_rgb(image: Any, ref: Any = "image") -> Any:
    """`image` (PIL, any mode) as displayed, in 8-bit RGB (see the module docstring): the EXIF
    orientation applied, 16-bit grayscale scaled rather than clipped, transparency laid on
    white. Raises `MediaUnreadable` (naming `ref`) for pixels with no such conversion."""
    from PIL import Image, ImageOps

    _refuse_mode(image, ref)
    try:
        image = ImageOps.exif_transpose(image)
        if image.mode in _SIXTEEN_BIT:
            values = np.asarray(image)
            if values.size and (values.min() < 0 or values.max() > 65535):
                raise MediaUnreadable(
                    f"image {describe(ref)} holds 32-bit integer pixels outside 0..65535 "
                    f"({values.min()}..{values.max()}): save it as an 8- or 16-bit PNG"
                )
            scaled = np.rint(values.astype(np.float64) / 257.0).astype(np.uint8)
            return Image.fromarray(scaled, mode="L").convert("RGB")
        if image.mode in _WITH_ALPHA or "transparency" in image.info:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except (ValueError, OSError) as err:  # a mode PIL cannot convert; damaged pixel data
        raise MediaUnreadable(f"image {describe(ref)} cannot be decoded: {err}") from None


def load_image(
    ref: Any, base_dir: Path | None, *, max_pixels: int | None = MAX_IMAGE_PIXELS
) -> Any:
    """The decoded image (PIL) as displayed, in 8-bit RGB (`to_rgb`)."""
    source = _image_source(ref, base_dir)
    try:
        with _opened(source, ref, max_pixels) as image:
            image.load()
            return to_rgb(image, ref)
    except OSError as err:
        raise MediaUnreadable(f"image {describe(ref)} cannot be decoded: {err}") from None


def _wav_path(ref: Any, base_dir: Path | None) -> Path:
    path_value = ref.get("path") if isinstance(ref, Mapping) else ref
    if not isinstance(path_value, str) or not path_value:
        raise MediaUnreadable(
            f"audio reference {describe(ref)!r} is neither a path, embedded bytes nor "
            "{'array': [...], 'sampling_rate': N}"
        )
    path = _existing_file(_resolve(path_value, base_dir), "audio")
    if path.suffix.lower() != ".wav":
        raise MediaUnreadable(
            f"audio file {path}: only WAV files are read (no extra decoder needed); convert "
            "it to WAV or give {'array': [...], 'sampling_rate': N}"
        )
    return path


def _audio_bytes(ref: Any) -> bytes | None:
    """The embedded bytes of an audio reference (raw, or a dict's `bytes`), None for others."""
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref)
    if isinstance(ref, Mapping) and ref.get("array") is None and ref.get("bytes") is not None:
        return bytes(ref["bytes"])
    return None


def _embedded_audio(data: bytes, ref: Any, *, header_only: bool) -> Any:
    """soundfile's `info` (header_only) or (float32 samples [n, channels], rate) of embedded
    audio bytes; unreadable bytes raise `MediaUnreadable`."""
    import soundfile

    try:
        if header_only:
            return soundfile.info(io.BytesIO(data))
        return soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as err:
        raise MediaUnreadable(f"audio {describe(ref)} cannot be decoded: {err}") from None


def probe_audio(ref: Any, base_dir: Path | None) -> tuple[int, int]:
    """(number of samples, sampling rate) from a WAV header, embedded bytes' header or an
    embedded array."""
    data = _audio_bytes(ref)
    if data is not None:
        info = _embedded_audio(data, ref, header_only=True)
        return int(info.frames), int(info.samplerate)
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
    data = _audio_bytes(ref)
    if data is not None:
        samples, rate = _embedded_audio(data, ref, header_only=False)
        return resample(samples.mean(axis=1).astype(np.float32), int(rate), target_rate)
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
