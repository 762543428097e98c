"""Text-to-audio data: captioned audio files and preference pairs of them, read and checked
before any model loads, and each clip made into the log-mel spectrogram the VAE encodes.

Sources (`read_audio_source`):

- **captioned audio** (denoising fine-tuning): a folder with `metadata.jsonl` (one row per
  file: `file_name`, relative to the folder, and its caption in `text`), as the image and
  video folders; or a `.jsonl` / `.json` / `.parquet` file (or folder of them) with an audio
  column (`audio`, `file_name` or `audio_path`: a path relative to the file, or
  `{"path": ...}`) and a caption column (`text`, `caption` or `prompt`);
- **preference pairs** (Diffusion-DPO), told apart by their columns: the generic format,
  `prompt`, `chosen`, `rejected` (paths, as above); or align-anything's text-to-audio
  preference format (its `AA_T2A` template): `prompt`, `response_1`, `response_2` and
  `overall_audio`, the better one (1 or 2).

`columns` maps these names to a file's own (`{"caption": "description"}`).

Decoding is **soundfile**'s (libsndfile in the wheel, in-process): wav, flac, ogg (Vorbis and
Opus) and mp3 alike, as float samples with the file's own rate. Each clip is mixed to mono
(the mean of its channels), resampled to the model's rate with `scipy.signal.resample_poly`
(a polyphase filter with a Kaiser window; torchaudio has no release for the pinned torch),
cut to `data.audio_seconds`, normalised as AudioLDM's training data are (mean removed, peak
at 0.5), then zero-padded at its end to that length.

Features (`log_mel`): AudioLDM's, with the vocoder's rate, hop and mel bins: a magnitude STFT
(a 1024-sample Hann window and FFT, the hop of the vocoder's upsampling, the waveform
reflect-padded by (1024 − hop)/2 on each side, no centring: one frame per hop), a Slaney mel
filter bank from 0 Hz to min(8 kHz, the Nyquist rate), and log(max(mel, 1e-5)): [frames,
mels], what `AudioLDMPipeline`'s vocoder turns back into a waveform.

Every row is checked before any compute (each file's header read): a missing or unreadable
file, an empty one (no samples), a sampling rate the resampler cannot take to the model's (a
ratio that does not reduce to factors of at most `MAX_RESAMPLE_FACTOR`, such as 44,101 Hz to
16 kHz), silence when `data.refuse_silent_audio` asks (the clip's used part decoded: its peak
below `SILENCE_PEAK`, which the normalisation would otherwise raise to full loudness), and a
missing caption are collected over the whole source and reported in one `DataError` naming the
file and each row ("line 3" of a JSON-lines file).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from align_anything.data.formats import DataReport, pick_column
from align_anything.errors import DataError
from align_anything.families.diffusion.rows import RowProblems, caption_text, read_table, where

METADATA = "metadata.jsonl"
KINDS = ("captioned", "pairs")
CAPTIONED_COLUMNS = {"audio": ("audio", "file_name", "audio_path"),
                     "caption": ("text", "caption", "prompt")}  # fmt: skip
PAIR_COLUMNS = {"caption": ("prompt",), "chosen": ("chosen",), "rejected": ("rejected",)}
# align-anything's AA_T2A template: two responses and which is better (1 or 2)
RANKED_PAIR_COLUMNS = {"caption": ("prompt",), "first": ("response_1",),
                       "second": ("response_2",), "better": ("overall_audio",)}  # fmt: skip
HINT = "Fix or remove those rows (every row needs a caption and an audio file with samples)."

# AudioLDM's feature settings (its TacotronSTFT): the window and FFT length, the mel range,
# the floor of the log. The hop and the number of mels are the vocoder's.
N_FFT = 1024
MEL_FMIN = 0.0
MEL_FMAX = 8000.0
LOG_FLOOR = 1e-5
PEAK = 0.5  # AudioLDM's normalize_wav: mean removed, peak scaled to 0.5
# The largest up- or down-sampling factor of the polyphase resampler (its filter grows with
# it): common rates reduce far below it (44.1 kHz -> 16 kHz is 160/441).
MAX_RESAMPLE_FACTOR = 1000
SILENCE_PEAK = 1e-3  # -60 dBFS: below it a clip is silence (data.refuse_silent_audio)


class AudioUnreadable(Exception):
    """An audio file that cannot be decoded, with the reason."""


@dataclass(frozen=True)
class AudioRef:
    """An audio file."""

    path: Path

    def read(self) -> bytes:
        """The file's bytes, for the cache's content digest."""
        return self.path.read_bytes()

    def describe(self) -> str:
        return str(self.path)


@dataclass(frozen=True)
class Features:
    """How a clip becomes the spectrogram the VAE encodes: its length, the model's rate, and
    the vocoder's hop and mel bins."""

    seconds: float
    sampling_rate: int
    hop_length: int
    mel_bins: int

    @property
    def samples(self) -> int:
        return round(self.seconds * self.sampling_rate)

    @property
    def frames(self) -> int:
        return self.samples // self.hop_length


