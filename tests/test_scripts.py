"""The launch scripts in scripts/: each one-machine script really trains with 2 CPU ranks; the
multi-node and Slurm scripts, which cannot launch here, print their command (DRY_RUN=1), and
the test parses it with the real deepspeed / torchrun argument parsers.

The 2-rank runs of sft.sh, torchrun.sh, dpo.sh and rm.sh are those test_distributed.py compares
with one rank; kto.sh's is test_kto_runs.py's, grpo.sh's test_grpo_runs.py's and
diffusion_dpo.sh's test_diffusion_runs.py's: each file checks its script's run with
`conftest.assert_script_trained` (a 2-rank run costs half a minute, so none runs twice). The
rest train here; `test_every_one_machine_script_trains_in_a_test` keeps the list whole.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import (
    DIST_ENV_VARS,
    REPO_ROOT,
    SCRIPTS,
    TINY_MODEL,
    assert_script_trained,
    finish,
    run_script,
    script_env,
)

STEPS = 2
FAST = [
    f"model.name_or_path={TINY_MODEL}", "train.precision=fp32", f"train.max_steps={STEPS}",
    "data.max_eval_samples=4", "checkpoint.save_final=false", "train.per_device_batch_size=2",
]  # fmt: skip
# Text-to-image: the tiny random SD pipeline on the built-in shapes, one sample image, no check.
FAST_T2I = [
    "model.name_or_path=tiny-random-sd", "train.precision=fp32", f"train.max_steps={STEPS}",
    "data.max_eval_samples=2", "checkpoint.save_final=false", "train.per_device_batch_size=1",
    "logging.sample_prompts=[a_red_circle]", "logging.sample_seeds=[0]",
]  # fmt: skip
T2I_FAST = "{task}.check_samples=0 {task}.sample_steps=1 data.path={data}"
# Online RL: groups of 2 completions (the micro-batch of 2 holds one prompt), short answers.
RL_FAST = (
    "{task}.num_generations=2 {task}.max_completion_length=4 {task}.eval_samples=2 "
    "{task}.generation_batch_size=2"
)
# (script, environment, arguments before the overrides, expected ZeRO stage). With the scripts
# run in other files (above; sft.sh: arguments, preset z2; torchrun.sh: TASK, NUM_GPUS and
# PRESET=z0; dpo.sh: NUM_GPUS, the default preset z3; rm.sh and kto.sh: PRESET=z3 and
# --num_gpus=2 / --num_gpus 2; grpo.sh: NUM_GPUS, default z3; diffusion_dpo.sh: PRESET=z2) they
# use the arguments and the environment variables, the default preset (z3) and every launcher.
CASES = {
    "rloo.sh": ({"PRESET": "z2"}, ["--num_gpus", "2", *RL_FAST.format(task="rloo").split()], 2),
    "ppo.sh": ({"PRESET": "z0"}, ["--num_gpus", "2", *RL_FAST.format(task="ppo").split()], 0),
    "diffusion_sft.sh": ({"NUM_GPUS": "2"}, T2I_FAST.format(task="diffusion_sft",
                                                           data="t2i-shapes-eval").split(), 3),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_script_trains_on_two_cpu_ranks(script: str, tmp_path: Path) -> None:
    env, args, stage = CASES[script]
    run = run_script(
        script, tmp_path / "run", [*args, *(FAST_T2I if "diffusion" in script else FAST)], env=env
    )
    assert_script_trained(run, stage=stage, steps=STEPS)


def test_every_one_machine_script_trains_in_a_test() -> None:
    """Every script that starts a run on this machine is run by some test (here, or where its
    2-rank run serves a comparison): none was dropped when the runs moved."""
    helpers = {"env.sh", "launch.sh", "multinode.sh"}  # sourced, or several machines (dry run)
    scripts = {p.name for p in SCRIPTS.glob("*.sh")} - helpers
    trained = set(CASES)
    for path in Path(__file__).parent.glob("test_*.py"):
        found = set(re.findall(r'run_script\(\s*"([\w.]+\.sh)"', path.read_text()))
        if found and path.name != Path(__file__).name:
            assert "assert_script_trained(" in path.read_text(), f"{path.name}: {found} unchecked"
        trained |= found
    assert scripts == trained, f"not trained by any test: {sorted(scripts - trained)}"


def dry_run(script: str, *args: str, **env: str) -> list[str]:
    out = subprocess.run(
        ["bash", str(SCRIPTS / script), *args], cwd=REPO_ROOT, env=script_env(DRY_RUN="1", **env),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return shlex.split(out)


def test_multinode_command_parses_with_the_deepspeed_runner() -> None:
    """Not a real multi-node launch (one machine here): the printed command is checked."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_args

    hostfile = SCRIPTS / "hostfile.example"
    command = dry_run(
        "multinode.sh", "train.max_steps=10", HOSTFILE=str(hostfile), TASK="dpo", PRESET="z3"
    )
    assert command[0] == "deepspeed"
    args = parse_args(command[1:])
    assert args.hostfile == str(hostfile) and args.launcher == "pdsh"
    assert args.master_addr == "node1" and args.master_port == 29500  # the first host
    assert args.module and args.user_script == "align_anything.train"
    assert args.user_args == ["task=dpo", "deepspeed=z3", "train.max_steps=10"]
    assert dict(fetch_hostfile(args.hostfile)) == {"node1": 8, "node2": 8}


