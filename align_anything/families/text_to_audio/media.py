"""The audio medium of the pipeline families (`AUDIO`, a `families.diffusion.family.Medium`):
how audio files are read and checked (`audio`), made into the log-mel spectrogram the VAE
encodes ([1, frames, mels], the VAE's one-channel "image"), drawn by a text-to-audio pipeline,
written as WAV files with a PNG of their spectrograms, and checked on built-in data (the tones
world's pitch and pattern rule, `tones`).

The medium's own settings are bound once at set-up (`configure`): the clip length
(`data.audio_seconds`, as mel frames: the run's "resolution") and the pipeline's sampling
rate, hop and mel bins (its vocoder's)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from align_anything.families.diffusion import sampling
from align_anything.families.diffusion.family import Medium, OutputCheck
from align_anything.families.diffusion.latents import LATENT_ENCODER_VERSION, files_digest
from align_anything.families.text_to_audio.audio import (
    MEL_FMAX,
    N_FFT,
    AudioRef,
    AudioSource,
    Checks,
    Features,
    log_mel,
    read_audio_source,
    spectrogram,
)

SAMPLE_BATCH = 8  # clips per pipeline call when sampling
MEL_ROW_PIXELS = 4  # a mel bin's height in the spectrogram PNG


def features_of(info: Any, frames: int) -> Features:
    """The features of a clip of `frames` mel frames for the pipeline `info` describes."""
    return Features(frames * info.hop_length / info.sampling_rate, info.sampling_rate,
                    info.hop_length, info.mel_bins)  # fmt: skip


def latent_key_parts(source: AudioSource, *, features: Features, encoder: str,
                     columns: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Everything an audio source's latents depend on: its kind, path and columns, each data
    file's and audio file's size and digest, the clip length, rate and mel settings, the
    encoders' identity and the cache's version."""
    return {
        "version": LATENT_ENCODER_VERSION, "medium": "audio", "kind": source.kind,
        "path": source.path, "columns": dict(sorted((columns or {}).items())),
        "data_files": files_digest(source.data_files),
        "audio_files": files_digest(source.audio_files), "samples": features.samples,
        "sampling_rate": features.sampling_rate, "hop_length": features.hop_length,
        "mel_bins": features.mel_bins, "n_fft": N_FFT, "fmax": MEL_FMAX,
        "resampler": "scipy.signal.resample_poly", "encoder": encoder,
    }  # fmt: skip


def audio_refs(source: AudioSource) -> list[list[AudioRef]]:
    """Per row, its clips: the captioned one, or the chosen and the rejected one."""
    if source.kind == "captioned":
        return [[item.audio] for item in source.items]
    return [[item.chosen, item.rejected] for item in source.items]


@dataclass(frozen=True)
class _Ready:
    pixels: np.ndarray  # [1, frames, mels]: the log-mel spectrogram
    geometry: tuple[int, int, int, int]


def mel_ready(features: Features) -> Callable[[AudioRef], _Ready]:
    """`prepare`: one clip's log-mel spectrogram as the VAE takes it, [1, frames, mels]."""

    def prepare(ref: AudioRef) -> _Ready:
        mel = spectrogram(ref, features)
        return _Ready(mel[None], (mel.shape[0], mel.shape[1], 0, 0))

    return prepare


def sample_audio(
    parts: Any, prompts: Sequence[str], seeds: Sequence[int], *, seconds: float,
    steps: int = 20, guidance_scale: float | None = None, batch_size: int = SAMPLE_BATCH,
    denoiser: torch.nn.Module | None = None,
    gathered: Callable[[], AbstractContextManager[torch.nn.Module]] | None = None,
) -> list[np.ndarray]:  # fmt: skip
    """One waveform [samples] float32 per (prompt, seed), through the kind's pipeline class
    over the run's modules (`FrozenParts.pipeline`), each from its own seeded CPU generator
    (`families.diffusion.sampling.sample_with_pipeline`: `denoiser` or `gathered`, the
    denoiser in eval mode meanwhile)."""
    return sampling.sample_with_pipeline(
        parts, prompts, seeds, steps=steps, guidance_scale=guidance_scale,
        batch_size=batch_size, denoiser=denoiser, gathered=gathered,
        pipeline_kwargs={"audio_length_in_s": seconds, "output_type": "np"},
        outputs=lambda out: [np.asarray(w, dtype=np.float32) for w in out.audios],
    )  # fmt: skip


