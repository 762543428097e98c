"""Data files past one `datasets` writer batch (1,000 rows), through the real entry point.

`datasets` fixes a column's type from the first batch it writes; a nullable column left untyped
(the drop reason, the media problem) that is None throughout the first 1,000 rows became type
null, and the first dropped row after row 1,000 crashed the run (issue #26). Each data kind gets
a file of 4,400 generated rows whose dropped rows all come after row 1,000, in both halves (with
`data.num_proc=2` each worker process writes its own half, so each half has a drop past its own
first batch): one dropped when its row is converted to a record, one when it is encoded. Each
run trains one step, and its start-up summary names the dropped rows by their lines in the
file. The media set (an image-text model) is converted in one process whatever `num_proc` says;
its unreadable image after row 1,000 is one error naming the line.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from conftest import TINY_MODEL, launch, run_inline

from align_anything.data.convert import LABEL_SHAPE
from align_anything.data.synthetic import make_dataset

# The one-process runs are in-process (conftest.run_inline), those with worker processes are
# launched: what is tested is what they report.
pytestmark = pytest.mark.slow

ROWS = 4400  # 2 worker processes take 2,200 rows each (MIN_ROWS_PER_PROCESS is 2,000)
# Lines (from 1) of the rows each stage drops: past row 1,000 of the file and of each half.
CONVERT_DROPS = (1501, 3701)
ENCODE_DROPS = (1601, 3801)
LONG = "word " * 200  # far past data.max_length=64

COMMON = [
    f"model.name_or_path={TINY_MODEL}", "train.precision=fp32", "deepspeed=z0",
    "train.max_steps=1", "train.per_device_batch_size=2", "data.max_length=64",
    "data.eval_path=null", "data.eval_fraction=0", "checkpoint.save_final=false",
]  # fmt: skip


def _messages(user: str, assistant: str, role: str = "assistant") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": role, "content": assistant}]


def _row(kind: str, i: int, *, convert_drop: bool, long: bool) -> dict:
    """Row `i` of a data kind: a good one, one its conversion drops, or one too long to encode."""
    question = f"(request {i}) What is {i} + 1?" if not long else LONG
    if kind == "pref":  # a missing rejected completion: "missing value in column 'rejected'"
        return {"prompt": question, "chosen": f"{i + 1}",
                "rejected": None if convert_drop else f"{i + 2}"}  # fmt: skip
    if kind == "sft":  # "unknown role 'robot' in column 'messages'"
        return {
            "messages": _messages(question, f"{i + 1}", "robot" if convert_drop else "assistant")
        }
    if kind == "kto":  # "label is not ..."
        label = "maybe" if convert_drop else ("good" if i % 2 else "bad")
        return {"prompt": question, "completion": f"{i + 1 + i % 2}", "label": label}
    assert kind == "prompts"  # "missing value in column 'prompt'"
    return {"prompt": None if convert_drop else question, "answer": f"{i + 1}"}


def _write_rows(path: Path, kind: str) -> Path:
    lines = [
        json.dumps(_row(kind, i, convert_drop=i + 1 in CONVERT_DROPS, long=i + 1 in ENCODE_DROPS))
        for i in range(ROWS)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


TASK_ARGS = {
    "pref": ["task=dpo", "dpo.rpo_alpha=0.0", "dpo.generation_check_samples=0"],
    "sft": ["task=sft"],
    "kto": ["task=kto", "kto.generation_check_samples=0"],
    "prompts": [
        "task=grpo",
        "grpo.num_generations=2",
        "grpo.max_completion_length=4",
        "train.per_device_batch_size=4",
        "grpo.eval_samples=0",
        "reward.functions=[align_anything.rewards:length_penalty]",
    ],  # fmt: skip
}
CONVERT_REASON = {
    "pref": "missing value in column 'rejected'",
    "sft": "unknown role 'robot' in column 'messages'",
    "kto": f"label is not {LABEL_SHAPE}",
    "prompts": "missing value in column 'prompt'",
}


# Two worker processes for every kind (each half has its drops past its own first batch); one
# process for one kind (the same writer, one shard).
@pytest.mark.parametrize(
    ("kind", "num_proc"), [("pref", 1), ("pref", 2), ("sft", 2), ("kto", 2), ("prompts", 2)]
)
def test_drops_past_the_first_writer_batch_are_reported_by_line(
    kind: str, num_proc: int, tmp_path: Path
) -> None:
    data = _write_rows(tmp_path / f"{kind}.jsonl", kind)
    # Worker processes are forked from a process of its own, as a user's run forks them: never
    # from this test worker, which holds the threads and state of every test before it.
    runner = run_inline if num_proc == 1 else launch
    run = runner(
        [
            *COMMON,
            *TASK_ARGS[kind],
            f"data.path={data}",
            f"data.num_proc={num_proc}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],  # fmt: skip
        tmp_path / "run",
    ).check()
    assert "Traceback" not in run.output
    # The start-up summary names the versions a bug report needs (issue #26).
    torch_version = importlib.metadata.version("torch")
    assert run.summary_line("versions").startswith(f"torch {torch_version}, deepspeed ")
    assert f"tokenising {ROWS - len(CONVERT_DROPS)} rows (data.num_proc={num_proc})" in run.output
    assert len(run.train_steps()) == 1
    # The file's report (every row counted), then the encoder's: each names the lines.
    assert (
        f"{data} as " in run.output and f"kept {ROWS - 2} of {ROWS} rows, dropped 2 " in run.output
    )
    converted = f"2  {CONVERT_REASON[kind]} (lines {CONVERT_DROPS[0]}, {CONVERT_DROPS[1]})"
    assert converted in run.output, run.output[-4000:]
    encoded = f"kept {ROWS - 4} of {ROWS - 2} rows, dropped 2 "
    assert encoded in run.output, run.output[-4000:]
    assert f" (lines {ENCODE_DROPS[0]}, {ENCODE_DROPS[1]})" in run.output, run.output[-4000:]


MEDIA_ROWS = 1100
MEDIA_DROP = 1051  # a conversation with an unknown role
MEDIA_LONG = 1061  # text far past data.max_length
MEDIA_MISSING = 1081  # an image that does not exist (the second file only)


@pytest.fixture(scope="module")
def media_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A synthetic image set of 1,100 conversations (`make_dataset`, one PNG each) with a
    dropped row and a long row after row 1,000; and the same with a missing image."""
    folder = make_dataset("shapes", tmp_path_factory.mktemp("media") / "shapes", rows=MEDIA_ROWS)
    rows = [json.loads(line) for line in (folder / "sft.jsonl").read_text().splitlines()]
    rows[MEDIA_DROP - 1]["messages"][1]["role"] = "robot"
    rows[MEDIA_LONG - 1]["messages"][0]["content"] = LONG * 2
    good = folder / "dropped.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows[MEDIA_MISSING - 1]["images"] = ["images/missing.png"]
    bad = folder / "missing.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return good, bad


