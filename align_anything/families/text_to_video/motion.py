"""Built-in text-to-video data: a coloured shape moving on black, and the rule check of its
motion and colour.

A video is `FRAMES` frames of 32x32 RGB: one shape (circle or square) in one of six saturated
colours (one hue every 60 degrees), `MIN_SIDE`..`MAX_SIDE` pixels wide, moving in a straight
line at a steady pace left, right, up or down, 10 to 14 pixels over the clip; the caption names
all three, "a red circle moving left". Everything is drawn from a fixed seed, so the files are
the same on every machine (`generate`; a test checks the shipped files against it).

Six colour x direction combinations (`HELD_OUT`, one per colour) appear only in the held-out
sets, so the held-out check measures whether the direction word was learnt, not whether one
clip was memorised.

Sets (parquet, each video a GIF's bytes; `data.path=<name>` selects one):
- `t2v-shapes` (`SFT_ROWS` rows): `video` and `text`, true captions, for fine-tuning;
- `t2v-shapes-pref` (`PREF_TRAIN_ROWS` pairs) in the generic shape `prompt`, `chosen`,
  `rejected`: the chosen clip moves as the caption says, the rejected one is the same clip
  played backwards (the opposite direction, the built-in base model's systematic error);
- `t2v-shapes-eval` (`EVAL_ROWS` rows): `text`, `video` and `seed` (for the held-out check) on
  the held-out combinations; `t2v-shapes-pref-eval`: held-out pairs.

The check (`video_matches`, `match_rate`) is a deterministic rule on the frames: a pixel counts
when it is bright and saturated; each frame with at least `MIN_PIXELS` such pixels gives the
centre of mass of them; the clip's motion is the least-squares slope of those centres over the
frame index (pixels per frame, x and y). A clip matches its caption when the shape is seen in at
least half the frames, it moves at least `MIN_TRAVEL` pixels along the caption's axis in the
caption's direction over the clip and more along that axis than across it, and its dominant
colour (the palette hue with the most counted pixels over all frames) is the caption's. It is
1.0 on every shipped clip (tested).
"""

from __future__ import annotations

import io
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

FRAMES = 9
FRAME_SIZE = 32
FPS = 8  # the frame rate the GIFs are written at (data.fps of the built-in runs)
COLOUR_HUES: dict[str, int] = {"red": 0, "yellow": 60, "green": 120, "cyan": 180, "blue": 240,
                               "magenta": 300}  # fmt: skip
