"""The tokenised-data cache and the Arrow pipeline (`data.pipeline`, `data.cache`): the same
rows and reports as the list encoders, the cache key, damaged entries, mixtures, bad input, and
through the real entry point a miss then a hit, and two ranks sharing one entry."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import HH_FILE, TINY_MODEL, launch, run_inline

from align_anything.data import cache as data_cache
from align_anything.data.formats import load_records, unpair
from align_anything.errors import ConfigError, DataError
from align_anything.families.language import token_cache as cache
from align_anything.families.language.encode import (
    Encoding,
    encode_preference,
    encode_sft,
    encode_unpaired,
)
from align_anything.families.language.pipeline import Source, Spec, mixture_rows
from align_anything.families.language.prompts import encode_prompts
from align_anything.train import main

TINY = f"model.name_or_path={TINY_MODEL}"


@pytest.fixture(scope="module")
def tokenizer():
    from align_anything.families import zoo
    from align_anything.families.language import loading

    return loading.load_text_side(zoo.resolve_model_path(TINY_MODEL), trust_remote_code=False)[1]


@pytest.fixture(scope="module")
def hh_sample(tmp_path_factory) -> Path:
    """The first 120 HH-RLHF pairs, or all the file has (the sample shipped in tests/data holds 64);
    a few of them are too long for max_length=256 and dropped."""
    path = tmp_path_factory.mktemp("hh") / "hh.jsonl"
    with gzip.open(HH_FILE, "rt") as handle:
        path.write_text("".join(itertools.islice(handle, 120)))
    return path


def spec(path: str, encoding: Encoding, **changes) -> Spec:
    base = Spec(
        train=(Source(path, "auto", {}),), eval=(), eval_fraction=0.1, seed=7, max_train=None,
        max_eval=None, task="dpo", kind="preference", encoding=encoding, max_length=256,
        truncation="drop",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def prepare(s: Spec, tokenizer, root: Path, num_proc: int = 1) -> cache.Prepared:
    parts = cache.key_parts(s, tokenizer=tokenizer, media=None)
    note = cache.ensure(s, parts, root=root, tokenizer=tokenizer, media=None, model_name="tiny",
                        num_proc=num_proc)  # fmt: skip
    return cache.open_prepared(cache.folder_for(root, s, parts), note=note)


# ---------------------------------------------------------------------------- same as the lists


def test_arrow_rows_and_reports_equal_the_list_encoders(tokenizer, hh_sample, tmp_path) -> None:
    from align_anything.data.formats import split_records

    s = spec(str(hh_sample), Encoding("preference"))
    got = prepare(s, tokenizer, tmp_path / "cache")
    records, found = load_records(str(hh_sample))
    train, held_out = split_records(records, eval_fraction=0.1, seed=7)
    want, want_report = encode_preference(train, tokenizer, max_length=256)
    want_eval, _ = encode_preference(held_out, tokenizer, max_length=256)
    assert [got.train[i] for i in range(len(got.train))] == want
    assert [got.eval[i] for i in range(len(got.eval))] == want_eval
    assert got.reports[0].summary() == found.summary()
    assert got.reports[1].summary() == f"train split, {want_report.summary()}"
    assert sum(want_report.dropped.values()) > 0  # the drop reasons and row numbers are kept
    assert got.eval_records[:3] == held_out[:3]
    lengths = [sum(len(v) for k, v in r.items() if k.endswith("ids")) for r in want]
    assert got.train.lengths().tolist() == lengths


def test_worker_processes_give_the_same_rows_and_row_numbers(
    tokenizer, hh_sample, tmp_path, monkeypatch
) -> None:
    from align_anything.families.language import pipeline

    s = spec(str(hh_sample), Encoding("preference"))
    one = prepare(s, tokenizer, tmp_path / "one", num_proc=1)
    monkeypatch.setattr(pipeline, "MIN_ROWS_PER_PROCESS", 10)  # 120 rows: 2 worker processes
    two = prepare(s, tokenizer, tmp_path / "two", num_proc=2)
    assert [r.summary() for r in two.reports] == [r.summary() for r in one.reports]
    assert [two.train[i] for i in range(len(two.train))] == [
        one.train[i] for i in range(len(one.train))
    ]


def test_sft_and_unpaired_rows_equal_the_list_encoders(tokenizer, tmp_path) -> None:
    records, _ = load_records("arith-sft")
    got = prepare(spec("arith-sft", Encoding("sft", all_labels=True), eval_fraction=0.0,
                       kind="conversation", task="sft"), tokenizer, tmp_path / "c")  # fmt: skip
    want, _ = encode_sft(records, tokenizer, max_length=256)
    assert [got.train[i] for i in range(len(got.train))] == [
        {**row, "labels": row["input_ids"]} for row in want
    ]
    records, _ = load_records("arith-pref")
    got = prepare(spec("arith-pref", Encoding("unpaired", unpair=True), eval_fraction=0.0,
                       kind="unpaired", task="kto"), tokenizer, tmp_path / "c")  # fmt: skip
    want, _ = encode_unpaired(unpair(records), tokenizer, max_length=256)
    assert [got.train[i] for i in range(len(got.train))] == want  # desirable rows first
    assert got.train.column("label").tolist() == [row["label"] for row in want]


# ---------------------------------------------------------------------------- the key, damage


def test_second_prepare_is_a_cache_hit_and_the_key_follows_its_inputs(
    tokenizer, hh_sample, tmp_path
) -> None:
    root = tmp_path / "cache"
    s = spec(str(hh_sample), Encoding("preference"))
    assert prepare(s, tokenizer, root).note.startswith("tokenised ")
    assert prepare(s, tokenizer, root).note.startswith("cache hit ")
    key = cache.folder_for(root, s, cache.key_parts(s, tokenizer=tokenizer, media=None))
    changed_length = dataclasses.replace(s, max_length=200)
    assert prepare(changed_length, tokenizer, root).note.startswith("tokenised ")
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = original.replace("<|im_start|>", "<|im_start|> ")
        other = cache.folder_for(root, s, cache.key_parts(s, tokenizer=tokenizer, media=None))
        assert other != key
        assert prepare(s, tokenizer, root).note.startswith("tokenised ")
    finally:
        tokenizer.chat_template = original
    # The data file's content is in the key too.
    edited = tmp_path / "edited.jsonl"
    edited.write_text(hh_sample.read_text().replace("Human:", "Human: ", 1))
    moved = spec(str(edited), Encoding("preference"))
    a = cache.key_parts(moved, tokenizer=tokenizer, media=None)
    edited.write_text(hh_sample.read_text())
    b = cache.key_parts(moved, tokenizer=tokenizer, media=None)
    assert cache.data_fingerprint(a) != cache.data_fingerprint(b)
    # A change of only the held-out cap keeps the training rows' fingerprint.
    capped = cache.key_parts(dataclasses.replace(moved, max_eval=3), tokenizer=tokenizer,
                             media=None)  # fmt: skip
    assert cache.data_fingerprint(capped) == cache.data_fingerprint(b)


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest", "missing-file"])
def test_a_damaged_cache_is_detected_and_rebuilt(tokenizer, hh_sample, tmp_path, damage) -> None:
    root = tmp_path / "cache"
    s = spec(str(hh_sample), Encoding("preference"))
    first = prepare(s, tokenizer, root)
    want = [first.train[i] for i in range(len(first.train))]
    arrow = next((first.folder / "train").glob("*.arrow"))
    if damage == "truncate":  # a half-written file
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    elif damage == "flip":  # same size, other bytes
        data = bytearray(arrow.read_bytes())
        data[len(data) // 2] ^= 0xFF
        arrow.write_bytes(bytes(data))
    elif damage == "no-manifest":  # a build that stopped before its manifest
        (first.folder / data_cache.MANIFEST).unlink()
    else:
        arrow.unlink()
    assert data_cache.verify(first.folder) is not None
    import os

    abandoned = root / f".tmp-{first.folder.name}-{os.uname().nodename}-999999999-0"
    abandoned.mkdir()  # what a killed build leaves: removed by the next build
    again = prepare(s, tokenizer, root)
    assert again.note.startswith("tokenised ") and "rebuilt: " in again.note
    assert [again.train[i] for i in range(len(again.train))] == want
    assert data_cache.verify(first.folder) is None
    assert not list(root.glob(".tmp-*"))  # no temporary folder left behind


# ---------------------------------------------------------------------------- mixtures


def test_mixture_rows_are_seeded_and_follow_weights_and_counts() -> None:
    sources = [Source("a", "auto", {}, weight=3.0), Source("b", "auto", {}, weight=1.0),
               Source("c", "auto", {}, rows=7), Source("d", "auto", {})]  # fmt: skip
    sizes = [100, 20, 3, 5]
    one = mixture_rows(sources, sizes, seed=1)
    assert [len(r) for r in one] == [60, 20, 7, 5]  # b is the scarcest weighted source
    assert all(np.array_equal(x, y) for x, y in zip(one, mixture_rows(sources, sizes, seed=1),
                                                     strict=True))  # fmt: skip
    other = mixture_rows(sources, sizes, seed=2)
    assert not np.array_equal(one[0], other[0])
    assert sorted(one[2].tolist()) == sorted([0, 1, 2, 0, 1, 2, *one[2][6:].tolist()])
    assert len(set(one[0].tolist())) == 60  # no row twice below the source's size
    assert one[3].tolist() == [0, 1, 2, 3, 4]


def test_a_mixture_shows_each_source_and_is_deterministic(tokenizer, hh_sample, tmp_path) -> None:
    mix = (Source(str(hh_sample), "auto", {}, weight=1.0),
           Source("arith-pref", "auto", {}, weight=1.0))  # fmt: skip
    s = spec(str(hh_sample), Encoding("preference"), train=mix)
    got = prepare(s, tokenizer, tmp_path / "a")
    # Equal weights: as many records from each as the scarcer source's training split holds,
    # each split what is left of the source's own records after 10% are held out (before
    # mixing, and before any row is dropped for its length): arith-pref 86 of 96.
    from align_anything.data.formats import split_records

    records = len(hh_sample.read_text().splitlines())
    hh_train = len(split_records(range(records), eval_fraction=0.1, seed=7)[0])
    assert hh_train == records - round(0.1 * records)
    each = min(hh_train, 86)
    assert got.mixture[0] == f"train mixture of 2 sources, {2 * each} rows:"
    assert f"{each} rows ( 50.0%)" in got.mixture[1] and "arith-pref, weight=1" in got.mixture[2]
    assert [r.source for r in got.reports[:2]] == [str(hh_sample), "arith-pref (built-in)"]
    again = prepare(s, tokenizer, tmp_path / "b")
    assert [got.train[i] for i in range(len(got.train))] == [
        again.train[i] for i in range(len(again.train))
    ]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["task=dpo", "data.path=[{path: arith-pref}, {path: /nonexistent/pairs.jsonl}]"],
         ["data.path[1] data file /nonexistent/pairs.jsonl does not exist"]),
        (["task=dpo", "data.path=[{path: arith-pref, weight: 0}]"],
         ["data.path.0.weight", "greater than 0"]),
        (["task=dpo", "data.path=[{path: arith-pref, weight: -1.5}]"], ["greater than 0"]),
        (["task=dpo", "data.path=[{path: arith-pref}, {path: arith-sft}]"],
         ["data.path[1] task=dpo needs preference data, but arith-sft holds conversations"]),
        (["task=dpo", "data.eval_path=[{path: arith-sft}]"],
         ["task=dpo needs preference data, but arith-sft holds conversations"]),
        # Preference pairs are no prompts: online RL refuses them, in a mixture and held out.
        (["task=grpo", "data.path=[{path: arith-prompts}, {path: arith-pref, weight: 1}]"],
         ["data.path[1] task=grpo needs prompt data (a prompt column, or conversations ending "
          "with a user turn), but arith-pref holds preference pairs"]),
        (["task=rloo", "data.eval_path=[{path: arith-prompts-eval}, {path: arith-kto}]"],
         ["data.eval_path[1] task=rloo needs prompt data", "arith-kto holds unpaired rows"]),
    ],
)  # fmt: skip
def test_bad_mixtures_are_one_error_before_any_compute(
    overrides: list[str], fragments: list[str], capsys, tmp_path: Path
) -> None:
    status = main([*overrides, TINY, f"data.cache_dir={tmp_path / 'cache'}",
                   f"output_dir={tmp_path / 'out'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2, err
    assert all(f in err for f in fragments), err
    assert "Traceback" not in err and err.count("error:") == 1
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_check_margins_reads_records_once(tmp_path) -> None:
    from align_anything.data.formats import check_margins

    records = (
        {"margin": value, "_source_row": f"line {i + 1}"}
        for i, value in enumerate([0.5, None, "x", float("nan")])
    )  # a generator: one pass only
    with pytest.raises(DataError, match=r"3 of 4 rows of f.jsonl have no finite number"):
        check_margins(records, "margin", "f.jsonl")
    with pytest.raises(DataError, match="has no column 'score'"):
        check_margins([{"margin": 1.0}], "score", "f.jsonl")


def test_a_source_takes_a_weight_or_rows_not_both(tmp_path) -> None:
    from align_anything.config import load_config

    with pytest.raises(ConfigError, match="weight or a row count, not both"):
        load_config(["task=dpo", "data.path=[{path: arith-pref, weight: 1, rows: 5}]"])


# ---------------------------------------------------------------------------- online-RL prompts

# Reward fields of every JSON type a column can hold (one type per column, as Arrow reads
# files); `maybe` is null in some rows.
FIELD_ROWS = [
    {"prompt": "What is 2 + 3?", "answer": 5, "unit": "apples", "ratio": 0.1, "ok": True,
     "steps": [2, 3], "tags": ["sum", "easy"], "meta": {"level": 1, "path": ["a", "b"]},
     "maybe": None},
    {"prompt": "Count to four " * 20, "answer": -7, "unit": "", "ratio": 1e-300, "ok": False,
     "steps": [], "tags": ["long"], "meta": {"level": 2, "path": []}, "maybe": 3},
    {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Name a prime above 10**12."}],
     "answer": 10**12 + 39, "unit": "ünïcode ✓", "ratio": -2.5, "ok": True, "steps": [1],
     "tags": [], "meta": {"level": 3, "path": ["c"]}, "maybe": None},
]  # fmt: skip


def prompt_spec(train: tuple[Source, ...], truncation: str = "drop", limit: int = 64) -> Spec:
    encoding = Encoding("prompt", max_prompt_length=limit, prompt_truncation=truncation)
    return spec("unused", encoding, train=train, kind="prompt", task="grpo", eval_fraction=0.0)


@pytest.mark.parametrize("truncation", ["drop", "keep_end"])
def test_prompt_rows_and_their_fields_round_trip_exactly(tokenizer, tmp_path, truncation) -> None:
    """The Arrow rows of prompt data equal `encode_prompts`' rows (ids, messages, fields,
    source rows) and reports; every field comes back as the file holds it."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in FIELD_ROWS))
    s = prompt_spec((Source(str(path), "auto", {}),), truncation)
    got = prepare(s, tokenizer, tmp_path / "cache")
    records, _ = load_records(str(path))
    want, report = encode_prompts(records, tokenizer, max_prompt_length=64, truncation=truncation)
    rows = [got.train[i] for i in range(len(got.train))]
    assert rows == want
    assert got.reports[1].summary() == f"train split, {report.summary()}"
    kept = [0, 2] if truncation == "drop" else [0, 1, 2]  # row 2 is longer than 64 ids
    assert [row["source_row"] for row in rows] == [f"line {k + 1}" for k in kept]
    for row, k in zip(rows, kept, strict=True):
        fields = {key: v for key, v in FIELD_ROWS[k].items() if key != "prompt"}
        assert row["fields"] == fields
        assert [type(v) for v in row["fields"].values()] == [type(v) for v in fields.values()]
    if truncation == "drop":
        assert report.dropped == {"prompt longer than max_prompt_length=64": 1}
    else:
        assert len(rows[1]["prompt_ids"]) == 64


