"""Questions about the shapes world's pictures (`families/text_to_image/shapes_vqa.py`): the
shipped `shapes-vqa-*` sets against their generator, their answers against the pictures, the
answer check, and the built-in rewards that check an answer against the data or the picture.
In process, seconds."""

from __future__ import annotations

import collections
import io
import json

import numpy as np
import pytest
from PIL import Image

from align_anything.data.builtin import builtin_path, shapes_answer_matches, shapes_vqa_check
from align_anything.families.text_to_image import shapes, shapes_vqa
from align_anything.rewards import shapes_answer, shapes_picture
from align_anything.rewards.remote import media_json


@pytest.fixture(scope="module")
def generated() -> dict[str, list[dict]]:
    return shapes_vqa.generate()


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(shapes.decode_png(png))


def test_shipped_files_equal_their_generator(generated) -> None:
    """Every file, row for row; pictures compared by their pixels (PNG bytes may differ
    across zlib builds)."""
    for name, filename in shapes_vqa.VQA_DATASETS.items():
        path = builtin_path(name)
        assert path is not None and path.name == filename
        shipped = shapes.read_parquet(path)
        assert len(shipped) == len(generated[name]), name
        for a, b in zip(shipped, generated[name], strict=True):
            assert {k: v for k, v in a.items() if k != "images"} == {
                k: v for k, v in b.items() if k != "images"
            }
            assert len(a["images"]) == len(b["images"])
            assert all(np.array_equal(_pixels(x), _pixels(y))
                       for x, y in zip(a["images"], b["images"], strict=True))  # fmt: skip


def test_sizes_kinds_and_columns(generated) -> None:
    sizes = {n: len(r) for n, r in generated.items()}
    assert sizes == {
        "shapes-vqa": shapes_vqa.SFT_ROWS, "shapes-vqa-eval": shapes_vqa.EVAL_ROWS,
        "shapes-vqa-pref": shapes_vqa.PREF_ROWS, "shapes-vqa-pref-eval": shapes_vqa.EVAL_ROWS,
        "shapes-vqa-prompts": shapes_vqa.PROMPT_ROWS,
        "shapes-vqa-prompts-eval": shapes_vqa.EVAL_ROWS,
    }  # fmt: skip
    for name, rows in generated.items():
        kinds = collections.Counter(r["question"] for r in rows)
        assert set(kinds) == {"colour", "count", "shape"}, name
        assert max(kinds.values()) - min(kinds.values()) <= 1, name  # the kinds equally often
        for row in rows:
            assert row["answer"] in shapes_vqa.ANSWERS[row["question"]]
    assert set(generated["shapes-vqa"][0]) == {"messages", "images", "answer", "question"}
    assert set(generated["shapes-vqa-pref"][0]) == {
        "prompt", "images", "chosen", "rejected", "answer", "question"
    }  # fmt: skip
    assert set(generated["shapes-vqa-prompts"][0]) == {"prompt", "images", "answer", "question"}
    # Two-picture rows in the SFT and preference sets, one picture in the prompt sets.
    for name in ("shapes-vqa", "shapes-vqa-pref"):
        two = [r for r in generated[name] if len(r["images"]) == 2]
        assert len(two) == len(generated[name]) // shapes_vqa.TWO_PICTURE_EVERY, name
        text = two[0]["messages"][0]["content"] if "messages" in two[0] else two[0]["prompt"]
        assert text.count("<image>") == 2
    assert all(len(r["images"]) == 1 for r in generated["shapes-vqa-prompts"])


def test_no_picture_is_in_two_sets(generated) -> None:
    seen: dict[bytes, str] = {}
    for name, rows in generated.items():
        for row in rows:
            for png in row["images"]:
                key = _pixels(png).tobytes()
                assert seen.setdefault(key, name) == name, f"a picture of {name} is in {seen[key]}"


def test_every_answer_is_what_the_picture_shows(generated) -> None:
    """The pixel rule (`read_picture`) reads every single picture's colour, count and shape as
    the row says; two-picture rows ask about the picture they name."""
    for rows in generated.values():
        for row in rows:
            pictures = [shapes.decode_png(p) for p in row["images"]]
            text = row["prompt"] if "prompt" in row else row["messages"][0]["content"]
            index = 1 if "picture 2" in text else 0
            assert shapes_vqa.read_picture(pictures[index])[row["question"]] == row["answer"]
            if "chosen" in row:
                assert row["chosen"] == row["answer"] != row["rejected"]
                assert row["rejected"] in shapes_vqa.ANSWERS[row["question"]]


