"""Built-in text-to-image data: coloured shapes on black, and the pixel check of their colour.

Images are 32x32 RGB: one shape (circle, square, triangle, cross) in one of six saturated
colours, one hue every 60 degrees (red, yellow, green, cyan, blue, magenta), at a random size and
place on a black background; the caption names both, "a red circle". Everything is drawn from a
fixed seed, so the files are the same on every machine (`generate`; a test checks the shipped
files against it pixel for pixel).

Six colour x shape combinations (`HELD_OUT`, one per colour) appear only in the held-out sets:
the fine-tuning and preference sets never show them, so the held-out check measures whether
the colour word was learnt, not whether one picture was memorised.

Sets (parquet, because they hold PNG bytes; `data.path=<name>` selects one):
- `t2i-shapes` (512 rows): `image` (PNG bytes) and `text`, the caption; the training
  combinations, each caption true. For diffusion fine-tuning.
- `t2i-shapes-pref` (`PREF_TRAIN_ROWS` pairs) in the Pick-a-Pic shape: `caption`, `jpg_0`,
  `jpg_1` (PNG bytes), `label_0` (1: `jpg_0` is preferred, 0: `jpg_1`; each about half the
  time). The two images are the same shape at the same size and place; the preferred one has
  the caption's colour, the rejected one another colour. For Diffusion-DPO.
- `t2i-shapes-val` (`VAL_ROWS` rows): `image` and `text` as `t2i-shapes`, new pictures (their
  own sizes, places and brightness) of the same training combinations: the held-out set of
  diffusion fine-tuning, from the distribution it trains on (its held-out denoising loss).
- `t2i-shapes-eval` (32 rows): `text`, `image` (a true picture of the caption, for the held-out
  denoising loss) and `seed` (for the held-out generation check), on the held-out combinations.
- `t2i-shapes-pref-eval` (32 pairs): held-out pairs in the Pick-a-Pic shape (the DPO eval loss).

The check (`dominant_colour`, `colour_match_rate`) is a deterministic rule on the pixels: a
pixel counts when it is bright and saturated (HSV value >= `MIN_VALUE`, saturation >=
`MIN_SATURATION`), it votes for the palette colour nearest its hue, and the colour with the most
votes wins (no counted pixel at all: no colour). An image matches its caption when that colour
is the caption's colour word. It is 1.0 on every shipped image (tested).
"""

from __future__ import annotations

import io
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from align_anything.data.builtin import BUILTIN_DATASETS, BUILTIN_DIR

IMAGE_SIZE = 32
BACKGROUND = (0, 0, 0)
# name -> hue in degrees; one every 60 degrees, so each owns a 60-degree sector of the wheel.
COLOUR_HUES: dict[str, int] = {
    "red": 0,
    "yellow": 60,
    "green": 120,
    "cyan": 180,
    "blue": 240,
    "magenta": 300,
}
COLOURS: tuple[str, ...] = tuple(COLOUR_HUES)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
# Shown only in the held-out sets: colour i with shape i mod 4 (each colour once).
HELD_OUT: tuple[tuple[str, str], ...] = tuple(
    (colour, SHAPES[i % len(SHAPES)]) for i, colour in enumerate(COLOURS)
)
# The colour the built-in base model `tiny-t2i-shapes` draws instead of each colour when it
# errs: the previous hue round the wheel (its pre-training called pictures by the next hue, see
# scripts/build_builtin_t2i.py). Half the rejected images of the preference sets have it, as
# pairs sampled from the model itself would (the arith sets' rejected answers likewise are the
# base model's own style).
CONFUSED_WITH: dict[str, str] = {c: COLOURS[(i - 1) % len(COLOURS)] for i, c in enumerate(COLOURS)}
TRAIN_COMBOS: tuple[tuple[str, str], ...] = tuple(
    (c, s) for c in COLOURS for s in SHAPES if (c, s) not in HELD_OUT
)

SEED = 20250722
SFT_ROWS = 512
VAL_ROWS = 256
PREF_TRAIN_ROWS = 512
EVAL_ROWS = 32

# The check's thresholds (HSV on 0..255 values). Anti-aliased edges are darker versions of the
# same hue, so they vote for the right colour too; the black background never counts.
MIN_VALUE = 64
MIN_SATURATION = 0.4
MIN_PIXELS = 4  # fewer counted pixels than this: the image shows no colour

# Shape size (side of the bounding box, pixels) and the margin kept free at the border.
MIN_SIDE, MAX_SIDE, MARGIN = 12, 22, 2
_SUPERSAMPLE = 4  # drawn 4x larger and box-filtered down: smooth edges, as a camera would give