def test_a_prompt_mixture_is_deterministic_and_takes_user_ending_conversations(
    tokenizer, tmp_path
) -> None:
    conversations = tmp_path / "conversations.jsonl"
    turns = [{"role": "user", "content": f"What is {n} + 1?"} for n in range(12)]
    ends = [{"role": "assistant", "content": "It is."}]
    conversations.write_text("".join(
        json.dumps({"messages": [t, *ends] if k % 4 == 3 else [t], "answer": k + 1}) + "\n"
        for k, t in enumerate(turns)
    ))  # fmt: skip
    mix = (Source("arith-prompts", "auto", {}, rows=20),
           Source(str(conversations), "auto", {}, weight=1.0))  # fmt: skip
    s = prompt_spec(mix, limit=1024)
    got = prepare(s, tokenizer, tmp_path / "a")
    assert got.mixture[0] == "train mixture of 2 sources, 32 rows:"
    assert "20 rows ( 62.5%)  arith-prompts, rows=20" in got.mixture[1]
    # Every user-ending conversation is a prompt; the 3 ending with an answer are dropped
    # when encoded, counted by line.
    encoded = got.reports[2]
    assert encoded.kept == 29
    assert encoded.dropped == {"conversation ends with an assistant turn (a prompt must end "
                               "with a user turn)": 3}  # fmt: skip
    rows = [got.train[i] for i in range(len(got.train))]
    assert {r["fields"].get("answer") for r in rows[20:]} == {1, 2, 3, 5, 6, 7, 9, 10, 11}
    again = prepare(s, tokenizer, tmp_path / "b")
    assert [again.train[i] for i in range(len(again.train))] == rows
    other = prepare(dataclasses.replace(s, seed=8), tokenizer, tmp_path / "c")
    assert [other.train[i] for i in range(20)] != rows[:20]  # the seed draws the 20 rows
    # The prompt limit and mode change the rows, so they are in the key.
    keys = {
        cache.folder_for(tmp_path, v, cache.key_parts(v, tokenizer=tokenizer, media=None))
        for v in (prompt_spec(mix, limit=1024), prompt_spec(mix, limit=512),
                  prompt_spec(mix, "keep_end", limit=1024))
    }  # fmt: skip
    assert len(keys) == 3