COLOURS: tuple[str, ...] = tuple(COLOUR_HUES)
SHAPES: tuple[str, ...] = ("circle", "square")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
# (dx, dy) per direction, image coordinates (y grows downwards).
STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
HELD_OUT: tuple[tuple[str, str], ...] = tuple(
    (colour, DIRECTIONS[i % len(DIRECTIONS)]) for i, colour in enumerate(COLOURS)
)
TRAIN_COMBOS: tuple[tuple[str, str, str], ...] = tuple(
    (c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS if (c, d) not in HELD_OUT
)
EVAL_COMBOS: tuple[tuple[str, str, str], ...] = tuple(
    (c, s, d) for (c, d) in HELD_OUT for s in SHAPES
)

SEED = 20251203
SFT_ROWS = 256
PREF_TRAIN_ROWS = 256
EVAL_ROWS = 32

MIN_SIDE, MAX_SIDE, MARGIN = 10, 14, 2
MIN_TRAVEL_DRAWN, MAX_TRAVEL_DRAWN = 10.0, 14.0
# The check's thresholds (as the text-to-image shapes check: HSV on 0..255 values).
MIN_VALUE = 64
MIN_SATURATION = 0.4
MIN_PIXELS = 4
MIN_TRAVEL = 4.0  # pixels over the clip along the caption's axis
_SUPERSAMPLE = 4

_WORDS = re.compile(r"[a-z]+")


def caption(colour: str, shape: str, direction: str) -> str:
    """The caption of one clip: "a red circle moving left"."""
    return f"a {colour} {shape} moving {direction}"


def colour_rgb(colour: str, value: int = 220) -> tuple[int, int, int]:
    """A saturated RGB of `colour` at brightness `value` (its largest channel)."""
    low = round(value * 30 / 220)
    high = {0: (1, 0, 0), 60: (1, 1, 0), 120: (0, 1, 0), 180: (0, 1, 1), 240: (0, 0, 1),
            300: (1, 0, 1)}[COLOUR_HUES[colour]]  # fmt: skip
    return tuple(value if h else low for h in high)  # type: ignore[return-value]


def draw_frame(shape: str, colour: str, *, side: float, centre: tuple[float, float],
               value: int = 220) -> np.ndarray:  # fmt: skip
    """One frame [32, 32, 3] uint8: `shape` in `colour`, `side` pixels wide around `centre`,
    drawn 4x larger and box-filtered down (smooth edges)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    k = _SUPERSAMPLE
    big = Image.new("RGB", (FRAME_SIZE * k, FRAME_SIZE * k), (0, 0, 0))
    pen = ImageDraw.Draw(big)
    cx, cy, half = centre[0] * k, centre[1] * k, side * k / 2
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        pen.ellipse(box, fill=colour_rgb(colour, value))
    else:
        inset = half * 0.1
        pen.rectangle((box[0] + inset, box[1] + inset, box[2] - inset, box[3] - inset),
                      fill=colour_rgb(colour, value))  # fmt: skip
    return np.asarray(big.resize((FRAME_SIZE, FRAME_SIZE), Image.Resampling.BOX))


def random_motion(rng: random.Random, direction: str) -> dict[str, Any]:
    """A random size, start, travel and brightness for one clip moving `direction`, the shape
    inside the frame all the way."""
    side = rng.randint(MIN_SIDE, MAX_SIDE)
    travel = rng.uniform(MIN_TRAVEL_DRAWN, MAX_TRAVEL_DRAWN)
    lo, hi = MARGIN + side / 2, FRAME_SIZE - MARGIN - side / 2
    dx, dy = STEP[direction]
    start = []
    for d in (dx, dy):
        if d > 0:
            start.append(rng.uniform(lo, hi - travel))
        elif d < 0:
            start.append(rng.uniform(lo + travel, hi))
        else:
            start.append(rng.uniform(lo, hi))
    return {"side": side, "start": (start[0], start[1]), "travel": travel,
            "value": rng.randint(180, 240)}  # fmt: skip


def draw_video(shape: str, colour: str, direction: str, *, side: float,
               start: tuple[float, float], travel: float, value: int = 220,
               frames: int = FRAMES) -> np.ndarray:  # fmt: skip
    """A clip [frames, 32, 32, 3] uint8: the shape moving `travel` pixels `direction` at a
    steady pace from `start`."""
    dx, dy = STEP[direction]
    out = []
    for f in range(frames):
        t = travel * f / (frames - 1)
        out.append(draw_frame(shape, colour, side=side, value=value,
                              centre=(start[0] + dx * t, start[1] + dy * t)))  # fmt: skip
    return np.stack(out)


def gif_bytes(video: np.ndarray, fps: int = FPS) -> bytes:
    """A clip [F, H, W, 3] uint8 as an animated GIF (each frame its own adaptive palette, no
    dithering: these flat-coloured frames need few colours)."""
    frames = [Image.fromarray(frame).quantize(colors=256, dither=Image.Dither.NONE)
              for frame in video]  # fmt: skip
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:],
                   duration=round(1000 / fps), loop=0, optimize=False, disposal=1)  # fmt: skip
    return buffer.getvalue()


# --- the check -----------------------------------------------------------------------------


def caption_words(text: str) -> tuple[str | None, str | None]:
    """(colour, direction) named in a caption (the first of each), None where it names none."""
    words = _WORDS.findall(text.lower())
    colour = next((w for w in words if w in COLOUR_HUES), None)
    direction = next((w for w in words if w in STEP), None)
    return colour, direction


def _counted(frame: np.ndarray) -> np.ndarray:
    pixels = frame.reshape(-1, 3).astype(np.float64)
    high, low = pixels.max(axis=1), pixels.min(axis=1)
    return (high >= MIN_VALUE) & (high - low >= MIN_SATURATION * np.maximum(high, 1e-9))


def dominant_colour(video: np.ndarray) -> str | None:
    """The palette colour nearest the hue of most bright, saturated pixels over the clip."""
    pixels = video.reshape(-1, 3).astype(np.float64)
    counted = _counted(video.reshape(-1, 3))
    if counted.sum() < MIN_PIXELS:
        return None
    r, g, b = pixels[counted].T
    hue = np.degrees(np.arctan2(np.sqrt(3.0) * (g - b), 2 * r - g - b)) % 360
    centres = np.array(list(COLOUR_HUES.values()), dtype=np.float64)
    nearest = np.abs((hue[:, None] - centres[None, :] + 180) % 360 - 180).argmin(axis=1)
    counts = np.bincount(nearest, minlength=len(COLOURS))
    return COLOURS[int(counts.argmax())]


def motion(video: np.ndarray) -> tuple[float, float] | None:
    """(dx, dy): the shape's travel over the clip in pixels (the least-squares slope of its
    centre over the frame index, times the frames between first and last), from the frames
    where it is seen; None when it is seen in fewer than half of them."""
    frames, centres = [], []
    size = video.shape[2]
    ys, xs = np.divmod(np.arange(video.shape[1] * size), size)
    for index, frame in enumerate(video):
        mask = _counted(frame)
        if mask.sum() >= MIN_PIXELS:
            frames.append(index)
            centres.append((xs[mask].mean(), ys[mask].mean()))
    if len(frames) < max(2, (len(video) + 1) // 2):
        return None
    t = np.asarray(frames, dtype=np.float64)
    points = np.asarray(centres)
    slope = np.polyfit(t, points, 1)[0]  # per frame, (x, y)
    return float(slope[0] * (len(video) - 1)), float(slope[1] * (len(video) - 1))


def video_matches(video: np.ndarray, text: str) -> bool:
    """Does the clip [F, H, W, 3] uint8 show the caption's colour moving in its direction?"""
    colour, direction = caption_words(text)
    travel = motion(np.asarray(video))
    if colour is None or direction is None or travel is None:
        return False
    dx, dy = STEP[direction]
    along = travel[0] * dx + travel[1] * dy
    across = abs(travel[0] * dy) + abs(travel[1] * dx)
    return along >= MIN_TRAVEL and along > across and dominant_colour(video) == colour


