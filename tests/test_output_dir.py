"""No run silently replaces another's results: a fresh run into a used output_dir refuses,
overwrite_output_dir=true starts over without mixing old and new, checkpoints belong to their
run, two runs at once cannot share a folder, a kill during the final save leaves the run marked
incomplete, and export never deletes what its target held. Each through the real command line
(`align_anything.train` / `align_anything export`, in-process where the case ends before any
compute, as a subprocess where it trains)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from conftest import (
    FINISHED_ARGS,
    RunResult,
    _kill_group,
    copy_run,
    launch,
    run_inline,
    snapshot,
    spawn,
    tail,
)

from align_anything.tools import export
from align_anything.train import main

# End to end: every test here runs the real trainer (launched where a process is killed or
# holds the lock; in-process otherwise) or works on a copy of conftest.finished_run.
pytestmark = pytest.mark.slow


def _run_json(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def _train_steps(folder: Path) -> list[int]:
    steps = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the line a running (or killed) run is writing
            continue
        if "loss" in row and "phase" not in row:
            steps.append(row["step"])
    return steps


def test_a_fresh_run_into_a_finished_run_refuses_and_changes_nothing(
    finished_run: RunResult, tmp_path: Path, capsys, in_process_offline
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run)
    status = main([*FINISHED_ARGS, f"output_dir={run}"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert (
        f"output_dir='{run}' already holds a run (status complete, step 3, checkpoints step-2, "
        "step-3, final/). Continue it with resume=auto, start over with overwrite_output_dir=true"
    ) in err
    assert snapshot(run) == before  # no file written, changed or deleted, and no lock left


def test_overwrite_starts_over_and_keeps_nothing_of_the_old_run(
    finished_run: RunResult, tmp_path: Path
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    (run / "notes.txt").write_text("the user's own file")
    old_id = _run_json(run)["run_id"]
    result = run_inline(
        [*FINISHED_ARGS, "train.max_steps=2", "checkpoint.every_steps=2",
         "overwrite_output_dir=true"], run,
    ).check()  # fmt: skip
    assert "note: overwrite_output_dir=true: removed run.json, metrics.jsonl" in result.output
    new_id = _run_json(run)["run_id"]
    assert new_id != old_id and _run_json(run)["status"] == "complete"
    # Only the new run's checkpoint, metrics, final model and summary; the user's file stays.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    state = json.loads((run / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["run_id"] == new_id
    assert _train_steps(run) == [1, 2]
    assert json.loads((run / "final" / "run_config.json").read_text())["train"]["max_steps"] == 2
    assert json.loads((run / "summary.json").read_text())["run_id"] == new_id
    assert (run / "notes.txt").read_text() == "the user's own file"


def test_resume_and_pruning_leave_another_runs_checkpoint_alone(
    finished_run: RunResult, tmp_path: Path
) -> None:
    """A checkpoint of another run in checkpoints/ (a higher step number than this run's):
    resume=auto does not pick it and pruning does not delete it, whatever its number."""
    other = run_inline(
        [*FINISHED_ARGS, "train.max_steps=2", "checkpoint.every_steps=2"], tmp_path / "other"
    ).check()
    run = copy_run(finished_run, tmp_path / "run")
    foreign = run / "checkpoints" / "step-9"
    shutil.copytree(other.output_dir / "checkpoints" / "step-2", foreign)
    foreign_before = snapshot(foreign)
    other_id = _run_json(other.output_dir)["run_id"]
    result = run_inline([*FINISHED_ARGS, "resume=auto", "train.max_steps=5"], run).check()
    assert (
        f"note: resume=auto skipped {foreign}: belongs to another run (run id {other_id})"
        in result.output
    ), tail(result.output)
    assert f"resumed         from {run / 'checkpoints' / 'step-3'} at step 3" in result.output
    # keep_last=2 counts this run's checkpoints only: step-3 pruned, step-9 untouched.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-4", "step-5", "step-9"
    ]  # fmt: skip
    assert snapshot(foreign) == foreign_before


def _wait_for(predicate, proc, what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(
                f"run exited {proc.returncode} before {what}:\n{tail(proc.communicate()[0])}"
            )
        time.sleep(0.05)
    _kill_group(proc)
    pytest.fail(f"no {what} within {timeout_s} s")


def test_a_second_run_at_once_is_refused_and_a_stale_lock_is_reported(
    tmp_path: Path, capsys, in_process_offline
) -> None:
    run = tmp_path / "run"
    proc = spawn([*FINISHED_ARGS, "train.max_steps=2000", "checkpoint.every_steps=0"], run)
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists() and _train_steps(run), proc, "a step")
        lock = json.loads((run / ".lock").read_text())
        assert lock["pid"] == proc.pid
        status = main([*FINISHED_ARGS, f"output_dir={run}"])
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err, err
        assert f"error: another run is writing to {run}: pid {proc.pid} on this host" in err
    finally:
        _kill_group(proc)
        proc.communicate()
    # Every line the killed run wrote is whole: the refused run wrote nothing.
    for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]:
        json.loads(line)
    assert (run / ".lock").exists()  # SIGKILL: nobody removed it
    assert _run_json(run)["status"] == "running"  # and the run is marked unfinished
    status = main([*FINISHED_ARGS, f"output_dir={run}"])
    captured = capsys.readouterr()
    assert status == 2
    assert (
        f"note: took over a stale lock: {run / '.lock'} was left by pid {proc.pid}" in captured.out
    ) and "which is no longer running" in captured.out
    assert "already holds a run (status running" in captured.err
    assert not (run / ".lock").exists()  # released again on the way out


KILL_IN_FINAL_SAVE = '''"""Entry point that is SIGKILLed in the middle of writing final/ (complete in its temporary
folder, not yet swapped in)."""
import os
import signal
import sys

from align_anything import atomic
from align_anything.train import main

original = atomic.publish


def publish(tmp, final):
    if final.name == "final":
        os.kill(os.getpid(), signal.SIGKILL)
    return original(tmp, final)


atomic.publish = publish
sys.exit(main())
'''


def test_a_kill_during_the_final_save_leaves_the_run_marked_incomplete(
    finished_run: RunResult, tmp_path: Path
) -> None:
    """Extending a finished run, killed while writing final/: the old final/ and summary.json
    stay whole, and run.json says the run is unfinished and that final/ is of step 3."""
    (tmp_path / "kill_in_final_save.py").write_text(KILL_IN_FINAL_SAVE)
    run = copy_run(finished_run, tmp_path / "run")
    final_before, summary_before = snapshot(run / "final"), (run / "summary.json").read_text()
    killed = launch(
        [*FINISHED_ARGS, "resume=auto", "train.max_steps=4"], run,
        module="kill_in_final_save", extra_env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert killed.returncode == -9, tail(killed.output)
    assert 4 in _train_steps(run)
    record = _run_json(run)
    assert record["status"] == "running" and record["final_step"] == 3
    assert snapshot(run / "final") == final_before
    assert (run / "summary.json").read_text() == summary_before


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["data.eval_fraction=0"], "no eval split (data.eval_fraction=0 and no data.eval_path)"),
        (["data.eval_path={long}"], "every one of the 4 eval rows was dropped"),
    ],
    ids=["no-eval-split", "every-eval-row-too-long"],
)
def test_a_run_without_held_out_rows_still_prints_its_summary(
    extra: list[str], fragment: str, tmp_path: Path
) -> None:
    long = tmp_path / "long.jsonl"
    row = {"messages": [{"role": "user", "content": "hi " * 80},
                        {"role": "assistant", "content": "yo"}]}  # fmt: skip
    long.write_text((json.dumps(row) + "\n") * 4)
    args = [*FINISHED_ARGS, "train.max_steps=1", "checkpoint.every_steps=0"]
    result = run_inline([*args, *(e.format(long=long) for e in extra)], tmp_path / "run").check()
    assert "finished sft: 1 steps in" in result.output
    assert f"no held-out metrics: {fragment}" in result.output, tail(result.output)


# ---------------------------------------------------------------------------- export targets


def _export(capsys, *args: str) -> tuple[int, str]:
    status = export.main(list(args))
    return status, capsys.readouterr().err


def test_export_never_deletes_what_its_target_holds(
    finished_run: RunResult, tmp_path: Path, capsys, in_process_offline
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    checkpoint = str(run / "checkpoints" / "step-3")
    before = snapshot(run)
    # The run's own output_dir, with or without --overwrite: refused, nothing touched.
    status, err = _export(capsys, checkpoint, "--out", str(run))
    assert status == 2 and f"--out {run} is not empty (it holds checkpoints, ds_config.json" in err
    status, err = _export(capsys, checkpoint, "--out", str(run), "--overwrite")
    assert status == 2 and "is not a folder this command exported" in err
    assert snapshot(run) == before
    # A file: refused before any work, and no temporary folder left beside it.
    target = tmp_path / "weights.bin"
    target.write_text("mine")
    status, err = _export(capsys, checkpoint, "--out", str(target))
    assert status == 2 and f"--out {target} is a file, not a folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "weights.bin"]
    # A new folder, then again: refused without --overwrite, replaced with it.
    out = tmp_path / "exported"
    assert _export(capsys, checkpoint, "--out", str(out))[0] == 0
    first = snapshot(out)
    assert "align_anything_export.json" in first and "model.safetensors" in first
    status, err = _export(capsys, checkpoint, "--out", str(out))
    assert status == 2 and "add --overwrite to replace an earlier export" in err
    assert _export(capsys, str(run / "checkpoints" / "step-2"), "--out", str(out), "--overwrite")[
        0
    ] == 0  # fmt: skip
    assert snapshot(out)["model.safetensors"] != first["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run", "weights.bin"]