# ---------------------------------------------------------------------------- real runs

RUN = ["task=dpo", TINY, "train.precision=fp32", "train.max_steps=2", "data.max_eval_samples=8",
       "dpo.generation_check_samples=0", "checkpoint.save_final=false"]  # fmt: skip


@pytest.mark.slow
def test_cache_miss_then_hit_through_the_entry_point(tmp_path: Path) -> None:
    args = [*RUN, f"data.cache_dir={tmp_path / 'cache'}"]
    first = run_inline(args, tmp_path / "first").check()
    assert "data: rank 0 tokenising" in first.output
    line = first.summary_line("data cache")
    assert "tokenised " in line and f"(cached at {tmp_path / 'cache'}" in line
    second = run_inline(args, tmp_path / "second").check()
    assert "tokenising" not in second.output  # no tokenisation at all
    assert "cache hit " in second.summary_line("data cache")
    assert second.losses() == first.losses()
    assert _data_lines(second.output) == _data_lines(first.output)  # the same reports


def _data_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("  data            ")]


@pytest.mark.slow
def test_two_ranks_share_one_cache_and_only_rank_0_tokenises(tmp_path: Path) -> None:
    mixed = "data.path=[{path: arith-pref, rows: 150}, {path: arith-pref, weight: 1}]"
    args = [*RUN, mixed, f"data.cache_dir={tmp_path / 'cache'}"]
    two = launch(args, tmp_path / "two", launcher="deepspeed", nproc=2).check()
    assert two.output.count("data: rank 0 tokenising") == 1
    assert "data: rank 1 tokenising" not in two.output
    assert "train mixture of 2 sources" in two.output
    (entry,) = (tmp_path / "cache").iterdir()
    manifest = json.loads((entry / data_cache.MANIFEST).read_text())
    assert manifest["built_by"]["rank"] == "0"
    # One rank with the same global batch (micro 4 x accumulation 2): a hit, the same losses.
    one = run_inline([*args, "train.gradient_accumulation_steps=2"], tmp_path / "one").check()
    assert "cache hit " in one.summary_line("data cache")
    assert one.losses() == pytest.approx(two.losses(), rel=1e-5)


