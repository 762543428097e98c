"""Nothing is lost: preemption (SIGTERM), SIGKILL mid-run, a diverging loss, a failed checkpoint
write and a dying rank, each through the real entry point.

Exact resume: the data order is a pure function of (seed, epoch, step) and the checkpoint holds
the optimizer, scheduler and RNG states, so on CPU fp32 the loss of every step after a resume
equals the uninterrupted run's. Observed: bit-identical on one rank; 2 ranks against the
1-rank run differ only by fp32 summation order (≤ 1e-6, see test_distributed.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import COMMON, RunResult, _kill_group, finish, launch, run_inline, spawn, tail

# End to end: every test here runs the real trainer. What a process does (signals, SIGKILL, a
# dying rank, the launchers) is launched (conftest.launch / spawn); the runs these are compared
# with, and failures that end in an exit status, run in-process (conftest.run_inline).
pytestmark = pytest.mark.slow

# Same process layout, same numbers: a resumed step's loss equals the uninterrupted one to
# float round-off (in practice bit for bit).
SAME_LAYOUT_ATOL = 1e-6
# 2 ranks × micro 1 against 1 rank × micro 2: fp32 summation order differs (≤ 1e-6 observed).
SPLIT_ATOL = 1e-5
STEPS = 10
SFT = [
    "task=sft", *COMMON, f"train.max_steps={STEPS}", "data.max_eval_samples=4",
    "train.learning_rate=1e-3", "deepspeed=z2", "train.global_batch_size=2",
    "train.gradient_accumulation_steps=1", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
    "checkpoint.save_final=false",
]  # fmt: skip
DPO = [
    "task=dpo", *COMMON, "train.max_steps=8", "data.max_eval_samples=4",
    "train.learning_rate=1e-4", "deepspeed=z0", "train.global_batch_size=2",
    "train.gradient_accumulation_steps=1", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
    "checkpoint.save_final=false",
]  # fmt: skip


def _logged_steps(output_dir: Path) -> dict[int, dict[str, Any]]:
    """Step -> its training metrics line; a step logged again after a resume keeps the newer."""
    path = output_dir / "metrics.jsonl"
    steps: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if "loss" in row and "phase" not in row:
            steps[int(row["step"])] = row
    return steps


def _wait_for_step(proc: subprocess.Popen, output_dir: Path, step: int, timeout_s: float = 180):
    """Poll metrics.jsonl until `step` is logged; fail (killing the run) if it exits or hangs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if max(_logged_steps(output_dir), default=0) >= step:
            return
        if proc.poll() is not None:
            output = proc.communicate()[0]
            pytest.fail(f"run exited {proc.returncode} before step {step}:\n{tail(output)}")
        time.sleep(0.01)
    _kill_group(proc)
    pytest.fail(f"step {step} not logged within {timeout_s} s")


def _complete_checkpoints(output_dir: Path) -> list[int]:
    root = output_dir / "checkpoints"
    return sorted(
        int(p.name.removeprefix("step-"))
        for p in root.glob("step-*")
        if (p / "manifest.json").exists()
    )


def _assert_checkpoint_complete(output_dir: Path, step: int, world: int) -> None:
    folder = output_dir / "checkpoints" / f"step-{step}"
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["step"] == step
    assert (folder / "deepspeed").is_dir() and (folder / "run_config.json").exists()
    assert sorted(p.name for p in folder.glob("rng_state_rank*.json")) == [
        f"rng_state_rank{r}.json" for r in range(world)
    ]
    assert (folder / "manifest.json").exists()


def _resumed_from(result: RunResult) -> int:
    found = re.findall(r"resumed\s+from \S+ at step (\d+)", result.output)
    assert found, f"the run did not resume:\n{tail(result.output)}"
    return int(found[-1])


def _printed_steps(result: RunResult) -> list[int]:
    """Steps this launch ran, from its progress lines (metrics.jsonl also holds earlier runs')."""
    return [int(s) for s in re.findall(r"^step (\d+)/", result.output, flags=re.MULTILINE)]


