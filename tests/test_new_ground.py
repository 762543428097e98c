"""Nothing lost, nothing silently wrong (issue 38: cases 5-7 and 13-17, and the small things
seen on the way), through the real entry point: `align_anything.train` (in-process where the
case ends before any compute, launched where it trains) and the tool commands.

- **finished runs** (case 5): `resume=auto` on a run that finished is a job re-submitted after
  its end. It says so, changes nothing (no evaluation, no export, summary.json, run.json and
  metrics.jsonl untouched) and exits 0, as a scheduler's retry of a finished job should; an
  error would fail that job for nothing. Only a larger `train.max_steps` trains on;
- **one record per step** (case 6) after a kill and a resume, the weights of `final/`,
  checkpoints and exports readable under the umask (case 7), and the versions of an LM run
  (case 17): one resumed launch;
- **remote rewards** (cases 13-15, and a held-out reward without any opinion): GRPO launches,
  started together, against a reward server on 127.0.0.1 in this process whose every answer
  is wrong in one way (it stops by itself after `SERVER_LIFETIME_S` at the latest);
- **messages** (case 16, serve-reward's model names) and the lock's pins: cheap, in-process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import (
    COMMON,
    FINISHED_ARGS,
    REPO_ROOT,
    RunResult,
    copy_run,
    finish,
    launch,
    snapshot,
    spawn,
)

from align_anything.train import main

UMASK_022 = ["sh", "-c", 'umask 022; exec "$@"', "sh"]


def _run_json(folder: Path) -> dict:
    return json.loads((folder / "run.json").read_text())


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _modes(root: Path, names: list[str]) -> dict[str, str]:
    """Each file under `root`'s folders `names` -> its permission bits, e.g. "0o644"."""
    return {
        str(p.relative_to(root)): oct(p.stat().st_mode & 0o777)
        for name in names
        for p in sorted((root / name).rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------- finished runs


@pytest.mark.slow  # works on copies of conftest.finished_run (a launch)
@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize("left", ["step-2 and step-3", "step-2 only", "no checkpoint"])
def test_resume_auto_on_a_finished_run_changes_nothing(
    finished_run: RunResult, left: str, tmp_path: Path, capsys
) -> None:
    """Case 5: the run finished at step 3 (final/, summary.json, an "after" evaluation): with
    its checkpoints as the run left them, with the last one before the end (checkpoint
    .every_steps not dividing max_steps), or with none left, `resume=auto` says it is
    finished and how to go on, and exits 0 with every file as it was and no lock left."""
    run = copy_run(finished_run, tmp_path / "run")
    for step in {"step-2 only": [3], "no checkpoint": [2, 3]}.get(left, []):
        shutil.rmtree(run / "checkpoints" / f"step-{step}")
    before = snapshot(run)
    status = main([*FINISHED_ARGS, "resume=auto", f"output_dir={run}"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert f"note: output_dir='{run}' holds a run that finished at step 3 (final/ and " \
           "summary.json written): nothing to do, nothing changed" in captured.out  # fmt: skip
    assert "raise train.max_steps (or train.epochs) past 3 steps (this run has 3)" in captured.out
    assert "eval (" not in captured.out and "error:" not in captured.err
    assert snapshot(run) == before  # run.json, metrics, summary, final/: as they were


@pytest.mark.slow
@pytest.mark.usefixtures("in_process_offline")
def test_training_on_past_a_finished_run_needs_its_checkpoint(
    finished_run: RunResult, tmp_path: Path, capsys
) -> None:
    """A larger train.max_steps continues from the last checkpoint (test_output_dir.py); with
    no checkpoint left there is nothing to continue from: one message, before any compute."""
    run = copy_run(finished_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    status = main([*FINISHED_ARGS, "resume=auto", "train.max_steps=5", f"output_dir={run}"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert f"output_dir='{run}' holds a run that finished at step 3, and this run would go on " \
           "to step 5, but no checkpoint of it is left to continue from" in err  # fmt: skip
    assert snapshot(run) == before


# ---------------------------------------------------------------------------- a resumed run


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def resumed_run(finished_run: RunResult, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The finished 3-step SFT run as a kill -9 right after step 3 was logged would have left
    it (metrics.jsonl through step 3 and its "after" evaluation, no step-3 checkpoint, no
    final/, run.json `running`, the dead run's lock), resumed with resume=auto under umask
    022. Built from a finished run rather than by a timed kill: a kill between a step's log
    line and its checkpoint is a race on a run this small; the files are what it leaves."""
    run = copy_run(finished_run, tmp_path_factory.mktemp("resumed") / "run")
    for name in ("checkpoints/step-3", "final"):
        shutil.rmtree(run / name)
    (run / "summary.json").unlink()
    record = {k: v for k, v in _run_json(run).items() if k != "final_step"}
    (run / "run.json").write_text(json.dumps({**record, "status": "running"}))
    (run / ".lock").write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename,
                                           "started": time.time()}))  # fmt: skip
    return launch([*FINISHED_ARGS, "resume=auto"], run, wrap=UMASK_022).check()


@pytest.mark.slow
def test_a_resumed_run_keeps_one_record_per_step(
    resumed_run: RunResult, finished_run: RunResult
) -> None:
    """Case 6: step 3 and the closing evaluation, logged by the killed run and again by the
    resumed one, appear once, with the resumed run's values, which equal the uninterrupted
    run's (resume is exact)."""
    records = _records(resumed_run.output_dir)
    assert [(r["step"], r.get("phase")) for r in records] == [
        (0, "before"), (1, None), (2, None), (3, None), (3, "after")
    ]  # fmt: skip
    assert "removed 2 record(s) past step 2" in resumed_run.output
    original = {(r["step"], r.get("phase")): r for r in _records(finished_run.output_dir)}
    assert records[3]["loss"] == pytest.approx(original[(3, None)]["loss"], rel=1e-6)
    assert records[4]["eval/loss"] == pytest.approx(original[(3, "after")]["eval/loss"], rel=1e-6)
    assert _run_json(resumed_run.output_dir)["status"] == "complete"


@pytest.mark.slow
def test_weights_are_readable_under_the_umask(resumed_run: RunResult, tmp_path: Path) -> None:
    """Case 7: under umask 022 final/'s weights, every file of the checkpoint, and an export
    of it (`python -m align_anything export`, in-process here under umask 022) are 0644 like
    the configs beside them; safetensors' `save_file` alone would leave the weights 0600."""
    out = resumed_run.output_dir
    modes = _modes(out, ["final", "checkpoints/step-3"])
    assert "final/model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
    from align_anything.__main__ import main as tool_main

    previous = os.umask(0o022)
    try:
        status = tool_main(["export", str(out / "checkpoints" / "step-3"), "--out",
                            str(tmp_path / "exported")])  # fmt: skip
    finally:
        os.umask(previous)
    assert status == 0
    modes = _modes(tmp_path, ["exported"])
    assert "exported/model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes


@pytest.mark.slow
def test_a_language_model_run_names_only_the_libraries_it_uses(resumed_run: RunResult) -> None:
    """Case 17, the other side (test_image_data_edges.py has a text-to-image LoRA run naming
    diffusers and peft): a full fine-tuning of a language model uses neither."""
    versions = resumed_run.summary_line("versions")
    assert versions.startswith("torch ") and ", datasets " in versions
    assert "diffusers" not in versions and "peft" not in versions


# ---------------------------------------------------------------------------- remote rewards

SERVER_LIFETIME_S = 300.0
# The trickling answer: one byte every TRICKLE_GAP_S (each gap well inside timeout_s, so only a
# deadline for the whole answer cuts it off; the whole answer takes ~20 s).
TRICKLE_GAP_S = 0.5
GRPO = [
    "task=grpo", *COMMON, "data.path=arith-prompts", "data.eval_path=arith-prompts-eval",
    "train.max_steps=1", "grpo.num_generations=4", "grpo.max_completion_length=8",
    "grpo.eval_samples=4", "deepspeed=z0", "train.per_device_batch_size=8",
    "checkpoint.save_final=false", "reward.functions=[]", "reward.remote.retries=0",
]  # fmt: skip


def _answer(path: str, count: int) -> bytes:
    """The server's answer to a request of `count` completions at `path`."""
    rewards: list = [0.5] * count
    if path == "/nan":
        rewards[0] = math.nan  # json.dumps writes NaN, which Python's json reads
    elif path == "/bool":
        rewards = [True] * count
    elif path == "/none":
        rewards = [None] * count
    return json.dumps({"rewards": rewards}).encode()


class RewardServer:
    """A reward server on 127.0.0.1 answering by path: /fine (0.5 each), /nan (the first is
    NaN), /bool (true each), /none (null each), /trickle (0.5 each, one byte at a time). It
    stops with `stop`, and by itself after SERVER_LIFETIME_S."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = _answer(self.path, len(body["completions"]))
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.path != "/trickle":
                        self.wfile.write(data)
                        return
                    for byte in data:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(TRICKLE_GAP_S)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.timer = threading.Timer(SERVER_LIFETIME_S, self.stop)
        self.timer.daemon = True
        self.timer.start()
        self.base = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def reward_server() -> Iterator[RewardServer]:
    server = RewardServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def remote_runs(
    reward_server: RewardServer, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, RunResult]:
    """One GRPO launch per way of answering, started together (each is mostly start-up)."""
    root = tmp_path_factory.mktemp("remote")
    url = reward_server.base
    cases = {
        "nan": [f"reward.remote.urls=[{url}/fine,{url}/nan]"],
        "bool": [f"reward.remote.urls=[{url}/bool]"],
        "trickle": [f"reward.remote.urls=[{url}/trickle]", "reward.remote.timeout_s=2"],
        "none": [f"reward.remote.urls=[{url}/none]"],
    }
    procs = {name: spawn([*GRPO, *extra], root / name) for name, extra in cases.items()}
    return {name: finish(proc, root / name) for name, proc in procs.items()}


def _one_error(run: RunResult) -> str:
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in run.output, run.output[-3000:]
    return errors[0]


@pytest.mark.slow
def test_a_nan_reward_names_the_server(remote_runs: dict, reward_server: RewardServer) -> None:
    """Case 13: with two servers, the message names the URL that answered NaN (not only its
    reward name `remote_1`), and the row, as every other remote-reward failure does."""
    error = _one_error(remote_runs["nan"])
    assert (
        f"reward 'remote_1' on line 1 (1 completion): POST {reward_server.base}/nan: "
        "reward 1 of the answer is NaN, not a finite number (null is no opinion)" in error
    )
    assert "held-out evaluation" in error  # the first scoring: the evaluation before step 1


@pytest.mark.slow
def test_a_boolean_reward_is_refused(remote_runs: dict, reward_server: RewardServer) -> None:
    """Case 15: `true` is not a reward of 1.0."""
    error = _one_error(remote_runs["bool"])
    assert f"POST {reward_server.base}/bool: reward 1 of the answer is true (a boolean, not " \
           "a number)" in error  # fmt: skip


@pytest.mark.slow
def test_timeout_s_is_a_deadline_for_the_whole_answer(
    remote_runs: dict, reward_server: RewardServer
) -> None:
    """Case 14: a server sending one byte every 0.5 s never leaves a read waiting 2 s, but its
    answer takes ~20 s: cut off at 2 s, the run stops at its first request (the request is
    not retried: reward.remote.retries=0)."""
    error = _one_error(remote_runs["trickle"])
    assert f"POST {reward_server.base}/trickle: no answer within 2 s (gave up after 1 attempt " \
           "(no retries); the timeout is 2 s)" in error  # fmt: skip
    assert not [r for r in remote_runs["trickle"].metrics if "loss" in r]  # no step trained


@pytest.mark.slow
def test_a_held_out_reward_without_any_opinion_is_not_zero(remote_runs: dict) -> None:
    """Small thing: a server answering null for every completion has no opinion; the held-out
    evaluation says so (`eval/frac_reward_none` 1, a warning) instead of `eval/reward` 0."""
    run = remote_runs["none"].check()
    for phase in ("before", "after"):
        line = run.eval(phase)
        assert "eval/reward" not in line and "eval/rewards/remote" not in line, line
        assert line["eval/frac_reward_none"] == 1.0
    assert "warning: eval (before): no reward had an opinion on any of the 4 held-out " \
           "completions" in run.output  # fmt: skip
    assert "reward 0.0000" not in run.output


# ---------------------------------------------------------------------------- messages


@pytest.mark.usefixtures("in_process_offline")
def test_a_pipeline_as_the_critic_names_ppo_critic_model(tmp_path: Path, capsys) -> None:
    """Case 16: the key at fault is ppo.critic_model (model.name_or_path, the policy, is
    fine), and a diffusion task is no fix for a critic."""
    status = main(["task=ppo", "model.name_or_path=tiny-random-llama",
                   "ppo.critic_model=tiny-t2i-shapes", f"output_dir={tmp_path / 'out'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert "ppo.critic_model='tiny-t2i-shapes' is a diffusers text-to-image pipeline " \
           "(model_index.json), not a language model: ppo.critic_model takes a transformers " \
           "model folder" in err  # fmt: skip
    assert "model.name_or_path" not in err and "diffusion task" not in err


@pytest.mark.usefixtures("in_process_offline")
def test_serve_reward_resolves_built_in_model_names(capsys) -> None:
    """serve-reward reads model names as train does: a built-in language model resolves, and
    is refused as what it is (a causal LM) with the command that trains a reward model from
    it, not as "not a model folder"; a built-in pipeline is named as a pipeline."""
    from align_anything.__main__ import main as tool_main

    assert tool_main(["serve-reward", "tiny-random-llama", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tiny-random-llama is a causal language model "
                          "(LlamaForCausalLM), not a reward model"), err  # fmt: skip
    assert "python -m align_anything.train task=rm model.name_or_path=tiny-random-llama" in err
    assert tool_main(["serve-reward", "tiny-t2i-shapes", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tiny-t2i-shapes is a diffusers text-to-image pipeline, not "
                          "a reward model"), err  # fmt: skip
    assert "align_anything.train task=rm" not in err  # no reward model is trained from it


def test_every_pin_of_the_lock_is_needed() -> None:
    """Small thing: constraints.txt pins nothing the project does not install. cwevals, which
    looked unneeded, is wandb's own exact pin (the dev and tracking extras). Walks the
    requirements of pyproject.toml's dependencies and extras through the installed
    packages' metadata."""
    tomllib = pytest.importorskip("tomllib")
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lock = (REPO_ROOT / "constraints.txt").read_text().splitlines()
    pins = {canonicalize_name(line.split("==")[0]) for line in lock if "==" in line}
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    roots = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                         for r in extra), "torch"]  # fmt: skip
    todo = [Requirement(r) for r in roots]
    needed, unknown = set(), set()
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if (name, tuple(sorted(requirement.extras))) in needed:
            continue
        needed.add((name, tuple(sorted(requirement.extras))))
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            unknown.add(name)  # not installed here (e.g. the bench extra's trl)
            continue
        extras = [{"extra": e} for e in requirement.extras] or [{"extra": ""}]
        todo += [r for r in map(Requirement, requires)
                 if r.marker is None or any(r.marker.evaluate(e) for e in extras)]  # fmt: skip
    unneeded = pins - {name for name, _ in needed}
    if unneeded and unknown:
        pytest.skip(f"{sorted(unknown)} not installed: cannot tell whether {sorted(unneeded)} "
                    "are theirs")  # fmt: skip
    assert not unneeded, f"constraints.txt pins what nothing requires: {sorted(unneeded)}"
    assert "cwevals" in pins and any(
        Requirement(r).name == "cwevals" for r in metadata.distribution("wandb").requires or []
    )