GRPO_RUN = ["task=grpo", TINY, "train.precision=fp32", "train.max_steps=1",
            "train.per_device_batch_size=4", "grpo.num_generations=2",
            "grpo.max_completion_length=4", "grpo.eval_samples=2",
            "reward.functions=[align_anything.rewards:length_penalty]",
            "data.eval_path=arith-prompts-eval", "checkpoint.save_final=false"]  # fmt: skip


@pytest.mark.slow
def test_grpo_prompts_cache_miss_then_hit_through_the_entry_point(tmp_path: Path) -> None:
    """Online RL reads its prompts through the cache too, here a mixture with a file of
    conversations ending with a user turn: a miss, then a hit with the same step."""
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"What is {n} + {n}?"}],
                    "answer": 2 * n}) + "\n"
        for n in range(8)
    ))  # fmt: skip
    mixed = f"data.path=[{{path: arith-prompts, rows: 24}}, {{path: {conversations}}}]"
    args = [*GRPO_RUN, mixed, f"data.cache_dir={tmp_path / 'cache'}"]
    first = run_inline(args, tmp_path / "first").check()
    assert "data: rank 0 tokenising 96 rows" in first.output  # 24 + 8 + 64 held out
    line = first.summary_line("data cache")
    assert "tokenised 96 rows in " in line and f"(cached at {tmp_path / 'cache'}" in line
    assert "train mixture of 2 sources, 32 rows:" in first.output
    second = run_inline(args, tmp_path / "second").check()
    assert "tokenising" not in second.output
    assert "cache hit " in second.summary_line("data cache")
    assert len(first.train_steps()) == 1
    for key in ("loss", "reward", "completions/mean_length"):
        assert second.train_steps()[0][key] == first.train_steps()[0][key], key
    assert second.eval("after")["eval/reward"] == first.eval("after")["eval/reward"]
    assert "eval/generation_check" in first.eval("after")  # the built-in held-out check