@pytest.mark.parametrize("num_proc", [1, 2])
def test_media_rows_past_the_first_writer_batch(
    media_files: tuple[Path, Path], num_proc: int, tmp_path: Path
) -> None:
    good, bad = media_files
    args = [
        "task=sft", "model.name_or_path=tiny-random-llava", "train.precision=fp32",
        "deepspeed=z0", "train.max_steps=1", "train.per_device_batch_size=2",
        "data.max_length=256", "data.eval_path=null", "data.eval_fraction=0",
        "checkpoint.save_final=false", f"data.num_proc={num_proc}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    run = run_inline([*args, f"data.path={good}"], tmp_path / "run").check()
    assert len(run.train_steps()) == 1
    assert f"1  unknown role 'robot' in column 'messages' (line {MEDIA_DROP})" in run.output
    assert f"kept {MEDIA_ROWS - 2} of {MEDIA_ROWS - 1} rows, dropped 1 " in run.output
    assert f"(line {MEDIA_LONG})" in run.output, run.output[-4000:]
    failed = run_inline([*args, f"data.path={bad}"], tmp_path / "failed")
    assert failed.returncode == 2, failed.output[-4000:]
    assert "Traceback" not in failed.output
    missing = bad.parent / "images" / "missing.png"
    assert f"line {MEDIA_MISSING}: image file {missing} does not exist" in failed.output
    assert not failed.metrics


# ---------------------------------------------------------------------------- past one JSON chunk

# `datasets`' JSON builder reads 10 MB at a time and casts every later chunk to the first one's
# column types; these rows are ~1 KB, so 12,000 of them span two chunks.
CHUNK_ROWS = 12000
PAD = "x" * 1000


def test_a_bad_value_or_a_new_column_past_the_first_json_chunk_is_one_row(tmp_path: Path) -> None:
    """A number where the other rows have text, on line 11,000, is that row's drop; a column
    first seen on line 11,500 is that row's value. (With `datasets`' builder the first made it
    JSON-encode the column from its chunk on: ~1,000 rows trained on quoted text; the second
    failed the whole file.)"""
    from align_anything.data.formats import load_records

    rows = [{"prompt": f"question {i} {PAD}", "chosen": "yes", "rejected": "no"}
            for i in range(CHUNK_ROWS)]  # fmt: skip
    rows[10999]["chosen"] = 5
    rows[11499]["system"] = "Answer briefly."
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert path.stat().st_size > 11 << 20
    records, report = load_records(str(path), format="preference")
    assert report.summary().endswith(
        f"kept {CHUNK_ROWS - 1} of {CHUNK_ROWS} rows, dropped 1 (line and row numbers of the "
        "file, from 1):\n        1  column 'chosen' is neither text nor a message list (line 11000)"
    ), report.summary()
    assert {r["chosen"][0]["content"] for r in records} == {"yes"}
    assert {r["rejected"][0]["content"] for r in records} == {"no"}
    (system,) = [r for r in records if r["prompt"][0]["role"] == "system"]
    assert system["prompt"][0]["content"] == "Answer briefly."
    assert system["prompt"][1]["content"].startswith("question 11499 ")


def test_a_csv_value_of_another_type_past_the_first_chunk_is_one_row(tmp_path: Path) -> None:
    """`datasets` guesses CSV column types per 10,000 rows: labels 0/1, then "maybe" on data row
    15,001, failed the whole file ("Failed to parse string: 'maybe' as a scalar of type
    int64"). Read as text it is that row's drop, and the margins (text) still count as numbers."""
    import csv

    from align_anything.data.formats import check_margins, load_records

    path = tmp_path / "rows.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["prompt", "completion", "label", "margin"])
        for i in range(25000):
            writer.writerow([f"q{i}", f"a{i}", "maybe" if i == 15000 else i % 2, i % 3 / 2])
    records, report = load_records(str(path))
    assert report.summary().endswith(
        "kept 24999 of 25000 rows, dropped 1 (line and row numbers of the file, from 1):\n"
        f"        1  label is not {LABEL_SHAPE} (row 15001)"
    ), report.summary()
    assert [r["label"] for r in records[:4]] == [False, True, False, True]
    check_margins(records, "margin", str(path))  # "0.5" is a number