@dataclass(frozen=True)
class Checks:
    """What a file is checked against beyond being readable audio: the model's rate (None:
    any rate), and silence over the clip's first `seconds` when `refuse_silence`."""

    sampling_rate: int | None = None
    seconds: float | None = None
    refuse_silence: bool = False


def resample_factors(rate: int, target: int) -> tuple[int, int]:
    """(up, down): the resampler's factors from `rate` to `target` Hz, reduced."""
    divisor = math.gcd(rate, target)
    return target // divisor, rate // divisor


def check_audio(ref: AudioRef, checks: Checks = Checks()) -> str | None:
    """Why the file cannot be used (missing, unreadable, no samples, a rate that cannot be
    resampled to the model's; silent, when refused), from its header (and its samples for
    silence); or None."""
    import soundfile

    if not ref.path.is_file():
        return f"audio {ref.describe()}: no such file"
    try:
        info = soundfile.info(str(ref.path))
    except (soundfile.LibsndfileError, RuntimeError, OSError) as err:
        return f"audio {ref.describe()}: cannot be read as audio ({err})"
    if info.frames <= 0 or info.samplerate <= 0:
        return f"audio {ref.describe()}: zero-length audio (no samples)"
    target = checks.sampling_rate
    if target and max(resample_factors(info.samplerate, target)) > MAX_RESAMPLE_FACTOR:
        up, down = resample_factors(info.samplerate, target)
        return (
            f"audio {ref.describe()}: its sampling rate {info.samplerate} Hz cannot be "
            f"resampled to the model's {target} Hz (the ratio {up}/{down} does not reduce to "
            f"factors of at most {MAX_RESAMPLE_FACTOR}); convert the file first, e.g. "
            f"`ffmpeg -i IN -ar {target} OUT.wav`"
        )
    if checks.refuse_silence:
        frames = round(checks.seconds * info.samplerate) if checks.seconds else -1
        samples, _ = soundfile.read(str(ref.path), frames=frames, dtype="float32", always_2d=True)
        mono = to_mono(samples)
        peak = float(np.abs(mono - mono.mean()).max(initial=0.0))
        if peak < SILENCE_PEAK:
            used = f"its first {checks.seconds:g} s" if checks.seconds else "the file"
            return (
                f"audio {ref.describe()}: silence ({used} peaks at {peak:.1e}, below "
                f"{SILENCE_PEAK:g}, -60 dBFS; data.refuse_silent_audio=true)"
            )
    return None


def decode(ref: AudioRef) -> tuple[np.ndarray, int]:
    """(samples [N, channels] float32, rate) of the file; an `AudioUnreadable` saying why
    otherwise."""
    import soundfile

    try:
        samples, rate = soundfile.read(str(ref.path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, OSError) as err:
        raise AudioUnreadable(f"{ref.describe()} cannot be decoded ({err})") from None
    if not len(samples):
        raise AudioUnreadable(f"{ref.describe()}: zero-length audio (no samples)")
    return samples, int(rate)


def to_mono(samples: np.ndarray) -> np.ndarray:
    """[N, channels] -> [N]: the mean of the channels."""
    return samples.mean(axis=1) if samples.ndim == 2 else samples


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """`wave` [N] at `rate` Hz resampled to `target` Hz (scipy's polyphase resampler; the
    ratio reduced by the rates' greatest common divisor)."""
    if rate == target:
        return wave.astype(np.float32)
    from scipy.signal import resample_poly

    return resample_poly(wave, *resample_factors(rate, target)).astype(np.float32)


def fit_length(wave: np.ndarray, samples: int) -> np.ndarray:
    """`wave` cut to its first `samples`, normalised as AudioLDM's data are (mean removed,
    peak at 0.5; silence stays silence), and zero-padded at its end to `samples`."""
    wave = wave[:samples].astype(np.float64)
    wave = wave - wave.mean()
    wave = wave / (np.abs(wave).max() + 1e-8) * PEAK
    out = np.zeros(samples, dtype=np.float32)
    out[: len(wave)] = wave
    return out


def waveform(ref: AudioRef, features: Features) -> np.ndarray:
    """The clip as the model hears it: [samples] float32, mono, at the model's rate, cut or
    padded to `features.seconds`."""
    samples, rate = decode(ref)
    wave = resample(to_mono(samples), rate, features.sampling_rate)
    return fit_length(wave, features.samples)


def mel_filters(features: Features) -> torch.Tensor:
    """[mels, N_FFT/2 + 1]: AudioLDM's Slaney mel filter bank (librosa's default, as
    transformers' `mel_filter_bank` computes it)."""
    from transformers.audio_utils import mel_filter_bank

    bank = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1, num_mel_filters=features.mel_bins,
        min_frequency=MEL_FMIN, max_frequency=min(MEL_FMAX, features.sampling_rate / 2),
        sampling_rate=features.sampling_rate, norm="slaney", mel_scale="slaney",
    )  # fmt: skip
    return torch.from_numpy(bank.T.astype(np.float32))


