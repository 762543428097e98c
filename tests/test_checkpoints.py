"""Checkpoints: resume equals the uninterrupted run, half-written checkpoints are never picked,
and `align_anything export` / `align_anything score` reproduce what training saw."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import COMMON, REPO_ROOT, RunResult, copy_tiny_model, run_inline
from safetensors.torch import load_file

# End to end: every test here runs the real trainer, in-process (conftest.run_inline: one rank,
# what is tested is what the runs write and compute).
pytestmark = pytest.mark.slow

STEPS = 4
SFT_CHECKPOINTED = [
    "task=sft", *COMMON, f"train.max_steps={STEPS}", "data.max_eval_samples=8",
    "train.learning_rate=1e-3", "train.per_device_batch_size=2", "checkpoint.every_steps=2",
    "checkpoint.keep_last=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def z2_run(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """SFT under ZeRO-2, 4 steps, a checkpoint every 2 (only the newest kept)."""
    return run_inline(
        [*SFT_CHECKPOINTED, "deepspeed=z2"], tmp_path_factory.mktemp("z2") / "run"
    ).check()


def test_checkpoints_are_complete_and_pruned(z2_run: RunResult) -> None:
    root = z2_run.output_dir / "checkpoints"
    # keep_last=1: step-2 was deleted once step-4 was complete; no temporary folder remains.
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]
    state = json.loads((root / "step-4" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["global_batch"] == 2
    assert (root / "step-4" / "run_config.json").exists()
    assert (root / "step-4" / "deepspeed").is_dir()


def test_resume_equals_uninterrupted(z2_run: RunResult, tmp_path: Path) -> None:
    # A second 4-step run keeps its step-2 checkpoint; a new run resumes from it. (Resume
    # after SIGKILL mid-run belongs to the fault-tolerance tests.)
    first = tmp_path / "first"
    run_inline([*SFT_CHECKPOINTED, "deepspeed=z2", "checkpoint.keep_last=2"], first).check()
    step2 = first / "checkpoints" / "step-2"
    assert step2.is_dir()
    resumed = run_inline(
        [*SFT_CHECKPOINTED, "deepspeed=z2", f"resume={step2}"], tmp_path / "resumed"
    ).check()
    assert "resumed         from" in resumed.output
    expected = z2_run.losses()[2:]
    got = [m["loss"] for m in resumed.train_steps()]
    assert [m["step"] for m in resumed.train_steps()] == [3, 4]
    # CPU fp32, same data order and optimizer state: equal to float round-off.
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_resume_auto_skips_incomplete_checkpoints(z2_run: RunResult, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(z2_run.output_dir, run_dir)
    root = run_dir / "checkpoints"
    # A save killed mid-way leaves a temporary folder, or a step folder without trainer state.
    (root / ".tmp-step-6").mkdir()
    (root / "step-8" / "deepspeed").mkdir(parents=True)
    result = run_inline(
        [*SFT_CHECKPOINTED, "deepspeed=z2", "resume=auto", "train.max_steps=5"], run_dir
    ).check()
    assert f"from {root / 'step-4'} at step 4" in result.output
    assert [m["step"] for m in result.train_steps()][-1] == 5


def test_resume_from_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    result = run_inline([*SFT_CHECKPOINTED, f"resume={tmp_path}"], tmp_path / "run")
    assert result.returncode == 2
    assert "is not a complete align_anything checkpoint" in result.output


def test_export_of_a_zero3_checkpoint_equals_the_final_folder(tmp_path: Path) -> None:
    run = run_inline(
        [*SFT_CHECKPOINTED, "deepspeed=z3", "train.max_steps=2"], tmp_path / "z3"
    ).check()
    out = tmp_path / "exported"
    subprocess.run(
        [sys.executable, "-m", "align_anything", "export", str(run.output_dir / "checkpoints" / "step-2"),
         "--out", str(out)],
        cwd=REPO_ROOT, check=True, capture_output=True,
    )  # fmt: skip
    exported = load_file(out / "model.safetensors")
    final = load_file(run.output_dir / "final" / "model.safetensors")
    assert set(exported) == set(final)
    for name, tensor in final.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


def test_score_command_matches_the_model(rm_single: RunResult, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    final = rm_single.check().output_dir / "final"
    rows = [
        {"prompt": "What number comes after 41?", "response": "Answer: 42", "id": 1},
        {"prompt": "Which is larger, 56 or 20?", "response": "56 is larger than 20.", "id": 2},
        {"prompt": "Hi", "response": "Hello there, how can I help you today?", "id": 3},
    ]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "scored.jsonl"
    subprocess.run(
        [sys.executable, "-m", "align_anything", "score", str(final), str(source), "--out", str(out),
         "--batch-size", "3"],
        cwd=REPO_ROOT, check=True, capture_output=True,
    )  # fmt: skip
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in scored] == [1, 2, 3]  # other columns pass through
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    for row, result in zip(rows, scored, strict=True):
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["response"]},
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        # Batched with padding (3 rows of different lengths) = one sequence alone.
        assert result["score"] == pytest.approx(expected, abs=1e-5)


def test_resume_refuses_different_data(z2_run: RunResult, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(z2_run.output_dir, run_dir)
    result = run_inline([*SFT_CHECKPOINTED, "deepspeed=z2", "resume=auto",
                     "data.max_train_samples=200"], run_dir)  # fmt: skip
    assert result.returncode == 2
    assert f"resume from {run_dir / 'checkpoints' / 'step-4'} refused" in result.output
    assert "training data (encoded rows of data.path; checkpoint: 'arith-sft'" in result.output
    assert "checkpoint.allow_mismatch=true" in result.output
    assert "model.name_or_path" not in result.output.split("refused")[1]  # only what changed


def test_resume_refuses_a_different_model_and_tokenizer_unless_allowed(
    z2_run: RunResult, tmp_path: Path
) -> None:
    model = copy_tiny_model(tmp_path / "model")
    template = model / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    run_dir = tmp_path / "run"
    shutil.copytree(z2_run.output_dir, run_dir)
    args = [*SFT_CHECKPOINTED, "deepspeed=z2", "resume=auto", f"model.name_or_path={model}"]
    refused = run_inline(args, run_dir)
    assert refused.returncode == 2
    assert f"model.name_or_path: checkpoint 'tiny-random-llama', this run '{model}'" in (
        refused.output
    )
    assert "tokenizer (vocabulary, special tokens or chat template): checkpoint '" in (
        refused.output
    )
    assert "training data" in refused.output  # the template changes every encoded row
    allowed = run_inline([*args, "checkpoint.allow_mismatch=true", "train.max_steps=5"], run_dir)
    allowed.check()
    assert "warning: resuming from" in allowed.output and _printed(allowed) == [5]


def _printed(result: RunResult) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+)/", result.output, flags=re.MULTILINE)]
