"""Bad input through the real entry point: one clear message, exit status 2, before any step.

Runs `align_anything.train.main` in-process (errors surface before or right after the one-process
group is created, and the entry point tears it down again), with the hub offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from align_anything.train import main

TINY = "model.name_or_path=tiny-random-llama"


# Hub offline and no inherited rank variables (fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("in_process_offline")


def _run(args: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> str:
    status = main([*args, f"output_dir={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    assert status == 2, f"expected exit 2, got {status}\n{captured.out}\n{captured.err}"
    # No training step ran: nothing reached metrics.jsonl.
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or not any(
        "loss" in json.loads(line) for line in metrics.read_text().splitlines()
    )
    return captured.err


def test_config_typos_are_reported_together(capsys, tmp_path) -> None:
    err = _run(["task=sft", "train.learnig_rate=1e-4", "data.max_lenght=64"], capsys, tmp_path)
    assert "2 problems" in err
    assert "train.learnig_rate: unknown key (did you mean 'train.learning_rate'?)" in err
    assert "data.max_lenght: unknown key (did you mean 'data.max_length'?)" in err


def test_unknown_task_and_preset_list_valid_names(capsys, tmp_path) -> None:
    err = _run(["task=ppq", "deepspeed=z4"], capsys, tmp_path)
    assert (
        "unknown task" in err
        and "diffusion_sft, dpo, flow_grpo, grpo, kto, ppo, rloo, rm, sft" in err
    )
    assert "unknown preset" in err and "z0, z2, z3, z3_offload" in err


def test_argument_without_equals(capsys, tmp_path) -> None:
    err = _run(["task=sft", "--lr", "3"], capsys, tmp_path)
    assert "expected key=value overrides" in err


def test_missing_dataset_file(capsys, tmp_path) -> None:
    err = _run(["task=sft", TINY, f"data.path={tmp_path / 'nope.jsonl'}"], capsys, tmp_path)
    assert "nope.jsonl" in err


def test_missing_column_names_what_was_found(capsys, tmp_path) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"query": "q", "good": "a", "bad": "b"}) + "\n")
    err = _run(["task=dpo", TINY, f"data.path={data}", "data.format=preference"], capsys, tmp_path)
    assert "prompt" in err and "query" in err and "data.columns" in err


def test_task_and_data_kind_mismatch(capsys, tmp_path) -> None:
    err = _run(["task=sft", TINY, "data.path=arith-pref"], capsys, tmp_path)
    assert "task=sft needs conversation data" in err and "preference pairs" in err


def test_missing_model(capsys, tmp_path) -> None:
    err = _run(["task=sft", "model.name_or_path=tiny-random-lama"], capsys, tmp_path)
    assert "tiny-random-lama" in err and "did you mean 'tiny-random-llama'" in err


def test_batch_numbers_that_do_not_add_up(capsys, tmp_path) -> None:
    err = _run(
        ["task=sft", TINY, "train.per_device_batch_size=2", "train.gradient_accumulation_steps=1",
         "train.global_batch_size=8"],
        capsys, tmp_path,
    )  # fmt: skip
    assert "train_batch_size 8 != micro 2 × grad_accum 1 × world 1" in err


def test_batch_larger_than_the_dataset(capsys, tmp_path) -> None:
    err = _run(["task=sft", TINY, "train.per_device_batch_size=100000"], capsys, tmp_path)
    assert "fewer than one global batch" in err


def test_output_dir_that_is_a_file(capsys, tmp_path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    status = main(["task=sft", TINY, f"output_dir={target}"])
    err = capsys.readouterr().err
    assert status == 2 and "exists and is not a folder" in err


def test_preset_conflict_with_command_line(capsys, tmp_path) -> None:
    preset = tmp_path / "ds.json"
    preset.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 0}})
    )
    err = _run(
        ["task=sft", TINY, f"deepspeed={preset}", "train.per_device_batch_size=2"], capsys, tmp_path
    )
    assert (
        "train.per_device_batch_size=2 but the preset sets train_micro_batch_size_per_gpu=8" in err
    )
