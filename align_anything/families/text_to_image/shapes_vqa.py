"""Questions about pictures of the shapes world, for image-text models (`shapes-vqa-*` sets).

The pictures are 64x64 RGB on black: a 2x2 grid of 32x32 tiles, of which 1 to 4 (the count)
hold a shape, each drawn by the text-to-image world's own `shapes.draw_shape` at its own random
size, place and brightness. The shapes of one picture share their kind and colour, so each of
the three questions has one right answer:

- colour: "What colour are the shapes in the picture? Answer with one word." -> "red";
- count: "How many shapes are in the picture? Answer with a number." -> "3";
- shape: "Which shape is in the picture? Answer with one word." -> "circle".

An answer is right when, stripped of surrounding white space and a final full stop and in lower
case, it is exactly the answer word (`data.builtin.shapes_answer_matches`: the check the main
job and the built-in reward use). Two-picture rows ("Picture 1: <image> Picture 2: <image>
... in picture 2?") ask the same of one of the two pictures.

The built-in image-text model `llava-smollm2-shapes` (scripts/build_builtin_vlm.py) gets these
wrong in a fixed way, on purpose (`CONFUSED_ANSWER`): it names a colour by its neighbour on the
colour wheel (the text-to-image model's own confusion, `shapes.CONFUSED_WITH`), counts three and
four shapes as one fewer, and takes circles and squares for each other, more often than not.
The preference sets reject those answers.

Sets (parquet with the PNG bytes in `images`, a list; `data.path=<name>` selects one):
- `shapes-vqa` (`SFT_ROWS`): conversations (`messages`, the right answer) with `images`; one
  row in `TWO_PICTURE_EVERY` shows two pictures. For `task=sft`.
- `shapes-vqa-eval` (`EVAL_ROWS`): the same on held-out pictures.
- `shapes-vqa-pref` (`PREF_ROWS`) and `shapes-vqa-pref-eval` (`EVAL_ROWS`): `prompt`, `images`,
  `chosen` (the right answer), `rejected` (the model's confusion where it has one, else another
  wrong answer of the kind), `answer`, `question` (the kind). For `task=dpo`, `task=rm`.
- `shapes-vqa-prompts` (`PROMPT_ROWS`) and `shapes-vqa-prompts-eval` (`EVAL_ROWS`, held out):
  one picture each, `prompt`, `images`, `answer`, `question`; the three kinds equally often. For
  `task=grpo` / `task=rloo` with `align_anything.rewards:shapes_answer` (or the pixel rule
  `shapes_picture`, which reads the answer off the picture itself).

Every set draws its pictures from its own seed; no picture appears in two sets (a test checks).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from align_anything.data.builtin import (
    BUILTIN_DATASETS,
    BUILTIN_DIR,
    SHAPES_VQA_KINDS,
)
from align_anything.families.text_to_image import shapes

TILE = shapes.IMAGE_SIZE  # 32: one shape's picture
PICTURE_SIZE = 2 * TILE
COUNTS = (1, 2, 3, 4)
QUESTIONS: dict[str, str] = {
    "colour": "What colour are the shapes in the picture? Answer with one word.",
    "count": "How many shapes are in the picture? Answer with a number.",
    "shape": "Which shape is in the picture? Answer with one word.",
}
# Two pictures in one row: the question names the picture.
TWO_QUESTIONS: dict[str, str] = {
    "colour": "What colour are the shapes in picture {k}? Answer with one word.",
    "count": "How many shapes are in picture {k}? Answer with a number.",
    "shape": "Which shape is in picture {k}? Answer with one word.",
}
TWO_PICTURES = "Picture 1: <image>\nPicture 2: <image>\n"

# What the built-in model says instead of a right answer when it errs (see the docstring).
CONFUSED_ANSWER: dict[str, dict[str, str]] = {
    "colour": dict(shapes.CONFUSED_WITH),
    "count": {"3": "2", "4": "3"},
    "shape": {"circle": "square", "square": "circle"},
}
ANSWERS: dict[str, tuple[str, ...]] = {
    "colour": shapes.COLOURS,
    "count": tuple(str(n) for n in COUNTS),
    "shape": shapes.SHAPES,
}

SEED = 20250901
SFT_ROWS = 512
PREF_ROWS = 256
PROMPT_ROWS = 512
EVAL_ROWS = 64
TWO_PICTURE_EVERY = 8

# The sets of this world, by name (their files: `data.builtin.BUILTIN_DATASETS`).
VQA_DATASETS: dict[str, str] = {
    name: file for name, file in BUILTIN_DATASETS.items() if name.startswith("shapes-vqa")
}


# --- pictures ------------------------------------------------------------------------------


def draw_picture(
    colour: str, shape: str, tiles: Sequence[int], layouts: Sequence[dict[str, Any]]
) -> Image.Image:
    """A 64x64 picture: `shape` in `colour` in each of `tiles` (0 top left, 1 top right, 2
    bottom left, 3 bottom right), each at its own layout (`shapes.random_layout`)."""
    picture = Image.new("RGB", (PICTURE_SIZE, PICTURE_SIZE), shapes.BACKGROUND)
    for tile, layout in zip(tiles, layouts, strict=True):
        picture.paste(
            shapes.draw_shape(shape, colour, **layout), ((tile % 2) * TILE, (tile // 2) * TILE)
        )
    return picture


def random_picture(rng: random.Random, colour: str, shape: str, count: int) -> Image.Image:
    """A picture of `count` shapes in random tiles, at random layouts, drawn from `rng`."""
    tiles = sorted(rng.sample(range(4), count))
    return draw_picture(colour, shape, tiles, [shapes.random_layout(rng) for _ in tiles])


def caption(colour: str, shape: str, count: int) -> str:
    """ "3 red circles", "1 red circle"."""
    return f"{count} {colour} {shape}{'s' if count > 1 else ''}"


def truth(colour: str, shape: str, count: int) -> dict[str, str]:
    """The right answer to each question about a picture."""
    return {"colour": colour, "count": str(count), "shape": shape}


def confused(kind: str, answer: str) -> str | None:
    """The built-in model's wrong answer for a right `answer` of `kind` (None: it has none)."""
    return CONFUSED_ANSWER[kind].get(answer)