def log_mel(wave: np.ndarray, features: Features) -> np.ndarray:
    """[frames, mels] float32: AudioLDM's log-mel spectrogram of `wave` (see the module
    docstring), one frame per hop."""
    hop = features.hop_length
    signal = torch.from_numpy(np.asarray(wave, dtype=np.float32))[None, None]
    pad = (N_FFT - hop) // 2
    signal = torch.nn.functional.pad(signal, (pad, pad), mode="reflect")[0]
    spectrum = torch.stft(
        signal, N_FFT, hop_length=hop, win_length=N_FFT, window=torch.hann_window(N_FFT),
        center=False, normalized=False, onesided=True, return_complex=True,
    ).abs()[0]  # fmt: skip
    mel = mel_filters(features) @ spectrum
    return torch.log(mel.clamp(min=LOG_FLOOR)).T.contiguous().numpy()


def spectrogram(ref: AudioRef, features: Features) -> np.ndarray:
    """[frames, mels] of the file, exactly `features.frames` frames."""
    return log_mel(waveform(ref, features), features)[: features.frames]


# ----------------------------------------------------------------- sources


@dataclass(frozen=True)
class CaptionedAudio:
    caption: str
    audio: AudioRef
    row: str


@dataclass(frozen=True)
class AudioPair:
    caption: str
    chosen: AudioRef
    rejected: AudioRef
    row: str


@dataclass
class AudioSource:
    """One source read and checked: its items in file order, the report of what was dropped,
    and the files its content comes from."""

    path: str
    kind: str
    items: list[Any]
    report: DataReport
    data_files: list[Path]
    audio_files: list[Path]


def _audio_ref(value: Any, *, base: Path, column: str) -> AudioRef | str:
    """The file a cell names (a path, or `{"path": ...}`), or why it names none."""
    if isinstance(value, Mapping):
        if value.get("bytes") is not None and not value.get("path"):
            return f"embedded audio bytes in column '{column}' (give a file path)"
        value = value.get("path") or value.get("audio_path")
    if isinstance(value, str) and value.strip():
        path = Path(value).expanduser()
        return AudioRef(path if path.is_absolute() else base / path)
    return f"no audio file in column '{column}'"


def _source(path: str, kind: str, items: list, total: int, data_files: list[Path]) -> AudioSource:
    report = DataReport(source=path)
    report.total, report.kept = total, len(items)
    refs = [r for it in items
            for r in ((it.audio,) if kind == "captioned" else (it.chosen, it.rejected))]  # fmt: skip
    return AudioSource(path, kind, items, report, list(data_files),
                       sorted({r.path for r in refs}))  # fmt: skip


def _checked_ref(problems: RowProblems, row: str, value: Any, *, base: Path, column: str,
                 checks: Checks) -> AudioRef | None:  # fmt: skip
    ref = _audio_ref(value, base=base, column=column)
    problem = ref if isinstance(ref, str) else check_audio(ref, checks)
    if problem is not None:
        problems.add(row, problem)
        return None
    return ref  # type: ignore[return-value]


