"""Built-in text-to-audio data: one second of tones described by the caption, and the rule check
of their pitch and their beeps.

A clip is `SECONDS` s of mono audio at `SAMPLING_RATE` Hz: a sine tone, low, mid or high (around
`PITCH_HZ`: 250 Hz, 707 Hz, 2 kHz, 1.5 octaves apart), within `PITCH_SPREAD` octaves of its centre,
sounding as one of three patterns: a hum (one long tone, 0.7-0.8 s), a beep (one short tone,
0.15-0.25 s) or two beeps (two short tones with a gap), each tone with 10 ms fades. The caption
names both: "a low hum", "a mid beep", "two high beeps". Everything is drawn from a fixed seed,
so the files are the same on every machine (`generate`; a test checks the shipped files against
it).

Three pitch x pattern combinations (`HELD_OUT`, one per pitch and one per pattern) appear only in
the held-out sets, so the held-out check measures whether the pitch word was learnt, not whether
one clip was memorised; every pattern is in the training sets at the two other pitches.

The clips are FLAC files (`CLIPS_PER_COMBO` per combination, in `builtin/t2a_tones/`) and the
sets are parquet files naming them relative to the set (`data.path=<name>` selects one):
- `t2a-tones` (`SFT_ROWS` rows): `audio` and `text`, true captions, for fine-tuning;
- `t2a-tones-pref` (pairs) in the generic shape `prompt`, `chosen`, `rejected`: the chosen
  clip sounds as the caption says, the rejected one is the same pattern at the pitch one step up
  (`MISHEARD`: low -> mid -> high -> low), the built-in base model's systematic error;
- `t2a-tones-eval` (`EVAL_ROWS` rows): `text`, `audio` and `seed` (for the held-out check) on
  the held-out combinations; `t2a-tones-pref-eval`: held-out pairs.

The check (`audio_matches`, `match_rate`) is a deterministic rule on the waveform: its pitch is
the dominant frequency of its Hann-windowed FFT, low or high by the nearer centre (in octaves),
and within `MAX_OCTAVES` of it; its pattern comes from the envelope (RMS over 10 ms frames,
relative to the loudest frame): the runs of frames above `ENVELOPE_THRESHOLD`, gaps shorter
than `MIN_GAP_FRAMES` bridged and runs shorter than `MIN_RUN_FRAMES` dropped, are its tones; one
tone of at least `HUM_SECONDS` is a hum, one shorter tone a beep, two tones two beeps. A clip
matches its caption when both agree. It is 1.0 on every shipped clip (tested).
"""

from __future__ import annotations

import io
import random
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SAMPLING_RATE = 16000
SECONDS = 1.0
PITCH_HZ: dict[str, float] = {"low": 250.0, "mid": 707.0, "high": 2000.0}
PITCHES: tuple[str, ...] = tuple(PITCH_HZ)
# The built-in base's systematic error (and the rejected clip of every built-in pair): the pitch
# one step up, the highest wrapping to the lowest.
MISHEARD = {"low": "mid", "mid": "high", "high": "low"}
PITCH_SPREAD = 0.25  # octaves either side of the centre the world draws
PATTERNS: tuple[str, ...] = ("hum", "beep", "two beeps")
HELD_OUT: tuple[tuple[str, str], ...] = (("low", "beep"), ("mid", "two beeps"), ("high", "hum"))
ALL_COMBOS: tuple[tuple[str, str], ...] = tuple((p, q) for p in PITCHES for q in PATTERNS)
TRAIN_COMBOS = tuple(c for c in ALL_COMBOS if c not in HELD_OUT)
EVAL_COMBOS = HELD_OUT

SEED = 20261204
CLIPS_PER_COMBO = 8
SFT_ROWS = 96
PREF_TRAIN_ROWS = 96
EVAL_ROWS = 48
PREF_EVAL_ROWS = 24
CLIP_DIR = "t2a_tones"  # under data/builtin/