# ---------------------------------------------------------------------------- held out before mixing


def _ids(rows) -> set[tuple]:
    return {(tuple(r["prompt_ids"]), tuple(r["chosen_ids"])) for r in rows}


@pytest.mark.parametrize("mix", ["rows", "twice"])
def test_no_held_out_row_is_a_training_row_when_a_mixture_repeats_rows(
    tokenizer, tmp_path, mix
) -> None:
    """Issue #24 case 1: the split was taken after mixing, so copies of one row landed on both
    sides (16 of 16 held-out rows were training rows for `rows: 100000` of a 200-row file, 18
    of 20 for one file listed twice). Each source is now split by its own rows first."""
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"}
            for i in range(200)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = (
        (Source(str(path), "auto", {}, rows=2000),)
        if mix == "rows"
        else (Source(str(path), "auto", {}, weight=1.0), Source(str(path), "auto", {}, weight=1.0))
    )
    got = prepare(spec(str(path), Encoding("preference"), train=train), tokenizer, tmp_path / "c")
    train_rows = [got.train[i] for i in range(len(got.train))]
    eval_rows = [got.eval[i] for i in range(len(got.eval))]
    assert len(eval_rows) == len(_ids(eval_rows)) == 20  # 10% of the file's own rows, once each
    assert not _ids(eval_rows) & _ids(train_rows)
    assert len(_ids(train_rows)) == 180
    assert got.mixture[-1] == (
        "held out before mixing: 20 rows (data.eval_fraction=0.1 of each source's own rows)"
    )
    if mix == "rows":
        assert len(train_rows) == 2000
        assert got.mixture[1].endswith(
            f"rows=2000; its 180 rows repeated, {2000 / 180:.2f} times each"
        )
    else:
        assert len(train_rows) == 360 and "repeated" not in "".join(got.mixture)
