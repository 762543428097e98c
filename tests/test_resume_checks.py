"""Resume checks: a checkpoint is complete only when its files match the manifest written last;
resume=auto falls back past a broken newest checkpoint (saying which and why, deleting
nothing), an explicit broken resume=PATH is one clear error, a run extended through resume
follows its new schedule and says so, and a checkpoint's own files load without unpickling."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FINISHED_ARGS, RunResult, copy_run, launch, snapshot, tail

from align_anything.backend import universal
from align_anything.train import main
from align_anything.training import checkpoints

# End to end: every test here launches the real trainer (conftest.launch) or works on a copy
# of conftest.finished_run, which does.
pytestmark = pytest.mark.slow


def _break_invalid_state_json(step: Path) -> str:
    (step / "trainer_state.json").write_text('{"step": 3,')
    return "trainer_state.json cannot be read (Expecting property name"


def _break_missing_state(step: Path) -> str:
    (step / "trainer_state.json").unlink()
    return "trainer_state.json is missing"


def _break_missing_manifest(step: Path) -> str:
    (step / "manifest.json").unlink()
    return "manifest.json is missing"


def _break_deleted_pt_files(step: Path) -> str:
    for path in (step / "deepspeed").glob("*.pt"):
        path.unlink()
    return "deepspeed/mp_rank_00_model_states.pt is missing"


def _break_deleted_deepspeed_folder(step: Path) -> str:
    shutil.rmtree(step / "deepspeed")
    return "deepspeed/mp_rank_00_model_states.pt is missing"


def _break_truncated_pt(step: Path) -> str:
    path = step / "deepspeed" / "mp_rank_00_model_states.pt"
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.truncate(size // 2)
    return (
        f"deepspeed/mp_rank_00_model_states.pt is {size // 2} bytes, the manifest says {size} "
        "(truncated?)"
    )


def _break_changed_bytes(step: Path) -> str:
    path = step / "deepspeed" / "mp_rank_00_model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    path.write_bytes(bytes(data))
    return "deepspeed/mp_rank_00_model_states.pt does not match its checksum"


BREAKS = {
    "invalid-trainer-state-json": _break_invalid_state_json,
    "missing-trainer-state": _break_missing_state,
    "missing-manifest": _break_missing_manifest,
    "deleted-pt-files": _break_deleted_pt_files,
    "deleted-deepspeed-folder": _break_deleted_deepspeed_folder,
    "truncated-pt": _break_truncated_pt,
    "one-byte-changed": _break_changed_bytes,
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_a_broken_newest_checkpoint_is_skipped_with_its_reason(
    case: str, finished_run: RunResult, tmp_path: Path
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    root = run / "checkpoints"
    reason = BREAKS[case](root / "step-3")
    before = snapshot(run)
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    found, skipped = checkpoints.newest_complete(root, run_id)
    assert found == root / "step-2"
    assert [s.path for s in skipped] == [root / "step-3"] and reason in skipped[0].reason
    assert snapshot(run) == before  # looked at, never changed


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_resume_from_a_broken_checkpoint_path_is_one_clear_error(
    case: str, finished_run: RunResult, tmp_path: Path, capsys, in_process_offline
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    step3 = run / "checkpoints" / "step-3"
    reason = BREAKS[case](step3)
    before = snapshot(run)
    status = main([*FINISHED_ARGS, f"resume={step3}", f"output_dir={tmp_path / 'new'}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert f"resume='{step3}' is not a complete align_anything checkpoint: {reason}" in err
    assert snapshot(run) == before
    assert not (tmp_path / "new" / "metrics.jsonl").exists()


def test_resume_auto_falls_back_past_a_truncated_checkpoint(
    finished_run: RunResult, tmp_path: Path
) -> None:
    """Through the real command line: step-3 truncated, resume=auto takes step-2, says why,
    and step 3 run again gives the uninterrupted run's loss; step-3's files are not touched.
    run.json as a run killed while writing step 3's export leaves it (`running`): a run that
    had finished would have nothing to do (test_new_ground.py)."""
    run = copy_run(finished_run, tmp_path / "run")
    record = json.loads((run / "run.json").read_text())
    record.pop("final_step")
    (run / "run.json").write_text(json.dumps({**record, "status": "running"}))
    step3 = run / "checkpoints" / "step-3"
    reason = _break_truncated_pt(step3)
    broken = snapshot(step3)
    result = launch(
        [*FINISHED_ARGS, "resume=auto", "checkpoint.every_steps=0", "checkpoint.save_final=false"],
        run,
    ).check()
    assert f"note: resume=auto skipped {step3}: {reason}" in result.output, tail(result.output)
    assert f"resumed         from {run / 'checkpoints' / 'step-2'} at step 2" in result.output
    assert snapshot(step3) == broken
    resumed = [m for m in result.train_steps() if m["step"] == 3][-1]
    original = [m for m in finished_run.train_steps() if m["step"] == 3][0]
    assert resumed["loss"] == pytest.approx(original["loss"], abs=1e-6)


def test_extending_a_run_follows_the_new_schedule_and_says_so(
    finished_run: RunResult, tmp_path: Path
) -> None:
    """A 3-step cosine run at 1e-3, resumed to 6 steps at 2e-3: steps 4-6 use the 6-step
    cosine of the new peak, 2e-3 · ½(1 + cos(π·k/6)) for k = 3, 4, 5 (= 1e-3, 5e-4, 1.34e-4),
    not the finished schedule's 0 (the old behaviour: the rate the checkpoint ended on)."""
    run = copy_run(finished_run, tmp_path / "run")
    result = launch(
        [*FINISHED_ARGS, "resume=auto", "train.max_steps=6", "train.learning_rate=2e-3"], run
    ).check()
    assert (
        "schedule        changed since step-3: total steps (train.max_steps / train.epochs) "
        "3 -> 6; train.learning_rate 0.001 -> 0.002. The learning-rate schedule is rebuilt "
        "for 6 steps and continues at step 3 of it"
    ) in result.output, tail(result.output)
    rates = {m["step"]: m["learning_rate"] for m in result.train_steps() if m["step"] > 3}
    expected = {k + 1: 2e-3 * 0.5 * (1 + math.cos(math.pi * k / 6)) for k in (3, 4, 5)}
    assert rates == pytest.approx(expected, rel=1e-9)
    assert rates[4] == pytest.approx(1e-3) and rates[5] == pytest.approx(5e-4)


def test_checkpoint_files_are_read_without_unpickling(finished_run: RunResult, tmp_path) -> None:
    step3 = finished_run.output_dir / "checkpoints" / "step-3"
    # RNG states are JSON; DeepSpeed's files load through torch's weights-only loader.
    assert sorted(p.name for p in step3.glob("rng_state_rank*")) == ["rng_state_rank0.json"]
    state = universal.load_deepspeed_file(step3 / "deepspeed" / "mp_rank_00_model_states.pt")
    assert "module" in state
    # A file that pickles anything else is refused instead of run.
    hostile = tmp_path / "hostile.pt"
    torch.save({"payload": shutil.rmtree}, hostile)
    with pytest.raises(Exception, match="Weights only load failed"):
        universal.load_deepspeed_file(hostile)
