"""Image-text data as align-anything's users bring it, and bad image-text input: one message
naming the row, before any step.

- align-anything's columns: ranked pairs (`question` / `prompt`, `image`, `response_1`,
  `response_2`, `overall_response`), prompt-only rows (`question`, `image`), supervised rows
  (`prompt`, `image`, `response`), audio in `audio_path`;
- an image a row points at that is missing, an image given to a text-only model, more images
  than the model takes (their tokens alone beyond its context): each one `error:` line that
  names the rows, through the real entry point in-process (no weights are loaded).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from align_anything.data.formats import load_records
from align_anything.families import zoo
from align_anything.families.language import loading
from align_anything.families.language.multimodal import MediaSupport
from align_anything.train import main

pytestmark = pytest.mark.usefixtures("in_process_offline")


def _png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _run(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> str:
    """`main` in-process; the run must end with exit 2 and one `error:` line, no traceback."""
    status = main([*args, f"output_dir={tmp_path / 'out'}", "train.precision=fp32"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    return err


# ---------------------------------------------------------------------------- align-anything's formats


def test_ranked_pairs_with_an_image_column_become_preference_records(tmp_path: Path) -> None:
    """align-anything's AA_TI2T preference rows (a parquet file as `datasets` writes images:
    a {bytes, path} struct), unchanged: the better response is chosen, rows whose
    `overall_response` is not 1 or 2 are dropped and counted."""
    image = {"bytes": _png((200, 30, 30)), "path": None}
    rows = [
        {"question": "What colour?", "image": image, "response_1": "red", "response_2": "blue",
         "overall_response": 1},
        {"question": "What colour?", "image": image, "response_1": "blue", "response_2": "red",
         "overall_response": 2},
        {"question": "What colour?", "image": image, "response_1": "red", "response_2": "blue",
         "overall_response": 3},
    ]  # fmt: skip
    records, report = load_records(str(_write_parquet(tmp_path / "pairs.parquet", rows)))
    assert report.format == "ranked_pair" and report.kept == 2
    assert report.dropped == {"overall_response is not 1 or 2": 1}
    for record in records:
        assert record["prompt"] == [{"role": "user", "content": "What colour?"}]
        assert record["chosen"] == [{"role": "assistant", "content": "red"}]
        assert record["rejected"] == [{"role": "assistant", "content": "blue"}]
        assert record["images"]["bytes"] == image["bytes"]  # one image, under our media key
        assert "question" not in record and "image" not in record


def test_align_anything_prompt_only_supervised_and_audio_rows(tmp_path: Path) -> None:
    png = _png((30, 30, 200))
    prompts, report = load_records(
        str(_write_jsonl(tmp_path / "q.jsonl", [{"question": "How many?", "image": "a.png",
                                                  "answer": "2"}]))
    )  # fmt: skip
    assert report.format == "prompt"
    assert prompts[0]["prompt"] == [{"role": "user", "content": "How many?"}]
    assert prompts[0]["images"] == "a.png" and prompts[0]["answer"] == "2"
    sft, report = load_records(
        str(_write_parquet(tmp_path / "s.parquet", [{"prompt": "Describe.", "image": png,
                                                      "response": "a blue square"}]))
    )  # fmt: skip
    assert report.format == "prompt_response" and sft[0]["images"] == png
    assert sft[0]["messages"][-1] == {"role": "assistant", "content": "a blue square"}
    audio = {"array": [0.0, 0.1, 0.0], "sampling_rate": 16000}
    pairs, report = load_records(
        str(_write_jsonl(tmp_path / "a.jsonl", [{"prompt": "High or low?", "audio_path": audio,
                                                  "response_1": "low", "response_2": "high",
                                                  "overall_response": "2"}]))
    )  # fmt: skip
    assert report.format == "ranked_pair"
    assert pairs[0]["audio"] == audio and pairs[0]["chosen"][0]["content"] == "high"
    # A file with both names keeps ours: `question` stays a field beside `prompt`.
    both, _ = load_records(
        str(_write_jsonl(tmp_path / "b.jsonl", [{"prompt": "P?", "question": "colour"}]))
    )
    assert both[0]["prompt"][0]["content"] == "P?" and both[0]["question"] == "colour"


# ---------------------------------------------------------------------------- bad input, one message


def test_a_missing_image_names_its_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [{"question": "What colour?", "image": "there.png", "response_1": "red",
             "response_2": "blue", "overall_response": 1} for _ in range(3)]  # fmt: skip
    rows[1]["image"] = "gone.png"
    Image.new("RGB", (16, 16), (200, 30, 30)).save(tmp_path / "there.png")
    data = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    err = _run(["task=dpo", "model.name_or_path=tiny-random-llava", f"data.path={data}",
                "data.eval_fraction=0"], tmp_path, capsys)  # fmt: skip
    assert f"line 2: image file {tmp_path / 'gone.png'} does not exist" in err, err
    assert "line 1" not in err and "line 3" not in err


def test_an_image_for_a_text_only_model_names_the_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    Image.new("RGB", (16, 16), (200, 30, 30)).save(tmp_path / "a.png")
    rows = [{"prompt": "Hi?", "response": "Hello."}, {"prompt": "Colour?", "response": "red",
            "images": ["a.png"]}, {"prompt": "Hi?", "response": "Hello."}]  # fmt: skip
    data = _write_jsonl(tmp_path / "sft.jsonl", rows)
    err = _run(["task=sft", "model.name_or_path=tiny-random-llama", f"data.path={data}",
                "data.eval_fraction=0"], tmp_path, capsys)  # fmt: skip
    assert (
        "has images or audio in 1 row(s) (line 2; numbered from 1 as in the file), but model "
        in (err)
    ), err
    assert "tiny-random-llama is a text-only model" in err


def test_more_images_than_the_model_takes_names_the_row(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """tiny-random-llava gives a 16x16 image 16 tokens and has a context of 1024: 65 images
    in one row cannot fit, whatever `data.max_length` says."""
    Image.new("RGB", (16, 16), (200, 30, 30)).save(tmp_path / "a.png")
    rows = [{"prompt": "Colour?", "response": "red", "images": ["a.png"]},
            {"prompt": "Colours?", "response": "red", "images": ["a.png"] * 65}]  # fmt: skip
    data = _write_jsonl(tmp_path / "sft.jsonl", rows)
    err = _run(["task=sft", "model.name_or_path=tiny-random-llava", f"data.path={data}",
                "data.eval_fraction=0"], tmp_path, capsys)  # fmt: skip
    assert "1 row(s) of" in err and "have missing, unreadable or too many media" in err, err
    assert ("line 2: has 65 images (1040 placeholder tokens, 16 for the largest), more than the "
            "model takes: their tokens alone exceed its context of 1024 tokens "
            "(max_position_embeddings)") in err  # fmt: skip


def test_the_context_limit_counts_a_rows_media_together() -> None:
    processor = loading.load_text_side(
        zoo.resolve_model_path("tiny-random-llava"), trust_remote_code=False
    )[2]
    support = MediaSupport(processor, ("image",), context=40)
    png = _png((1, 2, 3))
    record = {"messages": [{"role": "user", "content": "x"}], "images": [png, png]}
    assert support.prepare_record(record, None)["media_tokens"] == 32
    with pytest.raises(Exception, match="has 3 images .48 placeholder tokens"):
        support.prepare_record({**record, "images": [png] * 3}, None)
