"""Online RL of text-to-image pipelines end to end, through the real entry point on the tiny
random pipelines (32 px, a few sampler steps, a few steps; tests/test_image_rl.py holds the
samplers and losses to hand-derived numbers):

- DanceGRPO with LoRA under ZeRO-3 on 2 ranks, with classifier-free guidance, a KL reference
  (the adapters disabled) and rounds of 2 steps: the start-up summary, the round's figures
  and grids, the rewards' fields, and every step equal to 1 rank's with gradient
  accumulation; a 1-rank run killed (SIGKILL) inside a round and resumed continues it exactly;
- every preset with and without LoRA, each run also checking a task: Flow-GRPO's frozen-copy
  reference (z0), DiffusionNFT's old policy with LoRA (z0) and whole (z2, z3), Flow-GRPO with
  LoRA (z2), DanceGRPO under z3_offload with and without LoRA; the first step's ratio is 1 and
  nothing is clipped, the final folder loads and samples, held-out figures before and after;
- a reward returning the wrong count stops every rank before the first update, with one
  message naming the function, the row and the image (the other bad inputs, refused before any
  compute, are in tests/test_image_rl.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT, RunResult, _kill_group, finish, launch, spawn

pytestmark = pytest.mark.slow

ENV = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
PROMPTS = [
    "a red circle", "a blue square", "a green cross", "a yellow triangle", "a cyan circle",
    "a magenta square", "a red cross", "a blue triangle",
]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompts with a `tag` field for the rewards (train), and two held out."""
    root = tmp_path_factory.mktemp("prompts")
    with (root / "train.jsonl").open("w") as out:
        for index, prompt in enumerate(PROMPTS):
            out.write(json.dumps({"prompt": prompt, "tag": index}) + "\n")
    with (root / "eval.jsonl").open("w") as out:
        for index, prompt in enumerate(["a green circle", "a red square"]):
            out.write(json.dumps({"prompt": prompt, "tag": 10 + index}) + "\n")
    return root


def common(data: Path, task: str, model: str) -> list[str]:
    return [
        f"task={task}", f"model.name_or_path={model}", "train.precision=fp32", "train.seed=5",
        f"data.path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}",
        "reward.functions=[image_rl_test_rewards:red_mean]", "train.learning_rate=1e-3",
        "train.max_steps=2", "train.lr_scheduler=constant", "train.warmup_ratio=0",
        "logging.sample_prompts=[a_red_circle]", "logging.sample_seeds=[0]",
        f"{task}.num_generations=2", f"{task}.rollout_steps=3", f"{task}.check_samples=0",
        f"{task}.sample_steps=1", f"{task}.eval_samples=0",
    ]  # fmt: skip


def run(args: list[str], out: Path, **kwargs: Any) -> RunResult:
    return launch(args, out, extra_env=ENV, **kwargs).check()


def by_step(result: RunResult) -> dict[int, dict[str, Any]]:
    return {m["step"]: m for m in result.train_steps()}


# ---------------------------------------------------------------------------- 2 ranks = 1 rank


def dance_args(data: Path) -> list[str]:
    """DanceGRPO on tiny-random-sd with LoRA under ZeRO-3: CFG, a KL reference, rounds of 2
    steps (mu = 2), 4 steps, a checkpoint every step, a grid and a table every round."""
    return [
        *common(data, "dance_grpo", "tiny-random-sd"), "deepspeed=z3", "model.lora.enabled=true",
        "model.lora.r=4", "dance_grpo.guidance_scale=2.0", "dance_grpo.beta=0.1",
        "dance_grpo.num_iterations=2", "dance_grpo.epsilon=0.2", "train.max_steps=4",
        "checkpoint.every_steps=1", "logging.completions_every=1", "dance_grpo.eval_samples=2",
        "train.global_batch_size=4", "train.per_device_batch_size=2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def dance_two_ranks(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(dance_args(data), tmp_path_factory.mktemp("dance") / "two",
               launcher="deepspeed", nproc=2)  # fmt: skip