def match_rate(videos: Sequence[np.ndarray], captions: Sequence[str]) -> float:
    """The held-out check: the share of clips that match their captions (0.0 for none)."""
    if len(videos) != len(captions):
        raise ValueError(f"{len(videos)} videos but {len(captions)} captions")
    matches = [video_matches(np.asarray(v), c) for v, c in zip(videos, captions, strict=True)]
    return sum(matches) / len(matches) if matches else 0.0


# --- the sets ------------------------------------------------------------------------------


def _clip(rng: random.Random, combo: tuple[str, str, str]) -> np.ndarray:
    colour, shape, direction = combo
    return draw_video(shape, colour, direction, **random_motion(rng, direction))


def _captioned_rows(rng: random.Random, combos: Sequence[tuple[str, str, str]],
                    count: int) -> list[dict]:  # fmt: skip
    rows = []
    for index in range(count):
        combo = combos[index % len(combos)]
        rows.append({"video": gif_bytes(_clip(rng, combo)), "text": caption(*combo)})
    rng.shuffle(rows)
    return rows


def _pair_rows(rng: random.Random, combos: Sequence[tuple[str, str, str]],
               count: int) -> list[dict]:  # fmt: skip
    """The chosen clip moves as the caption says; the rejected one is it played backwards."""
    rows = []
    for index in range(count):
        combo = combos[index % len(combos)]
        clip = _clip(rng, combo)
        rows.append({"prompt": caption(*combo), "chosen": gif_bytes(clip),
                     "rejected": gif_bytes(clip[::-1])})  # fmt: skip
    rng.shuffle(rows)
    return rows


def _eval_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        combo = EVAL_COMBOS[index % len(EVAL_COMBOS)]
        rows.append({"text": caption(*combo), "video": gif_bytes(_clip(rng, combo)),
                     "seed": index})  # fmt: skip
    return rows


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every built-in video set, {name: rows}; deterministic for a given `seed`."""
    return {
        "t2v-shapes": _captioned_rows(random.Random(seed), TRAIN_COMBOS, SFT_ROWS),
        "t2v-shapes-pref": _pair_rows(random.Random(seed + 1), TRAIN_COMBOS, PREF_TRAIN_ROWS),
        "t2v-shapes-eval": _eval_rows(random.Random(seed + 2), EVAL_ROWS),
        "t2v-shapes-pref-eval": _pair_rows(random.Random(seed + 3), EVAL_COMBOS, EVAL_ROWS),
    }


def write_all(directory: Path | None = None) -> dict[str, int]:
    """Regenerate every moving-shapes set (`data/builtin/`); returns {name: row count}."""
    from align_anything.data.builtin import BUILTIN_DATASETS, BUILTIN_DIR

    directory = directory or BUILTIN_DIR
    counts = {}
    for name, rows in generate().items():
        write_parquet(rows, directory / BUILTIN_DATASETS[name])
        counts[name] = len(rows)
    return counts


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, compression="zstd")


def read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


if __name__ == "__main__":
    for set_name, count in write_all().items():
        print(f"{set_name}: {count} rows")