FADE_SECONDS = 0.01
FRAME_SECONDS = 0.01
# The check's thresholds.
MAX_OCTAVES = 1.0
ENVELOPE_THRESHOLD = 0.3
MIN_GAP_FRAMES = 3
MIN_RUN_FRAMES = 4
HUM_SECONDS = 0.45
SILENCE_RMS = 1e-3

_WORDS = re.compile(r"[a-z]+")


def caption(pitch: str, pattern: str) -> str:
    """The caption of one clip: "a low hum", "a high beep", "two low beeps"."""
    if pattern == "two beeps":
        return f"two {pitch} beeps"
    return f"a {pitch} {pattern}"


def caption_words(text: str) -> tuple[str | None, str | None]:
    """(pitch, pattern) named in a caption, None where it names none."""
    words = _WORDS.findall(text.lower())
    pitch = next((w for w in words if w in PITCH_HZ), None)
    if "beeps" in words or ("two" in words and "beep" in words):
        pattern: str | None = "two beeps"
    elif "beep" in words:
        pattern = "beep"
    elif "hum" in words:
        pattern = "hum"
    else:
        pattern = None
    return pitch, pattern


# The ranges (seconds) each pattern's timing is drawn from: (start), (length) or, for two beeps,
# (start, first length, gap, second length). VARIED places the tones anywhere (the audio-text
# questions, `tones_qa.py`); STEADY at about fixed times (the text-to-audio sets and the
# built-in generator's pre-training): a generator this small drew two beeps at random places in
# only half its clips (docs/text-to-audio.md). STEADY's gap of 0.12-0.15 s is one the VAE and
# vocoder keep at 2 kHz and the UNet draws; 0.07-0.09 s merged, 0.2-0.26 s came out as one blob.
VARIED = {"hum": ((0.05, 0.15), (0.7, 0.8)), "beep": ((0.1, 0.5), (0.15, 0.25)),
          "two beeps": ((0.05, 0.3), (0.12, 0.18), (0.12, 0.2), (0.12, 0.18))}  # fmt: skip
STEADY = {"hum": ((0.08, 0.12), (0.72, 0.78)), "beep": ((0.36, 0.44), (0.17, 0.23)),
          "two beeps": ((0.26, 0.3), (0.12, 0.15), (0.12, 0.15), (0.12, 0.15))}  # fmt: skip