def read_captioned_audio(path: str, *, columns: Mapping[str, str] | None = None,
                         checks: Checks = Checks()) -> AudioSource:  # fmt: skip
    """The captioned clips of an audio folder (`metadata.jsonl`) or a data file, every row
    checked; a `DataError` naming each bad row otherwise."""
    columns = dict(columns or {})
    local = Path(path).expanduser()
    table_path, base = path, None
    if local.is_dir():
        if not (local / METADATA).is_file():
            raise DataError(
                f"audio folder {local} has no {METADATA}: give a folder with {METADATA} (one "
                "row per file: file_name, text), or a .jsonl/.parquet file with an audio path "
                "column and a caption column"
            )
        table_path, base = str(local / METADATA), local.resolve()
        columns = {"audio": "file_name", **columns}
    table, names, files, table_base = read_table(table_path)
    base = base or table_base
    at = where(table_path, files)
    audio_col = pick_column(table.column_names, "audio", CAPTIONED_COLUMNS["audio"], columns, at)
    caption_col = pick_column(table.column_names, "caption", CAPTIONED_COLUMNS["caption"],
                              columns, at)  # fmt: skip
    captions = table.column(caption_col).to_pylist()
    values = table.column(audio_col).to_pylist()
    problems, items = RowProblems(at), []
    for index, (caption, value) in enumerate(zip(captions, values, strict=True)):
        row = names(index)
        text = caption_text(caption)
        if text is None:
            problems.add(row, f"missing or empty caption in column '{caption_col}'")
        ref = _checked_ref(problems, row, value, base=base, column=audio_col, checks=checks)
        if ref is not None and text is not None:
            items.append(CaptionedAudio(text, ref, row))
    problems.raise_any(HINT)
    return _source(str(local) if local.is_dir() else path, "captioned", items, len(captions),
                   files)  # fmt: skip


def read_audio_pairs(path: str, *, columns: Mapping[str, str] | None = None,
                     checks: Checks = Checks()) -> AudioSource:  # fmt: skip
    """Preference pairs of clips in the generic format (`prompt`, `chosen`, `rejected`) or
    align-anything's (`prompt`, `response_1`, `response_2`, `overall_audio`), told apart by
    their columns; a missing or unusable clip or caption, and a preference that is not 1 or 2,
    are one `DataError` naming every such row."""
    columns = dict(columns or {})
    table, names, files, base = read_table(path)
    at = where(path, files)
    present = table.column_names
    ranked = "overall_audio" in present or "better" in columns
    if not ranked and not {"prompt", "chosen", "rejected"} <= {*present, *columns}:
        raise DataError(
            f"{at} is in neither audio preference format: the generic one (prompt, chosen, "
            "rejected: a caption and two audio file paths) nor align-anything's (prompt, "
            f"response_1, response_2, overall_audio); columns found: {', '.join(present)}. "
            "Map yours with data.columns"
        )
    spec = RANKED_PAIR_COLUMNS if ranked else PAIR_COLUMNS
    picked = {c: pick_column(present, c, tried, columns, at) for c, tried in spec.items()}
    cells = {c: table.column(name).to_pylist() for c, name in picked.items()}
    clips = ("first", "second") if ranked else ("chosen", "rejected")
    problems, items = RowProblems(at), []
    for index, caption in enumerate(cells["caption"]):
        row = names(index)
        text = caption_text(caption)
        if text is None:
            problems.add(row, f"missing or empty caption in column '{picked['caption']}'")
        refs = [_checked_ref(problems, row, cells[c][index], base=base, column=picked[c],
                             checks=checks) for c in clips]  # fmt: skip
        better = _better_response(cells["better"][index]) if ranked else 1
        if better is None:
            problems.add(row, f"{picked['better']} {cells['better'][index]!r} is not 1 or 2 "
                              "(which response is better)")  # fmt: skip
            continue
        if text is not None and None not in refs:
            chosen, rejected = refs if better == 1 else refs[::-1]
            items.append(AudioPair(text, chosen, rejected, row))  # type: ignore[arg-type]
    problems.raise_any(HINT)
    return _source(path, "pairs", items, len(cells["caption"]), files)


def _better_response(value: Any) -> int | None:
    """align-anything's `overall_audio` cell (1 or 2, as a number or text) as 1 or 2; None
    otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number in (1, 2) else None


def read_audio_source(path: str, kind: str, *, columns: Mapping[str, str] | None = None,
                      checks: Checks = Checks()) -> AudioSource:  # fmt: skip
    """`read_captioned_audio` ("captioned") or `read_audio_pairs` ("pairs")."""
    if kind not in KINDS:
        raise DataError(
            f"{path}: the text-to-audio family reads captioned audio and preference pairs, not "
            f"{kind}"
        )
    reader = read_captioned_audio if kind == "captioned" else read_audio_pairs
    return reader(path, columns=columns, checks=checks)