@pytest.fixture(scope="module")
def dance_one_rank(data: Path, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return run(dance_args(data), tmp_path_factory.mktemp("dance") / "one")


def test_two_ranks_log_the_steps_of_one_rank(
    dance_two_ranks: RunResult, dance_one_rank: RunResult
) -> None:
    two, one = by_step(dance_two_ranks), by_step(dance_one_rank)
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in one:
        # the same images and rewards exactly; the losses to the sums' order
        for key in ("reward", "reward_std", "advantages/std", "rewards/red_mean/mean"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-6), (step, key)
        for key in ("loss", "kl", "ratio/mean", "grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-7), (step, key)
    assert dance_two_ranks.zero_stage() == dance_one_rank.zero_stage() == 3


def test_the_summary_round_figures_grids_and_fields(dance_two_ranks: RunResult) -> None:
    result = dance_two_ranks
    assert "ddim sampler, 3 steps, noise 1, guidance 2" in result.summary_line("rollouts")
    assert "2 images per prompt, 2 prompts per round, served over 2 steps" in (
        result.summary_line("rollouts")
    )
    assert "adapters disabled" in result.summary_line("reference")
    assert "the G images of a prompt from one initial noise" in result.summary_line("noise")
    steps = by_step(result)
    # a round serves 2 steps: its figures are logged with both
    assert steps[1]["reward"] == steps[2]["reward"] and steps[3]["reward"] != steps[1]["reward"]
    # the first step of a round trains the policy that sampled it: ratio 1, nothing clipped
    assert steps[1]["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert steps[1]["clip_ratio"] == 0.0 and steps[1]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert steps[2]["kl"] > 0 and 0 <= steps[1]["frac_reward_zero_std"] <= 1
    # red_mean adds a thousandth of each prompt's `tag`: rewards above the red channel alone
    assert all(0 <= m["reward"] <= 1.01 for m in steps.values())
    grids = sorted(p.name for p in (result.output_dir / "samples").glob("round-*.png"))
    assert grids == ["round-000000.png", "round-000001.png"]
    assert "step 1: completions" in result.output and "image 32x32" in result.output
    for phase in ("before", "after"):
        assert math.isfinite(result.eval(phase)["eval/reward"])
    # checkpoint 3 falls inside round 1 (checkpoint.keep_last pruned 1): it holds the round
    folder = result.output_dir / "checkpoints"
    rollout = json.loads((folder / "step-3" / "rollout.json").read_text())
    assert rollout["round"] == 1 and rollout["world_size"] == 2
    assert (folder / "step-3" / "rollout.safetensors").is_file()
    assert not (folder / "step-4" / "rollout.json").exists()


def test_a_run_killed_inside_a_round_resumes_exactly(
    data: Path, dance_one_rank: RunResult, tmp_path: Path
) -> None:
    """SIGKILL once checkpoint 3 (inside round 1: mu = 2) is complete; resume=auto continues
    the saved round (not a new round sampled by the resumed weights) and logs the steps of the
    uninterrupted run."""
    out = tmp_path / "killed"
    args = [*dance_args(data), "checkpoint.every_steps=3"]  # checkpoints change no number
    proc = spawn(args, out, extra_env=ENV)
    manifest = out / "checkpoints" / "step-3" / "manifest.json"
    deadline = time.monotonic() + 180
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    _kill_group(proc)
    killed = finish(proc, out)
    assert killed.returncode == -signal.SIGKILL, killed.output[-3000:]
    assert (out / "checkpoints" / "step-3" / "rollout.safetensors").is_file()
    resumed = run([*args, "resume=auto"], out)
    assert re.search(r"resumed\s+from \S+step-3 at step 3", resumed.output), resumed.output[-3000:]
    logged = {m["step"]: m for m in resumed.metrics if "phase" not in m}
    want = by_step(dance_one_rank)
    assert sorted(logged) == [1, 2, 3, 4]
    for step, line in want.items():
        for key in ("loss", "reward", "ratio/mean", "kl", "grad_norm"):
            assert logged[step][key] == pytest.approx(line[key], rel=1e-6, abs=1e-9), (step, key)


# ---------------------------------------------------------------------------- every preset

# (preset, LoRA) -> the task it runs and what else it checks. ZeRO-3 with LoRA is the DanceGRPO
# runs above (1 and 2 ranks).
PRESET_RUNS: dict[tuple[str, bool], tuple[str, str, list[str]]] = {
    ("z0", False): ("flow_grpo", "tiny-random-sd3", ["flow_grpo.beta=0.05"]),
    ("z0", True): ("diffusion_nft", "tiny-random-sd3", ["diffusion_nft.old_decay=0.5"]),
    ("z2", False): ("diffusion_nft", "tiny-random-sd3",
                    ["diffusion_nft.old_decay=0.5", "diffusion_nft.sample_noise=0.7"]),
    ("z2", True): ("flow_grpo", "tiny-random-sd3", ["flow_grpo.beta=0.05"]),
    ("z3", False): ("diffusion_nft", "tiny-random-sd", ["diffusion_nft.old_decay=0.5"]),
    ("z3_offload", False): ("dance_grpo", "tiny-random-sd", ["dance_grpo.shared_noise=false"]),
    ("z3_offload", True): ("dance_grpo", "tiny-random-sd", []),
}  # fmt: skip


@pytest.fixture(
    scope="module",
    params=list(PRESET_RUNS),
    ids=lambda key: f"{key[0]}-{'lora' if key[1] else 'full'}",
)
def preset_run(request: pytest.FixtureRequest, data: Path,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bool, str, RunResult]:  # fmt: skip
    preset, lora = request.param
    task, model, extra = PRESET_RUNS[request.param]
    args = [*common(data, task, model), f"deepspeed={preset}", *extra,
            "train.per_device_batch_size=4", f"model.lora.enabled={str(lora).lower()}",
            "model.lora.r=4"]  # fmt: skip
    out = tmp_path_factory.mktemp(f"{preset}-{lora}") / "run"
    # z3_offload: the first run in an environment builds DeepSpeed's CPU Adam (minutes)
    return preset, lora, task, run(args, out, timeout_s=900 if "offload" in preset else 240)


def test_every_preset_with_and_without_lora_trains(
    preset_run: tuple[str, bool, str, RunResult],
) -> None:
    preset, lora, task, result = preset_run
    assert result.zero_stage() == {"z0": 0, "z2": 2, "z3": 3, "z3_offload": 3}[preset]
    assert ("LoRA adapters" in result.summary_line("parts")) == lora
    steps = by_step(result)
    assert sorted(steps) == [1, 2]
    for line in steps.values():
        assert math.isfinite(line["loss"]) and line["grad_norm"] > 0
        assert 0 <= line["reward"] <= 1.01 and line["samples_per_second"] > 0
    if task == "diffusion_nft":
        # the old policy is the trained one at the start, an average of it after a step
        assert steps[1]["nft/old_deviation"] == pytest.approx(0.0, abs=1e-12)
        assert steps[2]["nft/old_deviation"] > 0
        assert "decay 0.5" in result.summary_line("old policy")
        assert (result.output_dir / "final").is_dir()
    else:
        assert steps[1]["ratio/mean"] == 1.0 and steps[1]["clip_ratio"] == 0.0
        reference = result.summary_line("reference")
        if task == "flow_grpo":
            assert ("adapters disabled" if lora else "frozen copy") in reference
            assert steps[2]["kl"] > 0
        else:
            assert "none" in reference
    # the sample grids before and after training (no held-out check in these short runs)
    grids = sorted(p.name for p in (result.output_dir / "samples").glob("step-*.png"))
    assert grids == ["step-000000.png", "step-000002.png"]


def test_the_final_pipeline_loads_and_samples(
    preset_run: tuple[str, bool, str, RunResult],
) -> None:
    preset, lora, _, result = preset_run
    if (preset, lora) not in (("z0", False), ("z2", True)):
        pytest.skip("checked on one full and one LoRA run")
    import torch
    from diffusers import DiffusionPipeline

    if lora:
        pipe = DiffusionPipeline.from_pretrained(str(_builtin("tiny-random-sd3")))
        pipe.load_lora_weights(str(result.output_dir / "final"))
    else:
        pipe = DiffusionPipeline.from_pretrained(str(result.output_dir / "final"))
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32,
                 generator=torch.Generator().manual_seed(0), output_type="np",
                 max_sequence_length=32).images[0]  # fmt: skip
    assert image.shape == (32, 32, 3)


def _builtin(name: str) -> Path:
    from align_anything.families.diffusion.pipeline import resolve_pipeline_path

    return resolve_pipeline_path(name)


# ---------------------------------------------------------------------------- bad input


def test_a_reward_returning_the_wrong_count_stops_before_the_first_update(
    data: Path, tmp_path: Path
) -> None:
    result = launch(
        [*common(data, "dance_grpo", "tiny-random-sd"), "deepspeed=z0",
         "train.per_device_batch_size=4",
         "reward.functions=[image_rl_test_rewards:wrong_count]"],
        tmp_path / "run", extra_env=ENV,
    )  # fmt: skip
    assert result.returncode == 2, result.output[-3000:]
    assert "reward in step 1 failed, before that step's optimizer update" in result.output
    assert re.search(r"'wrong_count' on line \d+ \(image 32x32\)", result.output)
    assert "returned 3 values for 4 images" in result.output
    assert result.output.count("error:") == 1
    assert not [m for m in result.metrics if "phase" not in m]  # no step was logged