def segments_of(
    pattern: str, rng: random.Random, steady: bool = False
) -> list[tuple[float, float]]:
    """(start, length) in seconds of each tone of `pattern`, drawn from `rng` within the
    `STEADY` or `VARIED` ranges."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    drawn = [rng.uniform(*bounds) for bounds in (STEADY if steady else VARIED)[pattern]]
    if pattern == "two beeps":
        start, first, gap, second = drawn
        return [(start, first), (start + first + gap, second)]
    return [(drawn[0], drawn[1])]


def synthesize(frequency: float, segments: Sequence[tuple[float, float]], *,
               rate: int = SAMPLING_RATE, seconds: float = SECONDS,
               amplitude: float = 0.5) -> np.ndarray:  # fmt: skip
    """[rate * seconds] float32: a sine at `frequency` Hz sounding over each (start, length),
    with linear fades of `FADE_SECONDS`, silent elsewhere."""
    t = np.arange(round(rate * seconds)) / rate
    envelope = np.zeros_like(t)
    fade = FADE_SECONDS
    for start, length in segments:
        rise = np.clip((t - start) / fade, 0, 1)
        fall = np.clip((start + length - t) / fade, 0, 1)
        envelope = np.maximum(envelope, np.minimum(rise, fall))
    return (amplitude * envelope * np.sin(2 * np.pi * frequency * t)).astype(np.float32)


def draw_clip(pitch: str, pattern: str, rng: random.Random, steady: bool = False) -> np.ndarray:
    """One clip of `pitch` and `pattern` at a random frequency, timing (`segments_of`) and
    loudness."""
    frequency = PITCH_HZ[pitch] * 2 ** rng.uniform(-PITCH_SPREAD, PITCH_SPREAD)
    return synthesize(frequency, segments_of(pattern, rng, steady),
                      amplitude=rng.uniform(0.3, 0.6))  # fmt: skip


# --- the check -----------------------------------------------------------------------------


def dominant_frequency(wave: np.ndarray, rate: int = SAMPLING_RATE) -> float:
    """The frequency (Hz) of the largest bin of the Hann-windowed magnitude FFT (DC excluded)."""
    wave = np.asarray(wave, dtype=np.float64).reshape(-1)
    spectrum = np.abs(np.fft.rfft((wave - wave.mean()) * np.hanning(len(wave))))
    spectrum[0] = 0.0
    return float(np.argmax(spectrum) * rate / len(wave))


def pitch_of(wave: np.ndarray, rate: int = SAMPLING_RATE) -> str | None:
    """ "low", "mid" or "high": the pitch whose centre is nearest the dominant frequency in octaves,
    None when it is over `MAX_OCTAVES` from both (or the clip is silent)."""
    frequency = dominant_frequency(wave, rate)
    if frequency <= 0:
        return None
    distance = {p: abs(np.log2(frequency / hz)) for p, hz in PITCH_HZ.items()}
    nearest = min(distance, key=distance.__getitem__)
    return nearest if distance[nearest] <= MAX_OCTAVES else None


def envelope(wave: np.ndarray, rate: int = SAMPLING_RATE) -> np.ndarray:
    """RMS of each `FRAME_SECONDS` frame."""
    wave = np.asarray(wave, dtype=np.float64).reshape(-1)
    size = round(rate * FRAME_SECONDS)
    frames = len(wave) // size
    return np.sqrt((wave[: frames * size].reshape(frames, size) ** 2).mean(axis=1))


def tones_of(wave: np.ndarray, rate: int = SAMPLING_RATE) -> list[tuple[int, int]]:
    """(first frame, frames) of each tone: runs of frames above `ENVELOPE_THRESHOLD` of the
    loudest, gaps under `MIN_GAP_FRAMES` bridged, runs under `MIN_RUN_FRAMES` dropped."""
    rms = envelope(wave, rate)
    if not len(rms) or rms.max() < SILENCE_RMS:
        return []
    loud = rms >= ENVELOPE_THRESHOLD * rms.max()
    runs: list[list[int]] = []
    for index in np.flatnonzero(loud):
        if runs and index - runs[-1][1] <= MIN_GAP_FRAMES:
            runs[-1][1] = int(index)
        else:
            runs.append([int(index), int(index)])
    return [(a, b - a + 1) for a, b in runs if b - a + 1 >= MIN_RUN_FRAMES]


def pattern_of(wave: np.ndarray, rate: int = SAMPLING_RATE) -> str | None:
    """ "hum", "beep" or "two beeps" from the envelope's tones; None for anything else."""
    tones = tones_of(wave, rate)
    if len(tones) == 2:
        return "two beeps"
    if len(tones) == 1:
        return "hum" if tones[0][1] * FRAME_SECONDS >= HUM_SECONDS else "beep"
    return None


def audio_matches(wave: np.ndarray, text: str, rate: int = SAMPLING_RATE) -> bool:
    """Does the waveform sound at the caption's pitch, in the caption's pattern?"""
    pitch, pattern = caption_words(text)
    if pitch is None or pattern is None:
        return False
    return pitch_of(wave, rate) == pitch and pattern_of(wave, rate) == pattern


def match_rate(waves: Sequence[np.ndarray], captions: Sequence[str]) -> float:
    """The held-out check: the share of clips that match their captions (0.0 for none)."""
    if len(waves) != len(captions):
        raise ValueError(f"{len(waves)} clips but {len(captions)} captions")
    matches = [audio_matches(np.asarray(w), c) for w, c in zip(waves, captions, strict=True)]
    return sum(matches) / len(matches) if matches else 0.0