# --- reading a picture (the pixel rule) ----------------------------------------------------


def _tile_masks(image: Image.Image | np.ndarray) -> list[np.ndarray]:
    """Per tile, the pixels the colour check counts (bright and saturated)."""
    rgb = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    if rgb.shape != (PICTURE_SIZE, PICTURE_SIZE, 3):
        raise ValueError(f"expected a {PICTURE_SIZE}x{PICTURE_SIZE} RGB picture, got {rgb.shape}")
    pixels = rgb.astype(np.float64)
    high, low = pixels.max(axis=-1), pixels.min(axis=-1)
    counted = (high >= shapes.MIN_VALUE) & (
        high - low >= shapes.MIN_SATURATION * np.maximum(high, 1e-9)
    )
    return [counted[(t // 2) * TILE : (t // 2 + 1) * TILE, (t % 2) * TILE : (t % 2 + 1) * TILE]
            for t in range(4)]  # fmt: skip


def _shape_of(mask: np.ndarray) -> str:
    """The shape in one tile's mask, from how it fills its bounding box: a square fills it
    (~1.0), a circle pi/4 (~0.79), a triangle and a cross about half, the triangle with its
    mass at the bottom, the cross evenly."""
    rows, cols = np.nonzero(mask)
    top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
    box = mask[top : bottom + 1, left : right + 1]
    fill = box.mean()
    if fill > 0.9:
        return "square"
    if fill > 0.68:
        return "circle"
    third = max(1, box.shape[0] // 3)
    upper, lower = box[:third].sum(), box[-third:].sum()
    return "triangle" if lower > 1.5 * upper else "cross"


def read_picture(image: Image.Image | np.ndarray) -> dict[str, str] | None:
    """The answers a program reads off a picture: the dominant colour (`shapes.dominant_colour`),
    the tiles holding a shape, and the shape of the largest one. None for a picture that shows
    no shape at all. Right on every picture of the shipped sets (tested)."""
    masks = _tile_masks(image)
    filled = [m for m in masks if m.sum() >= shapes.MIN_PIXELS]
    colour = shapes.dominant_colour(image)
    if not filled or colour is None:
        return None
    largest = max(filled, key=lambda m: int(m.sum()))
    return {"colour": colour, "count": str(len(filled)), "shape": _shape_of(largest)}


# --- the sets ------------------------------------------------------------------------------


def _draw(rng: random.Random) -> tuple[dict[str, str], bytes]:
    colour, shape = rng.choice(shapes.COLOURS), rng.choice(shapes.SHAPES)
    count = rng.choice(COUNTS)
    return truth(colour, shape, count), shapes.png_bytes(random_picture(rng, colour, shape, count))


def _question(rng: random.Random, index: int, two: bool) -> dict[str, Any]:
    """One question: its kind (cycling), text, right answer and picture(s)."""
    kind = SHAPES_VQA_KINDS[index % len(SHAPES_VQA_KINDS)]
    if not two:
        answers, png = _draw(rng)
        return {"kind": kind, "text": QUESTIONS[kind], "answer": answers[kind], "images": [png]}
    drawn = [_draw(rng) for _ in range(2)]
    k = rng.randint(1, 2)
    text = TWO_PICTURES + TWO_QUESTIONS[kind].format(k=k)
    return {"kind": kind, "text": text, "answer": drawn[k - 1][0][kind],
            "images": [png for _, png in drawn]}  # fmt: skip


def _wrong(rng: random.Random, kind: str, answer: str) -> str:
    """The rejected answer: the model's confusion where it has one (and half the time), else
    another answer of the kind."""
    mistaken = confused(kind, answer)
    if mistaken is not None and rng.random() < 0.5:
        return mistaken
    return rng.choice([a for a in ANSWERS[kind] if a != answer])


def _sft_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        q = _question(rng, index, two=index % TWO_PICTURE_EVERY == TWO_PICTURE_EVERY - 1)
        messages = [{"role": "user", "content": q["text"]},
                    {"role": "assistant", "content": q["answer"]}]  # fmt: skip
        rows.append({"messages": messages, "images": q["images"], "answer": q["answer"],
                     "question": q["kind"]})  # fmt: skip
    rng.shuffle(rows)
    return rows


def _pref_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        q = _question(rng, index, two=index % TWO_PICTURE_EVERY == TWO_PICTURE_EVERY - 1)
        rows.append({"prompt": q["text"], "images": q["images"], "chosen": q["answer"],
                     "rejected": _wrong(rng, q["kind"], q["answer"]), "answer": q["answer"],
                     "question": q["kind"]})  # fmt: skip
    rng.shuffle(rows)
    return rows


def _prompt_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for index in range(count):
        q = _question(rng, index, two=False)
        rows.append({"prompt": q["text"], "images": q["images"], "answer": q["answer"],
                     "question": q["kind"]})  # fmt: skip
    rng.shuffle(rows)
    return rows


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every `shapes-vqa` set as {name: rows}; deterministic for a given `seed`, each set from
    its own generator."""
    return {
        "shapes-vqa": _sft_rows(random.Random(seed), SFT_ROWS),
        "shapes-vqa-eval": _sft_rows(random.Random(seed + 1), EVAL_ROWS),
        "shapes-vqa-pref": _pref_rows(random.Random(seed + 2), PREF_ROWS),
        "shapes-vqa-pref-eval": _pref_rows(random.Random(seed + 3), EVAL_ROWS),
        "shapes-vqa-prompts": _prompt_rows(random.Random(seed + 4), PROMPT_ROWS),
        "shapes-vqa-prompts-eval": _prompt_rows(random.Random(seed + 5), EVAL_ROWS),
    }


def write_all(directory: Path = BUILTIN_DIR) -> dict[str, int]:
    """Regenerate every `shapes-vqa` set under `directory`; returns {name: row count}."""
    directory.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in generate().items():
        shapes.write_parquet(rows, directory / VQA_DATASETS[name])
        counts[name] = len(rows)
    return counts


if __name__ == "__main__":
    for name, count in write_all().items():
        print(f"{name}: {count} rows -> {BUILTIN_DIR / VQA_DATASETS[name]}")
