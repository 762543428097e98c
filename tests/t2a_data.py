"""Small audio data sets for the text-to-audio tests: tones written as wav, flac, ogg and mp3
(through soundfile), a `metadata.jsonl` folder of captioned clips and preference pairs in the
generic format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile

SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
CAPTIONS = ("a high beep", "a low hum", "two short beeps", "a rising tone")
PITCH = {"a high beep": 2000.0, "a low hum": 200.0, "two short beeps": 1000.0,
         "a rising tone": 600.0}  # fmt: skip


def tone(frequency: float, seconds: float, rate: int, *, channels: int = 1,
         amplitude: float = 0.3) -> np.ndarray:  # fmt: skip
    """A sine [samples, channels] float32 (every channel the same)."""
    t = np.arange(round(seconds * rate)) / rate
    wave = (amplitude * np.sin(2 * np.pi * frequency * t)).astype(np.float32)
    return np.repeat(wave[:, None], channels, axis=1)


def write(path: Path, samples: np.ndarray, rate: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(str(path), samples, rate)
    return path


def captioned_folder(root: Path, count: int = 4, *, seconds: float = 0.8) -> Path:
    """A folder with metadata.jsonl: tones as wav (44.1 kHz stereo), flac (16 kHz), ogg
    (22.05 kHz) and mp3 (24 kHz), each caption's pitch."""
    rates = (44100, 16000, 22050, 24000)
    rows = []
    for k in range(count):
        caption = CAPTIONS[k % len(CAPTIONS)]
        name = f"clip{k}{SUFFIXES[k % len(SUFFIXES)]}"
        rate = rates[k % len(rates)]
        write(root / name, tone(PITCH[caption], seconds, rate, channels=2 if k % 4 == 0 else 1),
              rate)  # fmt: skip
        rows.append({"file_name": name, "text": caption})
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def pair_file(root: Path, count: int = 2, *, seconds: float = 0.8) -> Path:
    """pairs.jsonl (prompt, chosen, rejected): the chosen tone at the caption's pitch, the
    rejected one at another."""
    rows = []
    for k in range(count):
        caption = CAPTIONS[k % len(CAPTIONS)]
        good = write(root / f"good{k}.wav", tone(PITCH[caption], seconds, 16000), 16000)
        bad = write(root / f"bad{k}.flac", tone(PITCH[caption] * 1.5, seconds, 22050), 22050)
        rows.append({"prompt": caption, "chosen": good.name, "rejected": bad.name})
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