# --- the sets ------------------------------------------------------------------------------


def clip_name(pitch: str, pattern: str, index: int) -> str:
    """The shipped file of one clip, relative to the sets' folder."""
    return f"{CLIP_DIR}/{pitch}-{pattern.replace(' ', '-')}-{index}.flac"


def flac_bytes(wave: np.ndarray, rate: int = SAMPLING_RATE) -> bytes:
    """A clip as 16-bit FLAC."""
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(wave, -1, 1), rate, subtype="PCM_16", format="FLAC")
    return buffer.getvalue()


def clips(seed: int = SEED) -> dict[str, np.ndarray]:
    """Every shipped clip, {relative file name: waveform}, `CLIPS_PER_COMBO` per combination."""
    rng = random.Random(seed)
    return {clip_name(p, q, k): draw_clip(p, q, rng, steady=True)
            for p, q in ALL_COMBOS for k in range(CLIPS_PER_COMBO)}  # fmt: skip


def _pairs(rng: random.Random, combos: Sequence[tuple[str, str]], count: int) -> list[dict]:
    """The chosen clip sounds as the caption says; the rejected one is the same pattern (the
    same draw index) at the pitch the built-in base hears (`MISHEARD`)."""
    rows = []
    for index in range(count):
        pitch, pattern = combos[index % len(combos)]
        k = (index // len(combos)) % CLIPS_PER_COMBO
        rows.append({"prompt": caption(pitch, pattern), "chosen": clip_name(pitch, pattern, k),
                     "rejected": clip_name(MISHEARD[pitch], pattern, k)})  # fmt: skip
    rng.shuffle(rows)
    return rows


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every built-in tones set, {name: rows}; deterministic for a given `seed`."""
    rng = random.Random(seed + 1)
    sft = []
    for index in range(SFT_ROWS):
        pitch, pattern = TRAIN_COMBOS[index % len(TRAIN_COMBOS)]
        k = (index // len(TRAIN_COMBOS)) % CLIPS_PER_COMBO
        sft.append({"audio": clip_name(pitch, pattern, k), "text": caption(pitch, pattern)})
    rng.shuffle(sft)
    evals = []
    for index in range(EVAL_ROWS):
        pitch, pattern = EVAL_COMBOS[index % len(EVAL_COMBOS)]
        k = (index // len(EVAL_COMBOS)) % CLIPS_PER_COMBO
        evals.append({"text": caption(pitch, pattern), "audio": clip_name(pitch, pattern, k),
                      "seed": index})  # fmt: skip
    return {
        "t2a-tones": sft,
        "t2a-tones-pref": _pairs(rng, TRAIN_COMBOS, PREF_TRAIN_ROWS),
        "t2a-tones-eval": evals,
        "t2a-tones-pref-eval": _pairs(rng, EVAL_COMBOS, PREF_EVAL_ROWS),
    }


def write_all(directory: Path | None = None) -> dict[str, int]:
    """Regenerate every tones set and clip (`data/builtin/`); returns {name: row count}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from align_anything.data.builtin import BUILTIN_DATASETS, BUILTIN_DIR

    directory = directory or BUILTIN_DIR
    (directory / CLIP_DIR).mkdir(parents=True, exist_ok=True)
    for name, wave in clips().items():
        (directory / name).write_bytes(flac_bytes(wave))
    counts = {}
    for name, rows in generate().items():
        pq.write_table(pa.Table.from_pylist(rows), directory / BUILTIN_DATASETS[name],
                       compression="zstd")  # fmt: skip
        counts[name] = len(rows)
    return counts


def read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


if __name__ == "__main__":
    for set_name, count in write_all().items():
        print(f"{set_name}: {count} rows")