def _assert_losses_equal(got: dict[int, dict[str, Any]], expected: RunResult, atol: float) -> None:
    want = {m["step"]: m["loss"] for m in expected.train_steps()}
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    worst = max(abs(got[s]["loss"] - want[s]) for s in want)
    assert worst <= atol, (
        f"stitched losses differ from the uninterrupted run by up to {worst:.2e}:\n"
        + "\n".join(f"  step {s}: {got[s]['loss']!r} vs {want[s]!r}" for s in sorted(want))
    )


@pytest.fixture(scope="module")
def sft_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The reference: SFT under ZeRO-2, 10 steps of a global batch of 2 on one rank."""
    return run_inline(SFT, tmp_path_factory.mktemp("sft-ref") / "run").check()


def test_preempted_then_killed_then_resumed_equals_uninterrupted(
    sft_uninterrupted: RunResult, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # 1. SIGTERM (preemption) after the first logged step: finish the step, checkpoint, exit 143.
    proc = spawn(SFT, run_dir)
    _wait_for_step(proc, run_dir, 1)
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 128 + signal.SIGTERM, tail(stopped.output)
    assert "SIGTERM received: finishing this step, then writing a checkpoint" in stopped.output
    match = re.search(r"stopped by SIGTERM after step (\d+) of 10: checkpoint (\S+) is complete\.",
                      stopped.output)  # fmt: skip
    assert match, tail(stopped.output)
    preempted_at = int(match.group(1))
    assert 1 <= preempted_at < STEPS
    assert match.group(2) == str(run_dir / "checkpoints" / f"step-{preempted_at}")
    _assert_checkpoint_complete(run_dir, preempted_at, world=1)
    assert max(_logged_steps(run_dir)) == preempted_at  # stopped right after that step

    # 2. resume=auto continues from it; SIGKILL once two more steps (and > step 2) are logged.
    proc = spawn([*SFT, "resume=auto"], run_dir)
    killed_after = max(3, preempted_at + 2)
    _wait_for_step(proc, run_dir, killed_after)
    _kill_group(proc)
    killed = finish(proc, run_dir)
    assert killed.returncode == -signal.SIGKILL
    assert _resumed_from(killed) == preempted_at
    newest = _complete_checkpoints(run_dir)[-1]
    assert 2 <= newest < STEPS

    # 3. resume=auto after SIGKILL takes the newest complete checkpoint (a half-written one,
    # if the kill landed mid-save, is never picked) and the stitched curve equals the reference.
    resumed = run_inline([*SFT, "resume=auto"], run_dir).check()
    assert _resumed_from(resumed) == newest
    assert _printed_steps(resumed)[0] == newest + 1
    _assert_losses_equal(_logged_steps(run_dir), sft_uninterrupted, SAME_LAYOUT_ATOL)


def test_two_ranks_preempted_and_killed_resume_exactly(
    sft_uninterrupted: RunResult, tmp_path: Path
) -> None:
    """2 ranks under the deepspeed launcher: SIGTERM to the whole process group (what Slurm or
    Ctrl-C in a terminal do) stops both ranks after the same step with one complete checkpoint;
    after a SIGKILL of the group, resume continues with the losses of the 1-rank reference."""
    run_dir = tmp_path / "run"
    two = dict(launcher="deepspeed", nproc=2)
    args = [*SFT, "train.per_device_batch_size=1"]
    proc = spawn(args, run_dir, **two)
    _wait_for_step(proc, run_dir, 1)
    os.killpg(proc.pid, signal.SIGTERM)
    stopped = finish(proc, run_dir)
    assert stopped.returncode != 0
    match = re.search(r"stopped by SIGTERM after step (\d+) of 10", stopped.output)
    assert match, tail(stopped.output)
    preempted_at = int(match.group(1))
    _assert_checkpoint_complete(run_dir, preempted_at, world=2)

    proc = spawn([*args, "resume=auto"], run_dir, **two)
    _wait_for_step(proc, run_dir, max(3, preempted_at + 2))
    _kill_group(proc)
    finish(proc, run_dir)
    newest = _complete_checkpoints(run_dir)[-1]
    assert 2 <= newest < STEPS

    resumed = launch([*args, "resume=auto"], run_dir, **two).check()
    assert _resumed_from(resumed) == newest
    _assert_losses_equal(_logged_steps(run_dir), sft_uninterrupted, SPLIT_ATOL)


def test_dpo_resume_after_sigkill_keeps_the_original_reference(tmp_path: Path) -> None:
    """The reference log-probs come from model.name_or_path, never from the resumed policy: if
    they did, the resumed steps' losses (and rewards) would differ from the uninterrupted run."""
    reference = run_inline(DPO, tmp_path / "reference").check()
    run_dir = tmp_path / "run"
    proc = spawn(DPO, run_dir)
    _wait_for_step(proc, run_dir, 3)
    _kill_group(proc)
    finish(proc, run_dir)
    newest = _complete_checkpoints(run_dir)[-1]
    assert 2 <= newest < 8
    resumed = run_inline([*DPO, "resume=auto"], run_dir).check()
    assert _resumed_from(resumed) == newest
    stitched = _logged_steps(run_dir)
    _assert_losses_equal(stitched, reference, SAME_LAYOUT_ATOL)
    for m in reference.train_steps():
        assert stitched[m["step"]]["rewards/margins"] == pytest.approx(
            m["rewards/margins"], abs=SAME_LAYOUT_ATOL
        )