# The built-in sets of this world, by name (their files: `data.builtin.BUILTIN_DATASETS`).
SHAPE_DATASETS: dict[str, str] = {
    name: file for name, file in BUILTIN_DATASETS.items() if name.startswith("t2i-shapes")
}

_CAPTION_WORDS = re.compile(r"[a-z]+")


def caption(colour: str, shape: str) -> str:
    """The caption of one picture: "a red circle"."""
    return f"a {colour} {shape}"


def colour_rgb(colour: str, value: int = 220) -> tuple[int, int, int]:
    """A fully saturated-looking RGB of `colour` at brightness `value` (the largest channel);
    the smallest channel is 30/220 of it, so the hue is exactly the palette's."""
    hue = COLOUR_HUES[colour]
    low = round(value * 30 / 220)
    # hue sector -> which channels are high: 0 r, 60 r+g, 120 g, 180 g+b, 240 b, 300 r+b
    high = {0: (1, 0, 0), 60: (1, 1, 0), 120: (0, 1, 0), 180: (0, 1, 1), 240: (0, 0, 1),
            300: (1, 0, 1)}[hue]  # fmt: skip
    return tuple(value if h else low for h in high)  # type: ignore[return-value]


def draw_shape(
    shape: str, colour: str, *, side: int, centre: tuple[float, float], value: int = 220
) -> Image.Image:
    """One picture: `shape` in `colour` (brightness `value`), its bounding box `side` pixels wide
    around `centre`, on the black background."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    k = _SUPERSAMPLE
    big = Image.new("RGB", (IMAGE_SIZE * k, IMAGE_SIZE * k), BACKGROUND)
    pen = ImageDraw.Draw(big)
    fill = colour_rgb(colour, value)
    cx, cy, half = centre[0] * k, centre[1] * k, side * k / 2
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        inset = half * 0.1  # a square of the same area as the circle looks the same size
        pen.rectangle((box[0] + inset, box[1] + inset, box[2] - inset, box[3] - inset), fill=fill)
    elif shape == "triangle":
        pen.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    else:  # cross: two bars a third of the side wide
        arm = half / 3
        pen.rectangle((cx - arm, box[1], cx + arm, box[3]), fill=fill)
        pen.rectangle((box[0], cy - arm, box[2], cy + arm), fill=fill)
    return big.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)


def random_layout(rng: random.Random) -> dict[str, Any]:
    """A random size, place and brightness for one shape, drawn from `rng`."""
    side = rng.randint(MIN_SIDE, MAX_SIDE)
    lo, hi = MARGIN + side / 2, IMAGE_SIZE - MARGIN - side / 2
    return {
        "side": side,
        "centre": (rng.uniform(lo, hi), rng.uniform(lo, hi)),
        "value": rng.randint(180, 240),
    }


def png_bytes(image: Image.Image) -> bytes:
    """`image` as PNG file bytes (lossless: the check sees exactly the drawn pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def decode_png(data: bytes) -> Image.Image:
    """PNG (or any PIL-readable) bytes -> an RGB image."""
    return Image.open(io.BytesIO(data)).convert("RGB")


# --- the check -----------------------------------------------------------------------------


def caption_colour(text: str) -> str | None:
    """The palette colour word in a caption (the first one), or None when it names none."""
    for word in _CAPTION_WORDS.findall(text.lower()):
        if word in COLOUR_HUES:
            return word
    return None


def colour_votes(image: Image.Image | np.ndarray) -> dict[str, int]:
    """How many bright, saturated pixels of `image` lie nearest each palette hue."""
    rgb = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    if rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise ValueError(f"expected an RGB image (H, W, 3), got shape {rgb.shape}")
    pixels = rgb.reshape(-1, 3).astype(np.float64)
    high, low = pixels.max(axis=1), pixels.min(axis=1)
    chroma = high - low
    counted = (high >= MIN_VALUE) & (chroma >= MIN_SATURATION * np.maximum(high, 1e-9))
    r, g, b = pixels[counted].T
    # Hue in degrees from the RGB chromaticity plane (Preucil's formula; within a few degrees of
    # HSV's hexagonal hue, and a 60-degree sector leaves 30 degrees either side).
    hue = np.degrees(np.arctan2(np.sqrt(3.0) * (g - b), 2 * r - g - b)) % 360
    names = list(COLOUR_HUES)
    centres = np.array([COLOUR_HUES[n] for n in names], dtype=np.float64)
    distance = np.abs((hue[:, None] - centres[None, :] + 180) % 360 - 180)
    nearest = distance.argmin(axis=1)
    counts = np.bincount(nearest, minlength=len(names))
    return {name: int(count) for name, count in zip(names, counts, strict=True)}


def dominant_colour(image: Image.Image | np.ndarray) -> str | None:
    """The palette colour with the most votes (`colour_votes`); None when fewer than
    `MIN_PIXELS` pixels count. Ties go to the colour listed first in `COLOURS`."""
    votes = colour_votes(image)
    if sum(votes.values()) < MIN_PIXELS:
        return None
    return max(COLOURS, key=lambda name: (votes[name], -COLOURS.index(name)))


def colour_matches(
    images: Iterable[Image.Image | np.ndarray], captions: Iterable[str]
) -> list[bool]:
    """Per image: does its dominant colour equal its caption's colour word?"""
    images, captions = list(images), list(captions)
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions")
    out = []
    for image, text in zip(images, captions, strict=True):
        wanted = caption_colour(text)
        out.append(wanted is not None and dominant_colour(image) == wanted)
    return out


def colour_match_rate(images: Sequence[Image.Image | np.ndarray], captions: Sequence[str]) -> float:
    """The held-out check: the share of `images` whose dominant colour is the colour named in
    their caption (0.0 for no images)."""
    matches = colour_matches(images, captions)
    return sum(matches) / len(matches) if matches else 0.0


# --- the sets ------------------------------------------------------------------------------


def _picture_rows(rng: random.Random, combos: Sequence[tuple[str, str]], count: int) -> list[dict]:
    """`count` true pictures, cycling through `combos` (so each appears equally often), shuffled."""
    rows = []
    for index in range(count):
        colour, shape = combos[index % len(combos)]
        layout = random_layout(rng)
        image = draw_shape(shape, colour, **layout)
        rows.append({"image": png_bytes(image), "text": caption(colour, shape)})
    rng.shuffle(rows)
    return rows


def _pair_rows(rng: random.Random, combos: Sequence[tuple[str, str]], count: int) -> list[dict]:
    """`count` preference pairs (Pick-a-Pic columns): the same layout in the caption's colour
    (preferred) and in another colour (rejected), each side first half the time. Half the
    rejected colours are `CONFUSED_WITH` the caption's, the rest any other colour."""
    rows = []
    for index in range(count):
        colour, shape = combos[index % len(combos)]
        if (index // 2) % 2 == 0:
            wrong = CONFUSED_WITH[colour]
        else:
            wrong = rng.choice([c for c in COLOURS if c not in (colour, CONFUSED_WITH[colour])])
        layout = random_layout(rng)
        good = png_bytes(draw_shape(shape, colour, **layout))
        bad = png_bytes(draw_shape(shape, wrong, **layout))
        label_0 = index % 2  # alternate, then shuffle: exactly half the pairs each way round
        first, second = (good, bad) if label_0 == 1 else (bad, good)
        rows.append({"caption": caption(colour, shape), "jpg_0": first, "jpg_1": second,
                     "label_0": float(label_0)})  # fmt: skip
    rng.shuffle(rows)
    return rows


def _eval_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        colour, shape = HELD_OUT[index % len(HELD_OUT)]
        image = draw_shape(shape, colour, **random_layout(rng))
        rows.append({"text": caption(colour, shape), "image": png_bytes(image), "seed": index})
    return rows


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every built-in shapes set, as {name: rows}; deterministic for a given `seed`. Each set has
    its own generator, so changing one set's size leaves the others as they are."""
    return {
        "t2i-shapes": _picture_rows(random.Random(seed), TRAIN_COMBOS, SFT_ROWS),
        "t2i-shapes-pref": _pair_rows(random.Random(seed + 1), TRAIN_COMBOS, PREF_TRAIN_ROWS),
        "t2i-shapes-eval": _eval_rows(random.Random(seed + 2), EVAL_ROWS),
        "t2i-shapes-pref-eval": _pair_rows(random.Random(seed + 3), HELD_OUT, EVAL_ROWS),
        "t2i-shapes-val": _picture_rows(random.Random(seed + 4), TRAIN_COMBOS, VAL_ROWS),
    }


def write_parquet(rows: list[dict], path: Path) -> None:
    """Write `rows` (dicts with the same keys) as one parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    pq.write_table(table, path, compression="zstd")


def read_parquet(path: Path) -> list[dict]:
    """The rows of a parquet file as dicts."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def write_all(directory: Path = BUILTIN_DIR) -> dict[str, int]:
    """Regenerate every shapes set under `directory`; returns {name: row count}."""
    directory.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in generate().items():
        write_parquet(rows, directory / SHAPE_DATASETS[name])
        counts[name] = len(rows)
    return counts


if __name__ == "__main__":
    for name, count in write_all().items():
        print(f"{name}: {count} rows -> {BUILTIN_DIR / SHAPE_DATASETS[name]}")