def test_an_override_replaces_the_scripts_default_for_its_key() -> None:
    """The scripts' settings (TASK, PRESET, MODEL, OUTPUT_DIR) are defaults: an override of the
    same key takes their place instead of following them (the trainer refuses a key twice)."""
    env = {"PRESET": "z3", "MODEL": "m", "OUTPUT_DIR": "o"}
    given = ["deepspeed=z0", "+model.name_or_path=tiny-random-llama", "train.max_steps=1"]
    command = dry_run("dpo.sh", *given, **env)
    assert command[command.index("align_anything.train") + 1 :] == [
        "task=dpo", "output_dir=o", *given
    ]  # fmt: skip
    command = dry_run(
        "multinode.sh", "task=rm", "output_dir=x", HOSTFILE=str(SCRIPTS / "hostfile.example"),
        TASK="dpo", **env,
    )  # fmt: skip
    assert command[command.index("align_anything.train") + 1 :] == [
        "deepspeed=z3", "model.name_or_path=m", "task=rm", "output_dir=x"
    ]  # fmt: skip


def test_multinode_names_a_missing_hostfile(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPTS / "multinode.sh")], cwd=REPO_ROOT,
        env=script_env(HOSTFILE=str(tmp_path / "hosts")), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and f"HOSTFILE={tmp_path / 'hosts'} does not exist" in done.stderr