def test_diverging_loss_stops_with_the_step_named_and_no_checkpoint_after_it(
    tmp_path: Path,
) -> None:
    """A learning rate of 1e30 makes the weights ~1e30 after step 1, and step 2 goes non-finite
    (on the tiny Llama its loss stays finite but the gradient norm is NaN). The run must stop at
    that step with exit status 2, the step and its rows named, and no checkpoint holding it:
    step-1, written before, stays the newest. (A non-finite loss stops the run before the
    update; a non-finite gradient norm after it, but before any checkpoint could store it.)"""
    run_dir = tmp_path / "run"
    result = run_inline(
        ["task=sft", *COMMON, "train.max_steps=6", "data.max_eval_samples=4", "deepspeed=z0",
         "train.per_device_batch_size=2", "train.learning_rate=1e30", "checkpoint.every_steps=1",
         "train.lr_scheduler=constant"],
        run_dir,
    )  # fmt: skip
    assert result.returncode == 2, tail(result.output)
    match = re.search(
        r"error: non-finite training (metric|gradient norm) at step (\d+) \(epoch 0, "
        r"(loss|grad_norm)=(nan|inf)",
        result.output,
    )
    assert match, tail(result.output)
    bad_step = int(match.group(2))
    assert bad_step >= 2 and _complete_checkpoints(run_dir)[-1] == bad_step - 1
    last_good = run_dir / "checkpoints" / f"step-{bad_step - 1}"
    assert f"the last good checkpoint is {last_good}" in result.output
    assert "training rows [" in result.output
    assert bad_step not in _logged_steps(run_dir)
    assert not (run_dir / "final").exists()
    assert "Traceback" not in result.output


def _failing_second_save(original):
    """Engine.save_checkpoint whose second call fails like a full disk, half-way through: a
    partial file in DeepSpeed's folder, then ENOSPC."""
    import errno

    calls = []

    def save_checkpoint(self, directory, client_state, *, tag="deepspeed"):
        calls.append(directory)
        if len(calls) < 2:
            return original(self, directory, client_state, tag=tag)
        partial = directory / tag / "mp_rank_00_model_states.pt"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", str(partial))

    return save_checkpoint


