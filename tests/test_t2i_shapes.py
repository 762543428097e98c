"""The built-in text-to-image data (`data/shapes.py`), its colour check, and the built-in model
`tiny-t2i-shapes` (`models/t2i_shapes.py`, trained by `scripts/build_builtin_t2i.py`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from align_anything.data.builtin import builtin_path
from align_anything.families.text_to_image import shapes
from align_anything.families.text_to_image import shapes_model as t2i_shapes


def _same_rows(shipped: list[dict], generated: list[dict]) -> bool:
    """Equal rows; PNGs are equal when their pixels are (the bytes may differ across zlib
    builds, so only differing bytes are decoded)."""
    if len(shipped) != len(generated):
        return False
    for a, b in zip(shipped, generated, strict=True):
        if a.keys() != b.keys():
            return False
        for key, value in a.items():
            other = b[key]
            if isinstance(value, bytes) and value != other:
                pixels = np.asarray(shapes.decode_png(value)), np.asarray(shapes.decode_png(other))
                if not np.array_equal(*pixels):
                    return False
            elif not isinstance(value, bytes) and value != other:
                return False
    return True


@pytest.fixture(scope="module")
def generated() -> dict[str, list[dict]]:
    return shapes.generate()


def _pair_sides(row: dict) -> tuple[Image.Image, Image.Image]:
    """(preferred, rejected) images of a Pick-a-Pic row."""
    first, second = shapes.decode_png(row["jpg_0"]), shapes.decode_png(row["jpg_1"])
    return (first, second) if row["label_0"] == 1.0 else (second, first)


def test_shipped_files_equal_their_generator(generated) -> None:
    for name, filename in shapes.SHAPE_DATASETS.items():
        path = builtin_path(name)
        assert path is not None and path.name == filename
        assert _same_rows(shapes.read_parquet(path), generated[name]), name


def test_set_sizes_and_columns(generated) -> None:
    assert {n: len(r) for n, r in generated.items()} == {
        "t2i-shapes": shapes.SFT_ROWS, "t2i-shapes-pref": shapes.PREF_TRAIN_ROWS,
        "t2i-shapes-eval": 32, "t2i-shapes-pref-eval": 32, "t2i-shapes-val": shapes.VAL_ROWS,
    }  # fmt: skip
    assert (
        set(generated["t2i-shapes"][0]) == set(generated["t2i-shapes-val"][0]) == {"image", "text"}
    )
    assert set(generated["t2i-shapes-eval"][0]) == {"image", "text", "seed"}
    for name in ("t2i-shapes-pref", "t2i-shapes-pref-eval"):
        rows = generated[name]
        assert set(rows[0]) == {"caption", "jpg_0", "jpg_1", "label_0"}
        # each side preferred exactly half the time, so "always the first" learns nothing
        assert sum(r["label_0"] for r in rows) == len(rows) / 2
    assert [r["seed"] for r in generated["t2i-shapes-eval"]] == list(range(32))


def test_held_out_combinations_are_only_in_the_held_out_sets(generated) -> None:
    held_out = {shapes.caption(c, s) for c, s in shapes.HELD_OUT}
    assert len(held_out) == len(shapes.COLOURS)  # one per colour
    assert {shapes.caption_colour(t) for t in held_out} == set(shapes.COLOURS)
    train_texts = {r["text"] for r in generated["t2i-shapes"]}
    train_texts |= {r["caption"] for r in generated["t2i-shapes-pref"]}
    assert train_texts == {shapes.caption(c, s) for c, s in shapes.TRAIN_COMBOS}
    assert not train_texts & held_out
    # the fine-tuning set's held-out pictures: its own combinations, none of its pictures
    val = generated["t2i-shapes-val"]
    assert {r["text"] for r in val} == train_texts
    assert not {r["image"] for r in val} & {r["image"] for r in generated["t2i-shapes"]}
    assert {r["text"] for r in generated["t2i-shapes-eval"]} == held_out
    assert {r["caption"] for r in generated["t2i-shapes-pref-eval"]} == held_out


def test_the_check_is_one_on_every_true_picture_and_zero_on_every_rejected_one(generated) -> None:
    for name in ("t2i-shapes", "t2i-shapes-val", "t2i-shapes-eval"):
        rows = generated[name]
        images = [shapes.decode_png(r["image"]) for r in rows]
        assert shapes.colour_match_rate(images, [r["text"] for r in rows]) == 1.0, name
    for name in ("t2i-shapes-pref", "t2i-shapes-pref-eval"):
        rows = generated[name]
        good, bad = zip(*(_pair_sides(r) for r in rows), strict=True)
        captions = [r["caption"] for r in rows]
        assert shapes.colour_match_rate(good, captions) == 1.0, name
        assert shapes.colour_match_rate(bad, captions) == 0.0, name


def test_half_the_rejected_colours_are_the_base_models_confusion(generated) -> None:
    assert shapes.CONFUSED_WITH["red"] == "magenta" and shapes.CONFUSED_WITH["cyan"] == "green"
    for name in ("t2i-shapes-pref", "t2i-shapes-pref-eval"):
        rows = generated[name]
        confused = sum(
            shapes.dominant_colour(_pair_sides(r)[1])
            == shapes.CONFUSED_WITH[shapes.caption_colour(r["caption"])]
            for r in rows
        )
        assert confused == len(rows) / 2, name


def test_a_pair_differs_only_in_colour(generated) -> None:
    """Same shape, size and place: the only thing a preference can teach is the colour."""
    for row in generated["t2i-shapes-pref"][:64]:
        good, bad = (np.asarray(image) for image in _pair_sides(row))
        assert ((good.max(axis=2) > 0) == (bad.max(axis=2) > 0)).all()
        assert shapes.dominant_colour(good) != shapes.dominant_colour(bad)


def test_the_check_on_wrong_pictures() -> None:
    layout = {"side": 16, "centre": (16.0, 16.0)}
    for colour in shapes.COLOURS:
        for shape in shapes.SHAPES:
            image = shapes.draw_shape(shape, colour, **layout)
            assert shapes.dominant_colour(image) == colour
            others = [c for c in shapes.COLOURS if c != colour]
            assert (
                shapes.colour_matches([image] * 5, [f"a {c} {shape}" for c in others])
                == [False] * 5
            )
    black = Image.new("RGB", (32, 32))
    assert shapes.dominant_colour(black) is None
    assert shapes.colour_match_rate([black], ["a red circle"]) == 0.0
    # grey and white pixels are not saturated: they count for no colour
    assert shapes.dominant_colour(Image.new("RGB", (32, 32), (200, 200, 200))) is None
    # a caption without a colour word never matches
    red = shapes.draw_shape("circle", "red", **layout)
    assert shapes.colour_matches([red], ["a circle"]) == [False]
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        shapes.colour_matches([red, red], ["a red circle"])


def test_dominant_colour_by_hand_derived_hues() -> None:
    """Hue = atan2(sqrt(3) (g - b), 2r - g - b); each colour owns the 60 degrees around its hue."""

    def one(rgb: tuple[int, int, int], count: int = 10) -> np.ndarray:
        return np.array([[rgb] * count], dtype=np.uint8)

    assert shapes.dominant_colour(one((200, 100, 30))) == "red"  # hue 24.2 degrees
    assert shapes.dominant_colour(one((200, 130, 30))) == "yellow"  # hue 35.8 degrees
    assert shapes.dominant_colour(one((30, 30, 200))) == "blue"  # hue 240
    assert shapes.dominant_colour(one((100, 12, 12))) == "red"  # dark but saturated: counts
    assert shapes.dominant_colour(one((60, 10, 10))) is None  # value 60 < 64: background
    assert shapes.dominant_colour(one((200, 150, 130))) is None  # saturation 0.35 < 0.4
    assert shapes.dominant_colour(one((200, 30, 30), count=3)) is None  # fewer than 4 pixels
    # the most votes win: 6 blue pixels beat 5 red ones; a tie goes to the earlier colour
    mixed = np.concatenate([one((30, 30, 200), 6), one((200, 30, 30), 5)], axis=1)
    assert shapes.dominant_colour(mixed) == "blue"
    tie = np.concatenate([one((30, 30, 200), 5), one((200, 30, 30), 5)], axis=1)
    assert shapes.dominant_colour(tie) == "red"


def test_caption_colour() -> None:
    assert shapes.caption_colour("a red circle") == "red"
    assert shapes.caption_colour("A Magenta square, please") == "magenta"
    assert shapes.caption_colour("a circle") is None
    assert shapes.caption_colour("a reddish circle") is None  # whole words only


def test_builtin_names_load_through_the_data_layer() -> None:
    from align_anything.data.sources import load_dataset

    dataset, where, _, files = load_dataset("t2i-shapes-pref", "train")
    assert where == "t2i-shapes-pref (built-in)" and files == [builtin_path("t2i-shapes-pref")]
    assert len(dataset) == shapes.PREF_TRAIN_ROWS
    row = dataset[0]
    assert isinstance(row["jpg_0"], bytes) and row["label_0"] in (0.0, 1.0)
    assert shapes.decode_png(row["jpg_0"]).size == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE)


def test_tokenizer_gives_each_caption_word_one_token() -> None:
    tokenizer = t2i_shapes.build_tokenizer()
    for word in t2i_shapes.VOCAB_WORDS:
        assert tokenizer.tokenize(word) == [f"{word}</w>"], word
    ids = tokenizer(
        "a cyan cross", padding="max_length", max_length=t2i_shapes.MAX_TOKENS
    ).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<|startoftext|>", "a</w>", "cyan</w>", "cross</w>", *["<|endoftext|>"] * 4
    ]  # fmt: skip
    # any other word is spelt in known pieces, never the unknown token
    assert tokenizer.tokenize("purple") == ["p", "u", "r", "p", "le</w>"]


def test_shipped_tokenizer_files_are_the_builders() -> None:
    vocab, merges = t2i_shapes.tokenizer_files()
    folder = t2i_shapes.SHIPPED_DIR / "tokenizer"
    assert json.loads((folder / "vocab.json").read_text()) == vocab
    lines = (folder / "merges.txt").read_text().splitlines()
    assert lines[0] == "#version: 0.2" and [tuple(m.split()) for m in lines[1:]] == merges


def test_builtin_model_name_resolves_to_the_shipped_pipeline() -> None:
    from align_anything.families.zoo import resolve_model_path

    folder = t2i_shapes.SHIPPED_DIR
    assert resolve_model_path(t2i_shapes.NAME) == str(folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["safety_checker"] == [None, None] and index["requires_safety_checker"] is False
    suffixes = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
    weights = [p for p in folder.rglob("*") if p.is_file() and p.suffix in suffixes]
    assert sorted(p.parent.name for p in weights) == ["text_encoder", "unet", "vae"]
    assert all(p.suffix == ".safetensors" for p in weights)
    assert sum(p.stat().st_size for p in weights) < 20 * 2**20


def test_random_components_make_a_pipeline_of_the_shipped_architecture() -> None:
    """`build_components` (tests' random-weight twin) has the shipped model's configs."""
    parts = t2i_shapes.build_components(seed=0)
    for name in ("unet", "vae", "text_encoder"):
        shipped = json.loads((t2i_shapes.SHIPPED_DIR / name / "config.json").read_text())
        built = parts[name].config
        built = built.to_dict() if hasattr(built, "to_dict") else dict(built)
        built = json.loads(json.dumps(built, default=str))  # tuples as the saved lists
        skip = {"_name_or_path", "_diffusers_version", "transformers_version", "scaling_factor",
                "architectures", "dtype", "torch_dtype", "_class_name"}  # fmt: skip
        differing = {k for k in shipped if k not in skip and shipped[k] != built.get(k, shipped[k])}
        assert not differing, (name, {k: (shipped[k], built.get(k)) for k in differing})


@pytest.mark.slow
def test_shipped_model_draws_shapes_but_not_their_colour() -> None:
    """The base model of the text-to-image main job: on the 32 held-out captions (their seeds,
    DDIM 20 steps, fp32 CPU) nearly every image shows a coloured shape, and the caption's colour
    at most half the time, so the alignment run has something to fix."""
    import torch
    from diffusers import DiffusionPipeline

    torch.manual_seed(0)
    pipeline = DiffusionPipeline.from_pretrained(t2i_shapes.SHIPPED_DIR)
    pipeline.set_progress_bar_config(disable=True)
    rows = shapes.read_parquet(builtin_path("t2i-shapes-eval"))
    captions = [r["text"] for r in rows]
    images = t2i_shapes.sample_images(pipeline, captions, [r["seed"] for r in rows], steps=20)
    assert all(image.size == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE) for image in images)
    coloured = [shapes.dominant_colour(image) is not None for image in images]
    assert sum(coloured) >= 30
    assert shapes.colour_match_rate(images, captions) <= 0.5