def test_slurm_command_parses_with_torchrun(tmp_path: Path) -> None:
    """Not a real Slurm launch: a fake allocation (SLURM_* variables and a stand-in `scontrol`
    that expands the node list) and the printed srun + torchrun command, parsed by torchrun's
    own argument parser."""
    from torch.distributed.run import get_args_parser

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    scontrol = fake_bin / "scontrol"
    scontrol.write_text('#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames gpu-[07-08]" ] '
                        '&& printf "gpu-07\\ngpu-08\\n"\n')  # fmt: skip
    scontrol.chmod(0o755)
    env = script_env(
        SLURM_JOB_NODELIST="gpu-[07-08]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="4",
        SLURM_JOB_ID="1234", TASK="rm", PRESET="z2",
    )  # fmt: skip
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    out = subprocess.run(
        ["bash", str(SCRIPTS / "slurm.sbatch"), "train.epochs=2"], cwd=REPO_ROOT,
        env={**env, "DRY_RUN": "1"}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    command = shlex.split(out)
    assert command[:3] == ["srun", "--ntasks-per-node=1", "torchrun"], command
    args = get_args_parser().parse_args(command[3:])
    assert (args.nnodes, args.nproc_per_node) == ("2", "4")
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == "gpu-07:29500"
    assert args.rdzv_id == "1234" and args.module
    assert args.training_script == "align_anything.train"
    assert args.training_script_args == ["task=rm", "deepspeed=z2", "train.epochs=2"]


def test_every_script_is_valid_bash() -> None:
    scripts = sorted(SCRIPTS.glob("*.sh")) + sorted(SCRIPTS.glob("*.sbatch"))
    assert len(scripts) >= 7
    for path in scripts:
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"{path.name}: {done.stderr}"


def _without_environment() -> dict[str, str]:
    """The environment of a fresh shell: no virtual environment active, only system tools."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS and k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(
        p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir()
    )
    env.pop("PYTHON", None)
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.skipif(
    not (REPO_ROOT / ".venv" / "bin" / "python").exists(), reason="no .venv (make setup) here"
)
def test_scripts_find_the_project_venv_without_activation() -> None:
    """Right after `make test`/`make train`, with no environment active, scripts/env.sh points
    PYTHON and the launchers at the project's .venv."""
    probe = 'source scripts/env.sh && "$PYTHON" -c "import align_anything, sys; print(sys.prefix)" && command -v deepspeed'
    result = subprocess.run(
        ["bash", "-c", probe], cwd=REPO_ROOT, env=_without_environment(), capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    prefix, launcher = result.stdout.split()
    assert Path(prefix).resolve() == (REPO_ROOT / ".venv").resolve()
    assert Path(launcher).parent.resolve() == (REPO_ROOT / ".venv" / "bin").resolve()


@pytest.mark.skipif(
    not (REPO_ROOT / ".venv" / "bin" / "python").exists(), reason="no .venv (make setup) here"
)
@pytest.mark.slow
def test_an_example_runs_without_activating_the_venv(tmp_path: Path) -> None:
    env = {**_without_environment(), "MODEL": TINY_MODEL, "STEPS": "1", "OUT": str(tmp_path),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "NO_COLOR": "1"}  # fmt: skip
    proc = subprocess.Popen(
        ["bash", "examples/byo_dataset/run.sh"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    finish(proc, tmp_path / "sft", timeout_s=400).check()
    for stage in ("dpo", "rm", "sft"):
        assert (tmp_path / stage / "run.json").exists(), stage


# ---------------------------------------------------------------------------- compiled ops
# Issue 24: every new environment compiled DeepSpeed's CPU shared-memory communication op on its
# first run (one to two minutes on two cores), and environments sharing ~/.cache/torch_extensions
# rebuilt each other's ops.


def test_the_makefile_gives_the_environment_its_own_extension_folder() -> None:
    show = ["make", "-s", "--eval", "show-ext: ; @echo $$TORCH_EXTENSIONS_DIR", "show-ext"]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    done = subprocess.run(show, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(REPO_ROOT / ".venv" / "torch_extensions")
    mine = subprocess.run(show, cwd=REPO_ROOT, env={**env, "TORCH_EXTENSIONS_DIR": "/elsewhere"},
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert mine.stdout.strip() == "/elsewhere"  # a folder the user chose is kept


def test_env_sh_gives_the_environment_its_own_extension_folder() -> None:
    import sys

    probe = 'source scripts/env.sh && echo "$TORCH_EXTENSIONS_DIR"'
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["PYTHON"] = sys.executable
    done = subprocess.run(["bash", "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == str(Path(sys.prefix) / "torch_extensions")
    env["TORCH_EXTENSIONS_DIR"] = "/elsewhere"
    done = subprocess.run(["bash", "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "/elsewhere"


@pytest.mark.slow  # launches a run
def test_a_one_process_run_compiles_nothing(tmp_path: Path) -> None:
    """In a fresh extension folder, a plain ZeRO-0 run builds no op (DeepSpeed's shared-memory
    all-reduce served only its tensor-parallel inference layers)."""
    from conftest import launch

    extensions = tmp_path / "torch_extensions"
    run = launch(
        [f"model.name_or_path={TINY_MODEL}", "task=sft", "deepspeed=z0", "train.max_steps=1",
         "data.max_length=64", "data.max_eval_samples=4", "checkpoint.save_final=false"],
        tmp_path / "run", extra_env={"TORCH_EXTENSIONS_DIR": str(extensions)},
    ).check()  # fmt: skip
    assert "deepspeed_shm_comm" not in run.output
    assert not extensions.exists() or not any(extensions.iterdir()), list(extensions.iterdir())