def test_failed_checkpoint_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk full during the second save (simulated in DeepSpeed's write, the step where the big
    files go): a clear error, exit 2, no half-written folder left, and step-2 still resumes."""
    from align_anything.backend import engine

    run_dir = tmp_path / "run"
    args = [
        "task=sft", *COMMON, "train.max_steps=6", "data.max_eval_samples=4", "deepspeed=z0",
        "train.per_device_batch_size=2", "checkpoint.every_steps=2", "checkpoint.keep_last=1",
    ]  # fmt: skip
    with monkeypatch.context() as patch:
        original = engine.Engine.save_checkpoint
        patch.setattr(engine.Engine, "save_checkpoint", _failing_second_save(original))
        failed = run_inline(args, run_dir)
    assert failed.returncode == 2, tail(failed.output)
    step2 = run_dir / "checkpoints" / "step-2"
    assert (
        f"error: could not write checkpoint step-4 (step 4): no space left on device under "
        f"{run_dir / 'checkpoints'} (" in failed.output
    ), tail(failed.output)
    assert re.search(
        rf"; step-2 takes \d+ MB\); the previous checkpoint {re.escape(str(step2))} is intact\.",
        failed.output,
    )
    assert "Traceback" not in failed.output
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]
    resumed = run_inline([*args, "resume=auto", "train.max_steps=3"], run_dir).check()
    assert _resumed_from(resumed) == 2 and _printed_steps(resumed) == [3]


def test_a_rank_that_dies_ends_the_run_quickly_and_is_named(tmp_path: Path) -> None:
    """SIGKILL one rank of a 2-rank run (as the kernel's OOM killer would). The survivor's next
    collective fails at once (gloo sees the closed connection; a hung peer would instead hit the
    process-group timeout), and the deepspeed launcher, which polls its ranks every second,
    terminates the rest (SIGKILL after 30 s at most) and names the failed rank's command."""
    import psutil

    run_dir = tmp_path / "run"
    proc = spawn(
        [*SFT, "train.max_steps=500", "train.per_device_batch_size=1", "checkpoint.every_steps=0"],
        run_dir, launcher="deepspeed", nproc=2,
    )  # fmt: skip
    _wait_for_step(proc, run_dir, 1)
    ranks = [
        p for p in psutil.Process(proc.pid).children(recursive=True)
        if "--local_rank=1" in p.cmdline()
    ]  # fmt: skip
    assert len(ranks) == 1
    killed_at = time.monotonic()
    ranks[0].kill()
    result = finish(proc, run_dir, timeout_s=120)
    took = time.monotonic() - killed_at
    assert result.returncode != 0
    assert took < 45, f"the run took {took:.0f} s to end after a rank died"
    assert re.search(r"'--local_rank=1'.*exits with return code = -9", result.output), tail(
        result.output
    )


# ---------------------------------------------------------------------------- a hung reward
# Issue 24 (8): a reward function that never returns (rl_test_rewards.hangs, which creates
# $RL_TEST_MARKER when it is entered). One short GRPO step on the tiny model.
HANGING_REWARD = [
    "task=grpo", *COMMON, "deepspeed=z0", "grpo.max_completion_length=4", "grpo.num_generations=2",
    "train.per_device_batch_size=2", "grpo.eval_samples=0", "train.max_steps=2",
    "reward.functions=[rl_test_rewards:hangs]",
]  # fmt: skip


def _spawn_hanging(run_dir: Path, marker: Path, *args: str) -> subprocess.Popen:
    from conftest import REPO_ROOT

    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
        "RL_TEST_MARKER": str(marker),
    }
    proc = spawn([*HANGING_REWARD, *args], run_dir, extra_env=env)
    deadline = time.monotonic() + 180
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_group(proc)
            pytest.fail(f"the run never called the reward function:\n{tail(proc.communicate()[0])}")
        time.sleep(0.05)
    return proc


def _assert_ended_cleanly(run_dir: Path, status: str, output: str) -> None:
    """run.json records how the run ended, the lock is released, nothing temporary is left."""
    assert json.loads((run_dir / "run.json").read_text())["status"] == status
    left = sorted(p.name for p in run_dir.rglob("*") if p.name.startswith("."))
    assert left == [], f"left behind in {run_dir}: {left}"
    assert "Traceback" not in output, tail(output)


def test_sigterm_while_a_reward_function_hangs_ends_in_a_clean_stop(tmp_path: Path) -> None:
    """A scheduler sends SIGTERM once and SIGKILL after its grace period (30 s by default in
    Slurm and Kubernetes). The step cannot end while the reward hangs, so the call gets
    REWARD_GRACE_S (10 s) and is then abandoned: exit 143, run.json "stopped", lock released,
    well before a SIGKILL would come. (Before: nothing happened until kill -9.)"""
    run_dir, marker = tmp_path / "run", tmp_path / "entered"
    proc = _spawn_hanging(run_dir, marker)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    result = finish(proc, run_dir, timeout_s=60)
    took = time.monotonic() - signalled
    assert result.returncode == 128 + signal.SIGTERM, tail(result.output)
    assert took < 30, f"stopped {took:.1f} s after SIGTERM: a scheduler would have killed it"
    assert "SIGTERM received: finishing this step, then writing a checkpoint" in result.output
    assert (
        "stopped by SIGTERM: reward function 'hangs' was still running on line " in result.output
    ), tail(result.output)
    _assert_ended_cleanly(run_dir, "stopped", result.output)