def test_rejected_answers_are_the_models_confusion_half_the_time(generated) -> None:
    rows = generated["shapes-vqa-pref"]
    confusable = [r for r in rows if shapes_vqa.confused(r["question"], r["answer"])]
    confused = [r for r in confusable
                if r["rejected"] == shapes_vqa.confused(r["question"], r["answer"])]  # fmt: skip
    assert 0.35 < len(confused) / len(confusable) < 0.75


def test_pictures_are_64_pixels_with_one_to_four_shapes() -> None:
    picture = shapes_vqa.draw_picture(
        "cyan", "triangle", [0, 3], [shapes.random_layout(__import__("random").Random(1))] * 2
    )
    assert picture.size == (64, 64)
    assert shapes_vqa.read_picture(picture) == {"colour": "cyan", "count": "2",
                                                "shape": "triangle"}  # fmt: skip
    assert shapes_vqa.read_picture(Image.new("RGB", (64, 64))) is None
    with pytest.raises(ValueError, match="64x64"):
        shapes_vqa.read_picture(Image.new("RGB", (32, 32)))
    assert shapes_vqa.caption("red", "circle", 1) == "1 red circle"
    assert shapes_vqa.caption("red", "circle", 3) == "3 red circles"


@pytest.mark.parametrize(
    ("answer", "generated", "expected"),
    [("red", "red", True), ("red", " Red. ", True), ("3", "3", True), ("red", "red.\n", True),
     ("red", "magenta", False), ("3", "three", False), ("3", "3 circles", False),
     ("circle", "circles", False), ("red", "red and blue", False), (None, "red", False),
     ("red", "", False)],
)  # fmt: skip
def test_answer_check(answer, generated, expected) -> None:
    assert shapes_answer_matches(answer, generated) is expected
    assert shapes_vqa_check({"answer": answer}, generated) is expected


def test_shapes_answer_reward() -> None:
    assert shapes_answer(["q"] * 3, ["red", "Blue.", "red"], ["red", "blue", None]) == [
        1.0, 1.0, None
    ]  # fmt: skip


def test_shapes_picture_reward_reads_the_answer_off_the_picture(generated) -> None:
    """The rule gets the row's picture (`prompt_images`), not its answer column: a right answer
    scores 1 whatever the data says, a wrong one 0; None without exactly one picture or for a
    question it does not know."""
    rows = generated["shapes-vqa-prompts-eval"][:9]
    images = [[shapes.decode_png(r["images"][0])] for r in rows]
    right = [r["answer"] for r in rows]
    wrong = [next(a for a in shapes_vqa.ANSWERS[r["question"]] if a != r["answer"]) for r in rows]
    prompts = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    assert shapes_picture(prompts, right, images) == [1.0] * 9  # the kind from the question
    assert (
        shapes_picture(prompts, wrong, images, question=[r["question"] for r in rows]) == [0.0] * 9
    )
    two = images[0] + images[1]
    assert shapes_picture(["What colour are the shapes?"] * 3, ["red"] * 3,
                          [[], two, images[0]]) [:2] == [None, None]  # fmt: skip
    assert shapes_picture(["Tell me a story."], ["red"], [images[0]]) == [None]
    assert shapes_picture(["What colour is it?"], ["red"], [[Image.new("RGB", (32, 32))]]) == [None]


def test_remote_rewards_get_pictures_as_base64_png() -> None:
    """`prompt_images` cross the wire as base64 PNG, losslessly; audio arrays as lists."""
    import base64

    picture = shapes_vqa.random_picture(__import__("random").Random(3), "blue", "cross", 3)
    body = json.loads(json.dumps({"prompt_images": [[picture]],
                                  "prompt_audio": [[np.zeros(3, dtype=np.float32)]]},
                                 default=media_json))  # fmt: skip
    back = Image.open(io.BytesIO(base64.b64decode(body["prompt_images"][0][0])))
    assert back.format == "PNG" and np.array_equal(np.asarray(back), np.asarray(picture))
    assert body["prompt_audio"] == [[[0.0, 0.0, 0.0]]]
    with pytest.raises(TypeError, match="object"):
        json.dumps({"x": object()}, default=media_json)
