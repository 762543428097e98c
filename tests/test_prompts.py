"""Prompt-only data for online RL (align_anything/data/prompts.py and the `prompt` format):
each accepted form, the fields kept for reward functions, truncation and every drop reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from align_anything.data.formats import check_kind, load_records
from align_anything.errors import ConfigError, DataError
from align_anything.families.language.loading import load_processor, load_tokenizer
from align_anything.families.language.multimodal import MediaSupport
from align_anything.families.language.prompts import (
    ENDS_WITH_ASSISTANT,
    encode_prompt,
    encode_prompts,
    prompt_fields,
    to_prompt_records,
)
from align_anything.families.zoo import resolve_model_path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path("tiny-random-llama"))


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _generation_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# --- forms -------------------------------------------------------------------------------------


def test_prompt_column_text_with_fields(tmp_path, tokenizer) -> None:
    path = _write(
        tmp_path / "p.jsonl",
        [{"prompt": "What is 2 + 3?", "answer": 5, "topic": "sums"},
         {"prompt": "What is 4 + 4?", "answer": 8, "topic": "sums"}],
    )  # fmt: skip
    records, report = load_records(path)
    assert report.format == "prompt" and report.kept == 2
    check_kind(records, "prompt", source=path, task="grpo")
    rows, encoded = encode_prompts(records, tokenizer, max_prompt_length=256)
    assert encoded.kept == 2
    row = rows[0]
    # The ids the model sees before generating: the template with the generation prompt.
    assert row["prompt_ids"] == _generation_ids(tokenizer, [user("What is 2 + 3?")])
    assert tokenizer.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert row["prompt"] == [user("What is 2 + 3?")]
    assert row["fields"] == {"answer": 5, "topic": "sums"}
    assert row["source_row"] == "line 1" and rows[1]["source_row"] == "line 2"


def test_prompt_column_messages_with_system_column(tmp_path, tokenizer) -> None:
    path = _write(
        tmp_path / "m.jsonl",
        [{"prompt": [user("Hi"), {"role": "assistant", "content": "Hello"}, user("Add 1 and 1")],
          "system": "Be terse.", "answer": 2}],
    )  # fmt: skip
    records, _ = load_records(path)
    rows, _ = encode_prompts(records, tokenizer, max_prompt_length=256)
    expected = [{"role": "system", "content": "Be terse."}, user("Hi"),
                {"role": "assistant", "content": "Hello"}, user("Add 1 and 1")]  # fmt: skip
    assert rows[0]["prompt"] == expected
    assert rows[0]["prompt_ids"] == _generation_ids(tokenizer, expected)
    assert rows[0]["fields"] == {"answer": 2}


def test_column_mapping(tmp_path, tokenizer) -> None:
    path = _write(tmp_path / "q.jsonl", [{"question": "Which is larger, 3 or 9?", "answer": 9}])
    records, report = load_records(path, columns={"prompt": "question"})
    assert report.format == "prompt"
    rows, _ = encode_prompts(records, tokenizer, max_prompt_length=256)
    assert rows[0]["prompt"] == [user("Which is larger, 3 or 9?")]
    assert rows[0]["fields"] == {"answer": 9}


def test_conversations_ending_with_a_user_turn(tmp_path, tokenizer) -> None:
    ends_with_user = [user("Hi"), {"role": "assistant", "content": "Hello"}, user("2 + 2?")]
    ends_with_assistant = [user("2 + 2?"), {"role": "assistant", "content": "4"}]
    path = _write(
        tmp_path / "c.jsonl",
        [{"messages": ends_with_user, "answer": 4}, {"messages": ends_with_assistant, "answer": 4}],
    )
    records, report = load_records(path)
    assert report.format == "conversation"
    check_kind(records, "prompt", source=path, task="grpo")  # conversations are accepted
    rows, encoded = encode_prompts(records, tokenizer, max_prompt_length=256)
    assert [r["prompt"] for r in rows] == [ends_with_user]
    assert rows[0]["fields"] == {"answer": 4}
    # The one ending with an assistant turn is dropped and counted, by its line.
    assert encoded.dropped == {ENDS_WITH_ASSISTANT: 1}
    assert encoded.first_rows[ENDS_WITH_ASSISTANT] == ["line 2"]
    # The record-level conversion gives the same prompts (for the held-out generation check).
    converted, report = to_prompt_records(records)
    assert [r["prompt"] for r in converted] == [ends_with_user] and report.kept == 1
    assert converted[0]["answer"] == 4


def test_other_kinds_are_refused_for_prompt_data() -> None:
    pair = {"prompt": [user("a")], "chosen": [], "rejected": []}
    with pytest.raises(DataError, match="task=grpo needs prompt data .* holds preference pairs"):
        check_kind([pair], "prompt", source="p.jsonl", task="grpo")
    # And prompt data is refused where completions are needed.
    with pytest.raises(DataError, match="task=sft needs conversation data, but x holds prompts"):
        check_kind([{"prompt": [user("a")]}], "conversation", source="x", task="sft")


def test_images_are_carried_as_in_the_other_formats(tmp_path, tokenizer) -> None:
    # A real image-text processor writes the expanded placeholders into the prompt; the row
    # carries `images` and `media_tokens` for the collate step, not as reward fields.
    Image.new("RGB", (32, 32), "red").save(tmp_path / "red.png")
    path = _write(tmp_path / "img.jsonl", [{"prompt": "What colour?", "images": ["red.png"],
                                            "answer": "red"}])  # fmt: skip
    records, _ = load_records(path)
    processor = load_processor(resolve_model_path("tiny-random-llava"))
    media = MediaSupport(processor, ("image",))
    records = media.prepare(records, data_path=path)
    rows, report = encode_prompts(records, media.tokenizer, max_prompt_length=4096)
    row = rows[0]
    assert row["images"] == [str(tmp_path / "red.png")]
    assert row["fields"] == {"answer": "red"}
    image_id = media.token_id("image")
    assert row["media_tokens"] > 0
    assert row["prompt_ids"].count(image_id) == row["media_tokens"]
    # Truncation into the placeholders: the row is dropped by the shared media check.
    cut, found = encode_prompts(
        records, media.tokenizer, max_prompt_length=8, truncation="keep_end"
    )
    assert media.drop_cut_rows(cut, found) == []


# --- truncation and drop reasons ---------------------------------------------------------------


def test_truncation_modes(tokenizer) -> None:
    record = {"prompt": [user("one two three four five six seven eight nine ten")]}
    full = _generation_ids(tokenizer, record["prompt"])
    limit = len(full) - 5
    row = encode_prompt(record, tokenizer, max_prompt_length=limit, truncation="keep_end")
    assert row["prompt_ids"] == full[-limit:]
    row = encode_prompt(record, tokenizer, max_prompt_length=limit, truncation="keep_start")
    assert row["prompt_ids"] == full[:limit]
    rows, report = encode_prompts([record], tokenizer, max_prompt_length=limit)
    assert rows == [] and report.dropped == {f"prompt longer than max_prompt_length={limit}": 1}
    # Exactly at the limit: kept whole.
    rows, _ = encode_prompts([record], tokenizer, max_prompt_length=len(full))
    assert rows[0]["prompt_ids"] == full


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"prompt": [user("   ")]}, "empty prompt"),
        ({"prompt": [user("a"), {"role": "assistant", "content": "b"}]},
         "prompt does not end with a user turn"),
        ({"messages": [user("a"), {"role": "assistant", "content": "b"}]}, ENDS_WITH_ASSISTANT),
        ({"answer": 3}, "record without 'prompt' or 'messages'"),
        ({"prompt": 7}, "column 'prompt' is neither text nor a message list"),
    ],
)  # fmt: skip
def test_drop_reasons(tokenizer, record: dict, reason: str) -> None:
    rows, report = encode_prompts([record], tokenizer, max_prompt_length=64)
    assert rows == [] and report.dropped == {reason: 1} and report.total == 1


def test_file_rows_that_cannot_be_prompts_are_counted_at_load(tmp_path) -> None:
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": None}])
    records, report = load_records(path)
    assert report.kept == 1 and report.dropped == {"missing value in column 'prompt'": 1}


def test_bad_arguments(tokenizer) -> None:
    with pytest.raises(ConfigError, match="did you mean 'keep_end'"):
        encode_prompts([], tokenizer, max_prompt_length=8, truncation="keep_ends")
    with pytest.raises(ConfigError, match="max_prompt_length must be an integer of at least 1"):
        encode_prompts([], tokenizer, max_prompt_length=0)


def test_prompt_fields_leave_out_the_prompt_source_and_media() -> None:
    record = {"prompt": [], "_source_row": "line 3", "images": ["a.png"], "media_tokens": 4,
              "answer": 1, "level": "easy"}  # fmt: skip
    assert prompt_fields(record) == {"answer": 1, "level": "easy"}


# --- built-in prompt sets ----------------------------------------------------------------------


def test_builtin_prompt_sets() -> None:
    from align_anything.data.builtin import PROMPT_HINT, generate
    from align_anything.families.language.evaluation import PROPERTY_CHECKS
    from align_anything.rewards import arith_exact

    generated = generate()
    questions = {}
    for name, rows in generated.items():
        texts = set()
        for row in rows:
            text = row["messages"][0]["content"] if "messages" in row else row["prompt"]
            texts.add(
                text[-1]["content"].removesuffix(PROMPT_HINT) if isinstance(text, list) else text
            )
        questions[name] = texts
    held_out = questions["arith-prompts-eval"]
    assert len(held_out) == 64 and len(questions["arith-prompts"]) == 512
    for name, texts in questions.items():
        if name != "arith-prompts-eval":
            assert not held_out & texts, name  # held-out questions are in no other file
    records, report = load_records("arith-prompts-eval")
    assert report.format == "prompt" and report.kept == 64
    first = records[0]
    assert first["prompt"][-1]["content"].endswith(PROMPT_HINT) and len(first["prompt"]) == 3
    # The field reward functions read is the right answer; the generation check agrees.
    assert arith_exact([], [f"Answer: {first['answer']}"], [first["answer"]]) == [1.0]
    assert PROPERTY_CHECKS["arith-prompts-eval"](first, f"Answer: {first['answer']}")
    assert {"arith-prompts", "arith-prompts-eval"} <= set(PROPERTY_CHECKS)