def test_a_second_signal_stops_at_once(tmp_path: Path) -> None:
    """SIGTERM, then Ctrl-C: the second signal does not wait for the step (or the reward's grace
    period, 10 s): exit 130 at once, run.json "stopped", lock released. (Before: both ignored.)"""
    run_dir, marker = tmp_path / "run", tmp_path / "entered"
    proc = _spawn_hanging(run_dir, marker)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGINT)
    result = finish(proc, run_dir, timeout_s=60)
    took = time.monotonic() - signalled
    assert result.returncode == 128 + signal.SIGINT, tail(result.output)
    assert took < 5, f"stopped {took:.1f} s after the second signal"
    assert "stopped at once by a second stop signal (SIGINT after SIGTERM)" in result.output
    _assert_ended_cleanly(run_dir, "stopped", result.output)


def test_a_reward_function_past_reward_timeout_seconds_fails_the_run(tmp_path: Path) -> None:
    """reward.timeout_seconds bounds one call: exit 2, one message naming the function and the
    rows, run.json "failed", lock released. (In-process: the watchdog interrupts this
    process's main thread, where pytest runs the test.)"""
    run_dir = tmp_path / "run"
    result = run_inline([*HANGING_REWARD, "reward.timeout_seconds=2"], run_dir)
    assert result.returncode == 2, tail(result.output)
    assert (
        "error: reward in step 1 failed, before that step's optimizer update: reward function "
        "'hangs' did not return within reward.timeout_seconds=2 on line " in result.output
    ), tail(result.output)
    assert "(2 completions)" in result.output
    _assert_ended_cleanly(run_dir, "failed", result.output)


# ---------------------------------------------------------------------------- a full disk
# Issue 24 (11): output_dir on a real filesystem that fills up while step-2 is written. A
# 60 MB tmpfs holds step-1 (36 MB for the tiny model on ZeRO-0) but not step-2 beside it. It is
# mounted in a mount namespace of the run's own (`unshare`: no root needed where user namespaces
# are allowed), so it disappears with the run; the script copies what the run left first.
# torch.save reports the full disk as a RuntimeError without ENOSPC, which is what went wrong.
TMPFS_SCRIPT = """mnt=$1; copy=$2; shift 2
mount -t tmpfs -o size=60m tmpfs "$mnt" || exit 99
"$@"; rc=$?
cp -a "$mnt/." "$copy/"
exit $rc
"""


def test_a_disk_that_fills_up_during_a_checkpoint_fails_the_run_cleanly(tmp_path: Path) -> None:
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (unshare -rm: {probe.stderr.decode().strip()})")
    script = tmp_path / "on_tmpfs.sh"
    script.write_text(TMPFS_SCRIPT)
    mnt, copy = tmp_path / "mnt", tmp_path / "after"
    mnt.mkdir()
    copy.mkdir()
    run_dir = mnt / "run"
    result = launch(
        ["task=sft", *COMMON, "deepspeed=z0", "data.max_length=64", "train.max_steps=3",
         "checkpoint.every_steps=1", "checkpoint.keep_last=1", "data.max_eval_samples=4"],
        run_dir, wrap=["unshare", "-rm", "bash", str(script), str(mnt), str(copy)],
    )  # fmt: skip
    assert result.returncode == 2, tail(result.output)
    checkpoints_dir = run_dir / "checkpoints"
    assert (
        f"error: could not write checkpoint step-2 (step 2): no space left on device under "
        f"{checkpoints_dir} (" in result.output
    ), tail(result.output)
    assert f"the previous checkpoint {checkpoints_dir / 'step-1'} is intact" in result.output
    assert "Traceback" not in result.output and "warning: could not record" not in result.output
    after = copy / "run"
    _assert_ended_cleanly(after, "failed", result.output)  # no .lock, .tmp-run.json, .tmp-step-2
    from align_anything.training import checkpoints

    assert [p.name for p in (after / "checkpoints").iterdir()] == ["step-1"]
    assert checkpoints.verify(after / "checkpoints" / "step-1") is None