def spectrogram_image(wave: np.ndarray, features: Features) -> Any:
    """A greyscale picture of `wave`'s log-mel spectrogram: time to the right, low mels at
    the bottom, each mel bin `MEL_ROW_PIXELS` high, from the log floor (black) to the loudest
    bin (white)."""
    from PIL import Image

    mel = log_mel(wave, features).T[::-1]  # [mels, frames], low frequencies last
    low, high = float(mel.min()), float(mel.max())
    scaled = (mel - low) / (high - low) if high > low else np.zeros_like(mel)
    pixels = np.repeat(np.round(scaled * 255).astype(np.uint8), MEL_ROW_PIXELS, axis=0)
    return Image.fromarray(np.ascontiguousarray(pixels), mode="L")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "x"


def save_samples(rows: list[list[np.ndarray]], path: Path, row_labels: list[str],
                 column_labels: list[str], *, features: Features) -> Path:  # fmt: skip
    """The samples as WAV files (16-bit PCM at the model's rate) in the folder `path`, one per
    (prompt, seed) named `p<row>-<column>.wav`, and beside it `path` + ".png", a labelled grid
    of their spectrograms (returned: the still that is logged). Each file written to a
    temporary name and renamed."""
    import soundfile

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for r, row in enumerate(rows):
        for c, wave in enumerate(row):
            label = column_labels[c] if c < len(column_labels) else str(c)
            wav = folder / f"p{r}-{_slug(label)}.wav"
            tmp = wav.with_name(f".tmp-{wav.name}")
            soundfile.write(str(tmp), np.clip(wave, -1.0, 1.0), features.sampling_rate,
                            subtype="PCM_16", format="WAV")  # fmt: skip
            os.replace(tmp, wav)
    pictures = [[spectrogram_image(wave, features) for wave in row] for row in rows]
    return sampling.save_grid(pictures, folder.with_name(folder.name + ".png"),
                              row_labels=row_labels, column_labels=column_labels)  # fmt: skip


def tones_check(data_path: Any) -> OutputCheck | None:
    """The audio check of built-in data (the tones sets: does each clip drawn for a held-out
    caption sound at the caption's pitch, in its pattern), None otherwise."""
    from align_anything.data.builtin import builtin_path
    from align_anything.families.text_to_audio import tones

    if not isinstance(data_path, str) or not data_path.startswith("t2a-tones"):
        return None
    if builtin_path(data_path) is None:
        return None
    rows = tones.read_parquet(builtin_path("t2a-tones-eval"))
    return OutputCheck(
        name="tones", captions=[r["text"] for r in rows], seeds=[int(r["seed"]) for r in rows],
        rule=tones.match_rate,
    )  # fmt: skip


def configure(cfg: Any, info: Any) -> Medium:
    """The medium bound to the run's clip length and the pipeline's rate, hop and mel bins
    (the frames were checked by `family.resolution_of`)."""
    frames = info.mel_frames(cfg.data.audio_seconds) if cfg.data.audio_seconds else None
    features = features_of(info, frames or info.default_resolution)
    checks = Checks(info.sampling_rate, features.seconds, cfg.data.refuse_silent_audio)
    return replace(
        AUDIO,
        # data.max_image_pixels guards image files; audio files are read whole.
        read_source=lambda path, kind, columns, _max_pixels: read_audio_source(
            path, kind, columns=columns, checks=checks
        ),
        key_parts=lambda source, resolution, encoder, columns: latent_key_parts(
            source, features=features_of(info, resolution), encoder=encoder, columns=columns
        ),
        prepare=lambda resolution: mel_ready(features_of(info, resolution)),
        sample=lambda parts, prompts, seeds, resolution, **kw: sample_audio(
            parts, prompts, seeds, seconds=features_of(info, resolution).seconds, **kw
        ),
        save_samples=lambda rows, path, row_labels, column_labels: save_samples(
            rows, path, row_labels, column_labels, features=features
        ),
        describe=lambda resolution, latent_shape: (
            f"{features_of(info, resolution).seconds:g} s of mono audio at "
            f"{info.sampling_rate} Hz: {resolution} mel frames x {info.mel_bins} mels (hop "
            f"{info.hop_length}); latents {'x'.join(str(d) for d in latent_shape)} "
            "(data.audio_seconds)"
        ),
        configure=None,
    )  # fmt: skip


def _unbound(*_: Any, **__: Any) -> Any:
    raise RuntimeError("the audio medium is used through `configure(cfg, info)` (its length)")


AUDIO = Medium(
    name="audio", unit="clips", read_source=_unbound, key_parts=_unbound, refs=audio_refs,
    prepare=_unbound, sample=_unbound, save_samples=_unbound, check=tones_check,
    describe=_unbound, configure=configure,
)  # fmt: skip
