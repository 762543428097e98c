"""Generated multimodal datasets whose right answer a program knows: coloured shapes (images)
and high/low tones (audio). For tests and the multimodal example; nothing is downloaded.

    python -m align_anything.data.synthetic shapes out/shapes --rows 48
    python -m align_anything.data.synthetic tones out/tones --rows 48

Each folder gets the media files (`images/*.png` or `audio/*.wav`) and three JSONL files whose
media paths are relative to the folder: `sft.jsonl` (conversations), `pref.jsonl` and
`pref_eval.jsonl` (preference pairs: the right answer chosen, a wrong one rejected).
`text_every=k` makes every k-th row text-only (no media), for mixed batches.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from align_anything.data.media import write_wav

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220)}
SHAPES = ("square", "circle")
TONES = {"low": 220.0, "high": 880.0}
SAMPLING_RATE = 16000
IMAGE_QUESTION = "What colour is the shape?"
AUDIO_QUESTION = "Is the tone high or low?"


def draw_shape(path: Path, colour: str, shape: str, size: int = 32) -> None:
    """A PNG of one filled shape in `colour` on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    image.save(path)


def write_tone(path: Path, pitch: str, seconds: float = 1.0) -> None:
    """A WAV sine tone at the pitch's frequency."""
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    write_wav(path, 0.5 * np.sin(2 * np.pi * TONES[pitch] * t), SAMPLING_RATE)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_dataset(kind: str, folder: Path, *, rows: int, seed: int = 0, text_every: int = 0) -> Path:
    """Write a shapes or tones dataset into `folder` (see the module docstring); returns it."""
    if kind not in ("shapes", "tones"):
        raise ValueError(f"kind must be 'shapes' or 'tones', got {kind!r}")
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    media_dir = folder / ("images" if kind == "shapes" else "audio")
    media_dir.mkdir(exist_ok=True)
    answers = list(COLOURS) if kind == "shapes" else list(TONES)
    question = IMAGE_QUESTION if kind == "shapes" else AUDIO_QUESTION
    sft, pairs = [], []
    for index in range(rows):
        answer = rng.choice(answers)
        wrong = rng.choice([a for a in answers if a != answer])
        record: dict = {}
        if text_every and index % text_every == text_every - 1:
            user = f"Say the word {answer}."
        elif kind == "shapes":
            name = f"{index:04d}.png"
            draw_shape(media_dir / name, answer, rng.choice(SHAPES))
            record["images"] = [f"images/{name}"]
            user = question
        else:
            name = f"{index:04d}.wav"
            write_tone(media_dir / name, answer)
            record["audio"] = [f"audio/{name}"]
            user = question
        reply, bad = f"It is {answer}.", f"It is {wrong}."
        sft.append({**record, "messages": [{"role": "user", "content": user},
                                           {"role": "assistant", "content": reply}]})  # fmt: skip
        pairs.append({**record, "prompt": user, "chosen": reply, "rejected": bad, "answer": answer})
    n_eval = max(1, rows // 6)
    _write_jsonl(folder / "sft.jsonl", sft)
    _write_jsonl(folder / "pref.jsonl", pairs[n_eval:])
    _write_jsonl(folder / "pref_eval.jsonl", pairs[:n_eval])
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("shapes", "tones"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-every", type=int, default=0)
    args = parser.parse_args(argv)
    folder = make_dataset(
        args.kind, args.folder, rows=args.rows, seed=args.seed, text_every=args.text_every
    )
    print(f"wrote {args.rows} {args.kind} rows to {folder}")


if __name__ == "__main__":
    main()