# ---------------------------------------------------------------------------- what is saved
# Issue 24 (6): final/ stored the tied input embedding and LM head twice (25 MB for the tiny
# model, whose own folder holds 12.9 MB).


def test_final_stores_a_tied_embedding_once_and_equals_the_export_of_the_last_checkpoint(
    finished_run: RunResult, tmp_path: Path
) -> None:
    import sys

    import torch
    from conftest import REPO_ROOT
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from align_anything.families.zoo import resolve_model_path

    final = finished_run.check().output_dir / "final"
    base = Path(resolve_model_path("tiny-random-llama")) / "model.safetensors"
    saved = load_file(final / "model.safetensors")
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved
    assert (final / "model.safetensors").stat().st_size <= base.stat().st_size + 4096
    # The export of the last checkpoint (merged by DeepSpeed's zero_to_fp32, saved from a model
    # whose weights share one tensor) holds the very same tensors.
    exported = tmp_path / "exported"
    subprocess.run(
        [sys.executable, "-m", "align_anything", "export",
         str(finished_run.output_dir / "checkpoints" / "step-3"), "--out", str(exported)],
        cwd=REPO_ROOT, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    other = load_file(exported / "model.safetensors")
    assert sorted(other) == sorted(saved)
    assert all(torch.equal(saved[k], other[k]) for k in saved)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, saved["model.embed_tokens.weight"])


def test_export_of_an_image_text_checkpoint_is_complete(tmp_path: Path) -> None:
    """Issue 24 (5): `export` of a tiny-random-llava checkpoint wrote the tokenizer but not the
    processor, so AutoProcessor could not load the folder. Now it holds the processor of the
    run's model (same ids, same pixels), the weights of the checkpoint (those final/ holds after
    the same step) and generates on an image; final/ loads with AutoProcessor too."""
    import sys

    import torch
    from conftest import REPO_ROOT
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from align_anything.data.synthetic import make_dataset
    from align_anything.families.language.loading import load_processor
    from align_anything.families.zoo import resolve_model_path

    data = make_dataset("shapes", tmp_path / "shapes", rows=12, seed=0, text_every=2)
    run_dir = tmp_path / "run"
    run_inline(
        ["task=sft", *COMMON, "model.name_or_path=tiny-random-llava", "deepspeed=z0",
         f"data.path={data / 'sft.jsonl'}", "data.eval_fraction=0.0", "train.max_steps=1",
         "train.per_device_batch_size=2", "checkpoint.every_steps=1"],
        run_dir,
    ).check()  # fmt: skip
    exported = tmp_path / "exported"
    done = subprocess.run(
        [sys.executable, "-m", "align_anything", "export",
         str(run_dir / "checkpoints" / "step-1"), "--out", str(exported)],
        cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    base = load_processor(resolve_model_path("tiny-random-llava"))
    prompt = ("<|im_start|>user\n<image>\nWhat colour is the shape?<|im_end|>\n"
              "<|im_start|>assistant\n")  # fmt: skip
    image = Image.new("RGB", (16, 16), (200, 10, 10))
    expected = base(text=[prompt], images=[image], return_tensors="pt")
    for folder in (exported, run_dir / "final"):
        got = AutoProcessor.from_pretrained(folder)(text=[prompt], images=[image],
                                                    return_tensors="pt")  # fmt: skip
        assert torch.equal(got["input_ids"], expected["input_ids"]), folder
        assert torch.equal(got["pixel_values"], expected["pixel_values"]), folder
    weights = load_file(exported / "model.safetensors")
    final = load_file(run_dir / "final" / "model.safetensors")
    assert sorted(weights) == sorted(final)
    assert all(torch.equal(weights[k], final[k]) for k in final)
    model = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32).eval()
    out = model.generate(**expected, max_new_tokens=2, do_sample=False)
    assert out.shape[1] > expected["input_ids"].shape[1]
