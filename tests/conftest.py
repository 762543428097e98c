"""Shared helpers for tests that run the real entry point (in a subprocess, or in-process).

`launch(...)` starts `align_anything.train` the way a user would (plain `python -m`, the
deepspeed launcher, or torchrun), offline, with a fresh loopback port per launch and a hard
timeout that kills the whole process group and fails the test instead of hanging CI.

`run_inline(...)` runs the same entry point in this process instead, for tests of what a run
computes rather than of how a process behaves: a launch spends 5-10 s on imports alone.

Runs that several test files read (the single-rank SFT / DPO / RM recipes, a finished SFT run
with checkpoints) are session-scoped fixtures here, run in-process: under `make test` each pytest
worker that needs one runs it once (a few seconds). Runs that cost more are module-scoped in the
one file that reads them (`--dist loadfile` keeps a file in one worker).

Every test that starts a run must carry the `slow` marker (`make test-fast` leaves those out):
`spawn`, `finish` and `run_inline` fail a test that is not marked.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Real preference pairs: Anthropic's HH-RLHF harmless-base test split (MIT licence). The full file
# when it is beside the checkout (../shared/data, not copied into the repo), else its first 64
# rows shipped in tests/data (licence and origin in tests/data/hh-rlhf.LICENSE), so a clone on its
# own passes too; ALIGN_ANYTHING_HH_FILE=PATH reads another copy (e.g. the sample on purpose).
HH_FULL_FILE = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
HH_SAMPLE_FILE = REPO_ROOT / "tests" / "data" / "hh-rlhf-harmless-base-test-sample.jsonl.gz"
HH_FILE = Path(
    os.environ.get("ALIGN_ANYTHING_HH_FILE")
    or (HH_FULL_FILE if HH_FULL_FILE.is_file() else HH_SAMPLE_FILE)
)
BIN_DIR = Path(sys.executable).parent
# The venv's tools (deepspeed, torchrun, ninja) go *after* the rest of PATH, for this process and
# every run it starts: DeepSpeed compiles its CPU ops with whichever ninja comes first, and two
# ninja versions hash the build differently, so alternating them rebuilds the ops (a minute each).
if str(BIN_DIR) not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = f"{os.environ.get('PATH', '')}{os.pathsep}{BIN_DIR}"
TINY_MODEL = "tiny-random-llama"
# One launch normally takes 15-30 s here; a run past this is hung (e.g. a collective waiting on
# a dead rank) and fails the test.
DEFAULT_TIMEOUT_S = 240.0
OUTPUT_TAIL_CHARS = 6000
LAUNCHERS = ("python", "deepspeed", "torchrun")
# Variables a surrounding launcher could have set; a child run must not inherit them.
DIST_ENV_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "CROSS_SIZE",
)  # fmt: skip


# The test being set up or run: `spawn` and `finish` check that it is marked slow.
_current_test: pytest.Item | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers) each worker computes in one thread,
    as the runs it launches do: two workers with two OpenMP threads each on two cores mostly
    wait for each other. Set before any test module imports torch."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


# The test files that take longest, longest first (one worker, `--durations=0`, summed per
# file). `make test` hands each of its workers whole files in collection order (`--dist
# loadfile --no-loadscope-reorder`), so the long files start first and the short ones fill the
# end: two workers then finish within a short file of each other. A file not listed runs after
# these, in name order; a stale list costs balance, never a test.
LONGEST_FIRST = (
    "test_scripts.py",
    "test_fault_tolerance.py",
    "test_grpo_runs.py",
    "test_ppo_runs.py",
    "test_distributed.py",
    "test_presets.py",
    "test_lora.py",
    "test_multimodal.py",
    "test_diffusion_runs.py",
    "test_packing.py",
    "test_data_errors.py",
    "test_kto_runs.py",
    "test_data_cache.py",
    "test_ema.py",
    "test_universal_resume.py",
    "test_output_dir.py",
    "test_dpo_loss_types.py",
    "test_data_past_one_batch.py",
    "test_checkpoints.py",
    "test_recipes.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (`LONGEST_FIRST`); within a file, pytest's order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _current_test
    _current_test = item


def _require_slow_marker(what: str) -> None:
    """Fail the current test, before it starts `what`, unless it is marked slow: an unmarked
    end-to-end test would make `make test-fast` take minutes."""
    if _current_test is not None and _current_test.get_closest_marker("slow") is None:
        pytest.fail(
            f"{_current_test.nodeid} {what} but is not marked slow: add @pytest.mark.slow "
            "(or `pytestmark = pytest.mark.slow` for a module of end-to-end tests)",
            pytrace=False,
        )


@pytest.fixture
def in_process_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that call the entry point in-process: hub offline, no inherited rank
    variables (the run must create its own one-process group)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_OFFLINE once, on import; where an earlier test imported it
    # first, a hub lookup (e.g. of a misspelt model name) would retry online for ~20 s.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for name in DIST_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(text: str, chars: int = OUTPUT_TAIL_CHARS) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


class RunResult(NamedTuple):
    """What one launch left behind: exit status, stdout+stderr, parsed metrics.jsonl lines."""

    returncode: int
    output: str
    metrics: list[dict[str, Any]]
    output_dir: Path

    def check(self) -> RunResult:
        """Fail the calling test, with the output tail, unless the run exited 0."""
        assert self.returncode == 0, (
            f"run into {self.output_dir} exited {self.returncode}; output tail:\n{tail(self.output)}"
        )
        return self

    def train_steps(self) -> list[dict[str, Any]]:
        """The logged training steps (eval lines carry a "phase" key and are left out)."""
        return [m for m in self.metrics if "phase" not in m]

    def losses(self) -> list[float]:
        return [float(m["loss"]) for m in self.train_steps()]

    def eval(self, phase: str) -> dict[str, Any]:
        found = [m for m in self.metrics if m.get("phase") == phase]
        assert found, f"no eval line with phase={phase!r} in {self.output_dir / 'metrics.jsonl'}"
        return found[-1]

    def zero_stage(self) -> int:
        """The ZeRO stage the engine reports in the start-up summary (what DeepSpeed actually
        runs, read from `engine.zero_optimization_stage()`, not the preset's number)."""
        found = re.findall(r"deepspeed\s+ZeRO stage (\d+)", self.output)
        assert found, f"no 'ZeRO stage N' line in the start-up summary:\n{tail(self.output)}"
        return int(found[-1])

    def summary_line(self, label: str) -> str:
        """The start-up summary line that begins with `label` (e.g. "reference")."""
        found = re.findall(rf"^\s+{re.escape(label)}\s+(.*)$", self.output, flags=re.MULTILINE)
        assert found, f"no '{label}' line in the start-up summary:\n{tail(self.output)}"
        return found[-1]


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group this helper started (launcher and ranks), if still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def merged(overrides: list[str]) -> list[str]:
    """`overrides` with each key once, the last value winning: a test states shared settings,
    then its changes to them (`[*SFT_ARGS, "train.max_steps=8"]`), while the trainer refuses a
    key given twice. An earlier override of a key is dropped and the later one keeps its place,
    so a later `data.columns={...}` still replaces an earlier `data.columns.x=...`."""
    last = {text.split("=", 1)[0].lstrip("+"): index for index, text in enumerate(overrides)}
    return [
        text for index, text in enumerate(overrides)
        if "=" not in text or last[text.split("=", 1)[0].lstrip("+")] == index
    ]  # fmt: skip


def spawn(
    overrides: list[str],
    output_dir: Path,
    *,
    launcher: str = "python",
    nproc: int = 1,
    extra_env: dict[str, str] | None = None,
    module: str = "align_anything.train",
    wrap: list[str] | None = None,
    python: str | None = None,
) -> subprocess.Popen:
    """Start `align_anything.train` with `overrides` (plus `output_dir=...`; a key given twice
    takes its last value, see `merged`) in the background.

    `launcher` is "python" (one process, `python -m`), "deepspeed" (`deepspeed --num_gpus N
    --master_port P --module`) or "torchrun" (`torchrun --nproc_per_node N --master_port P -m`).
    The launcher and every rank form one new process group (`_kill_group` ends all of them);
    stdout and stderr are one text pipe. `module` replaces the entry point (a test's wrapper
    that patches something, then calls `align_anything.train.main`); `wrap` is a command that
    runs the launch command given as its last arguments (e.g. in its own mount namespace);
    `python` another interpreter for launcher "python" (e.g. the vLLM environment's).
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    _require_slow_marker(f"starts {module} ({launcher})")
    module_args = [module, *merged([*overrides, f"output_dir={output_dir}"])]
    if launcher == "python":
        if nproc != 1:
            raise ValueError("launcher='python' starts exactly one process")
        command = [python or sys.executable, "-m", *module_args]
    elif launcher == "deepspeed":
        command = [
            str(BIN_DIR / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()),
            "--module", *module_args,
        ]  # fmt: skip
    else:
        command = [
            str(BIN_DIR / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", *module_args,
        ]  # fmt: skip

    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        # Output without a terminal: plain progress lines, no colour codes to parse around.
        NO_COLOR="1",
    )
    # One thread per process: the runs are tiny (a step is hundreds of short parallel sections,
    # and a second thread mostly waits at each one), ranks share the runner's few cores, and
    # `make test` runs two tests at once (pytest-xdist). Measured on the tiny text-to-image
    # model: the same speed alone, and 3-15x less CPU per step beside other work
    # (benchmarks/README.md, Diffusion-DPO).
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env or {})

    # A new session makes the launcher and every rank it starts one process group, so a timeout
    # can end all of them (killing only the launcher would leave ranks holding the port).
    return subprocess.Popen(
        [*(wrap or []), *command],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )


def finish(
    proc: subprocess.Popen, output_dir: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> RunResult:
    """Wait for a spawned run; on timeout kill its whole process group and fail the test."""
    try:
        _require_slow_marker(f"waits for a run ({' '.join(map(str, proc.args[:3]))} ...)")
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        pytest.fail(
            f"run timed out after {timeout_s:.0f} s and was killed: {' '.join(proc.args)}\n"
            f"output tail:\n{tail(output or '')}",
            pytrace=False,
        )
    except BaseException:
        # Interrupted (Ctrl-C, pytest-timeout, a test not marked slow): take the ranks down.
        _kill_group(proc)
        proc.wait()
        raise
    return RunResult(
        proc.returncode, output, _read_metrics(output_dir / "metrics.jsonl"), output_dir
    )


def launch(
    overrides: list[str],
    output_dir: Path,
    *,
    launcher: str = "python",
    nproc: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    extra_env: dict[str, str] | None = None,
    module: str = "align_anything.train",
    wrap: list[str] | None = None,
    python: str | None = None,
) -> RunResult:
    """Run `align_anything.train` (see `spawn`) and wait for it. On timeout the whole process
    group (launcher and ranks) is killed and the test fails with the output tail. Returns even
    when the run fails: call `.check()` to require success.
    """
    proc = spawn(
        overrides, output_dir, launcher=launcher, nproc=nproc, extra_env=extra_env, module=module,
        wrap=wrap, python=python,
    )  # fmt: skip
    return finish(proc, output_dir, timeout_s=timeout_s)


# ---------------------------------------------------------------------------- launch scripts
# scripts/*.sh as a user runs them. Each one-machine script trains 2 CPU ranks in some test
# (test_scripts.py checks that none is left out): in the file whose comparison needs a 2-rank
# run of that task, the run goes through the script, and `assert_script_trained` checks what
# the script must give, so that no 2-rank run is launched twice.
SCRIPTS = REPO_ROOT / "scripts"
SCRIPT_TASKS = "sft|dpo|rm|kto|grpo|rloo|ppo|diffusion_sft|diffusion_dpo"


def script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    for name in ("NUM_GPUS", "PRESET", "TASK", "MODEL", "OUTPUT_DIR", "DRY_RUN", "MASTER_ADDR"):
        env.pop(name, None)
    env.update(
        # The venv's deepspeed / torchrun, found after the rest of PATH: put first, the venv's
        # own `ninja` would shadow the system one, and DeepSpeed's JIT-built ops (keyed by
        # ninja's command hash, which differs between ninja versions) would rebuild, ~1 min.
        PATH=f"{env.get('PATH', '')}{os.pathsep}{BIN_DIR}",
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1", NO_COLOR="1", OMP_NUM_THREADS="1",
    )  # fmt: skip
    env.update(extra)
    return env


def script_overrides(overrides: list[str]) -> list[str]:
    """A test's run arguments for a script, which sets `task=` and `deepspeed=` itself (each
    key once, see `merged`)."""
    return [
        a for a in merged(overrides) if not a.startswith(("task=", "deepspeed=", "output_dir="))
    ]


def run_script(
    script: str, output_dir: Path, args: list[str], *, env: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RunResult:  # fmt: skip
    """`bash scripts/<script> args...` with the environment `env` (NUM_GPUS, PRESET, TASK...)
    and OUTPUT_DIR=output_dir, on a fresh port; waits for it like `launch`."""
    proc = subprocess.Popen(
        ["bash", str(SCRIPTS / script), *args],
        cwd=REPO_ROOT,
        env=script_env(OUTPUT_DIR=str(output_dir), MASTER_PORT=str(free_port()), **(env or {})),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        start_new_session=True,
    )  # fmt: skip
    return finish(proc, output_dir, timeout_s=timeout_s)


def assert_script_trained(run: RunResult, *, stage: int, steps: int) -> None:
    """What a launch script must give on 2 CPU ranks: both ranks in the run, the ZeRO stage the
    script's preset names, every step logged, and only rank 0 printing (one start-up summary,
    one progress line per step)."""
    run.check()
    assert re.search(r"^\s+world size\s+2 ", run.output, re.MULTILINE), run.output[-3000:]
    assert run.zero_stage() == stage
    assert [m["step"] for m in run.train_steps()] == list(range(1, steps + 1))
    assert len(re.findall(rf"^align_anything ({SCRIPT_TASKS})$", run.output, re.MULTILINE)) == 1
    for step in range(1, steps + 1):
        assert len(re.findall(rf"^step {step}/{steps} ", run.output, re.MULTILINE)) == 1


# What `spawn` sets for every run, set around an in-process run too (see `run_inline`).
INLINE_ENV = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    "NO_COLOR": "1",
}  # fmt: skip


def run_inline(
    overrides: list[str], output_dir: Path, *, extra_env: dict[str, str] | None = None
) -> RunResult:
    """Run the entry point in this process: `align_anything.train.main(overrides +
    output_dir=...)` (each key once, see `merged`), one rank; what it prints (at the Python and
    the file-descriptor level, e.g. the data workers' lines) captured into `RunResult.output`,
    as `launch` would return it.

    For tests of what a run computes and writes (losses, metrics, checkpoints, exports), not of
    how a process behaves (signals, launchers, exit of a killed process, several ranks), nor of
    runs whose data step forks worker processes (`data.num_proc` > 1 on 4,000 rows or more):
    those fork from a process of their own, as a user's run does, never from this test worker
    with the threads and state of every test before (one such fork here hung CI once). A launch
    spends 5-10 s importing torch, transformers, deepspeed and datasets, which this process has
    already done. As in `spawn`: hub offline, no inherited rank variables, one compute thread.
    The run's own clean-up destroys its process group; the rank variables the one-process group
    set, and the environment and thread count set here, are restored afterwards, so in-process
    runs stay independent of each other and of the tests around them. An exception escaping
    `main` (a bug: user errors are exit status 2) is returned as exit status 1 with its
    traceback in the output, as a process would end.
    """
    _require_slow_marker("runs align_anything.train in-process")
    import tempfile
    import traceback

    import huggingface_hub.constants
    import torch

    from align_anything.train import main

    env = {**INLINE_ENV, **(extra_env or {})}
    saved_env = {name: os.environ.get(name) for name in (*env, *DIST_ENV_VARS)}
    saved_offline = huggingface_hub.constants.HF_HUB_OFFLINE
    saved_threads = torch.get_num_threads()
    for name in DIST_ENV_VARS:
        os.environ.pop(name, None)
    os.environ.update(env)
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    torch.set_num_threads(1)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with tempfile.TemporaryDirectory(prefix="inline-") as scratch:
        log_path = Path(scratch) / "output.log"
        # One file for Python's writes (line-buffered) and for fds 1 and 2 (C code, the data
        # workers): appends from both land in order.
        with open(log_path, "a", buffering=1, encoding="utf-8", errors="replace") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    try:
                        returncode = main(merged([*overrides, f"output_dir={output_dir}"]))
                    except SystemExit as stop:
                        returncode = stop.code if isinstance(stop.code, int) else 1
                    except Exception:
                        traceback.print_exc()
                        returncode = 1
            finally:
                sink.flush()
                os.dup2(saved_fds[0], 1)
                os.dup2(saved_fds[1], 2)
                for fd in saved_fds:
                    os.close(fd)
                torch.set_num_threads(saved_threads)
                huggingface_hub.constants.HF_HUB_OFFLINE = saved_offline
                for name, value in saved_env.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        output = log_path.read_text(encoding="utf-8", errors="replace")
    return RunResult(returncode, output, _read_metrics(output_dir / "metrics.jsonl"), output_dir)


# ---------------------------------------------------------------------------- shared runs

# Short, deterministic recipe runs: tiny random Llama, CPU fp32, seed 42, 4 optimizer steps of a
# global batch of 4. Eval is capped to keep the launches fast.
RECIPE_STEPS = 4
COMMON = [f"model.name_or_path={TINY_MODEL}", "train.precision=fp32", "train.seed=42"]
SFT_ARGS = [
    "task=sft", *COMMON, f"train.max_steps={RECIPE_STEPS}", "data.max_eval_samples=8",
    # 50x the preset's rate: at 2e-5 four steps barely move a random model's loss, and the
    # comparisons below should see the optimizer's updates, not only the data order.
    "train.learning_rate=1e-3",
]  # fmt: skip
DPO_ARGS = [
    "task=dpo", *COMMON, f"train.max_steps={RECIPE_STEPS}", "data.max_eval_samples=8",
    # Plain sigmoid DPO (the task default adds an NLL term), no generation check: fast runs,
    # and step 0 is exactly ln 2.
    "dpo.rpo_alpha=0.0", "dpo.generation_check_samples=0",
    # A larger rate than the preset's 5e-6, so the loss visibly moves within 4 steps.
    "train.learning_rate=1e-4",
]  # fmt: skip
RM_ARGS = [
    "task=rm", *COMMON, f"train.max_steps={RECIPE_STEPS}", "data.max_eval_samples=8",
    "train.learning_rate=1e-4",
]  # fmt: skip


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def sft_single(runs_dir: Path) -> RunResult:
    """SFT, 1 rank × micro-batch 4, ZeRO-0: the frozen-loss recipe and the 1-rank baseline."""
    return run_inline(
        [*SFT_ARGS, "deepspeed=z0", "train.per_device_batch_size=4"], runs_dir / "sft-1rank"
    )


@pytest.fixture(scope="session")
def dpo_single(runs_dir: Path) -> RunResult:
    """DPO (sigmoid, precomputed reference), 1 rank × micro-batch 4, ZeRO-0."""
    return run_inline(
        [*DPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=4"], runs_dir / "dpo-1rank"
    )


@pytest.fixture(scope="session")
def rm_single(runs_dir: Path) -> RunResult:
    """Reward model on the built-in pairs, 1 rank × micro-batch 4, ZeRO-0."""
    return run_inline(
        [*RM_ARGS, "deepspeed=z0", "train.per_device_batch_size=4"], runs_dir / "rm-1rank"
    )


def copy_tiny_model(dest: Path) -> Path:
    """A local folder copy of the built-in tiny model (weights, config, tokenizer, template), for
    tests that alter one of its files."""
    import shutil

    from align_anything.families.zoo import resolve_model_path

    shutil.copytree(resolve_model_path(TINY_MODEL), dest)
    return dest


# A finished 3-step SFT run with checkpoints step-2 and step-3 and final/: the starting point of
# the output-dir, resume and export tests (they work on copies, see `copy_run`).
FINISHED_ARGS = [
    "task=sft", *COMMON, "deepspeed=z0", "data.max_length=64", "data.max_eval_samples=4",
    "train.per_device_batch_size=2", "train.learning_rate=1e-3", "train.max_steps=3",
    "checkpoint.every_steps=1", "checkpoint.keep_last=2",
]  # fmt: skip


@pytest.fixture(scope="session")
def finished_run(runs_dir: Path) -> RunResult:
    return run_inline(FINISHED_ARGS, runs_dir / "finished-sft").check()


def copy_run(run: RunResult, dest: Path) -> Path:
    """A copy of a run's output_dir, for a test that changes it."""
    import shutil

    shutil.copytree(run.output_dir, dest, symlinks=True)
    return dest


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under `root` (relative path -> size and checksum): what a test compares to
    show that nothing was changed or deleted."""
    import xxhash

    return {
        str(p.relative_to(root)): (p.stat().st_size, xxhash.xxh3_64(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
