"""Online RL end to end: the real entry point on the tiny random Llama (CPU fp32, seed 42) with
the built-in arithmetic prompts.

The random model never answers a question right, so the exact-answer reward would be 0 for
every completion (every advantage 0, nothing to compare). The runs here reward with the
built-in `length_penalty` (−0.001 per character): sampled completions differ in length, so
rewards and advantages vary within each group.

How 2 ranks can give the losses of 1 rank with sampling: completion j of a prompt in round k is
drawn from its own generator, seeded by (train.seed, k, the prompt's row, j) (Gumbel-max over
the processed logits, `training/rollout.py`), so the completions do not depend on which rank or
batch generates them; the same weights give the same completions on 1 rank and on 2, and after
a resume. Nothing is patched for the test: this is how every run samples. (Equal up to float
noise: another batch composition pads differently, and a near tie of two tokens could flip;
the tiny model's logits are far from ties in these steps.)
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from conftest import (
    COMMON,
    RunResult,
    assert_script_trained,
    finish,
    launch,
    run_inline,
    run_script,
    script_overrides,
    spawn,
)

from align_anything.training import checkpoints

# End to end. Runs compared by their numbers are in-process (conftest.run_inline); the 2-rank
# runs (one through scripts/grpo.sh) and the SIGTERM of a process are launched.
pytestmark = pytest.mark.slow

STEPS = 4
DATA = ["data.path=arith-prompts", "data.eval_path=arith-prompts-eval"]
LENGTH = "align_anything.rewards:length_penalty"
GRPO_ARGS = [
    "task=grpo", *COMMON, *DATA, f"train.max_steps={STEPS}", "train.learning_rate=1e-3",
    "grpo.num_generations=4", "grpo.max_completion_length=8", "grpo.eval_samples=4",
    "grpo.beta=0.1", f"reward.functions=[{LENGTH}]", "checkpoint.save_final=false",
]  # fmt: skip
RLOO_ARGS = [
    "task=rloo", *COMMON, *DATA, f"train.max_steps={STEPS}", "train.learning_rate=1e-3",
    "rloo.num_generations=4", "rloo.max_completion_length=8", "rloo.eval_samples=4",
    "rloo.num_iterations=2", f"reward.functions=[{LENGTH}]", "checkpoint.save_final=false",
]  # fmt: skip
# Frozen per-step losses of the 1-rank runs below (torch 2.13 CPU / deepspeed 0.19.8 /
# transformers 5.24). GRPO's step 1 is the k3 KL (0: policy = reference) plus −A·ρ summed over
# tokens with advantages of mean 0 per group: ~0. Change them only for an intended change of
# the model, data, data order, sampling or loss, and say so in the commit.
GRPO_FROZEN = [
    -2.9802322387695312e-08, 0.0002679186873137951, 0.0005295518785715103, 0.0007864572107791901,
]  # fmt: skip
RLOO_FROZEN = [0.0, -0.0010120858205482364, 9.313225746154785e-10, -0.002405718434602022]
# The rewards of each step's sampled completions: after step 1 they come from the updated
# weights, so they check sampling, the advantages' gradient and the update together.
GRPO_FROZEN_REWARDS = [-0.05324999988079071, -0.05087499972432852, -0.05525000020861626,
                       -0.048750000074505806]  # fmt: skip
RLOO_FROZEN_REWARDS = [-0.05324999988079071, -0.05324999988079071, -0.05024999938905239,
                       -0.05024999938905239]  # fmt: skip
FROZEN_RTOL = 1e-4
# 2 ranks vs 1: fp32 summation order only.
LOSS_ATOL = 1e-6


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("grpo")
    return {
        # The baseline (global batch 8 = 2 prompts x 4), checkpoints for the resume test.
        "single": run_inline(
            [
                *GRPO_ARGS,
                "deepspeed=z0",
                "train.per_device_batch_size=8",
                "checkpoint.every_steps=2",
                "checkpoint.keep_last=3",
            ],
            root / "single",
        ),  # fmt: skip
        # 2 ranks x 1 prompt each under ZeRO-3, the reference a partitioned engine; 1 held-out
        # prompt: rank 1 generates nothing while rank 0 answers (it must not wait for rank 1).
        # Through scripts/grpo.sh (NUM_GPUS=2, its default preset z3).
        "z3-2ranks": run_script(
            "grpo.sh",
            root / "z3",
            [*script_overrides(GRPO_ARGS), "train.per_device_batch_size=4", "grpo.eval_samples=1"],
            env={"NUM_GPUS": "2"},
        ),  # fmt: skip
        # 1 rank, 2 micro-batches of 4 (accumulation), every speed switch off (the others run
        # each prompt's completions as one shared-prompt row).
        "accum-plain": run_inline(
            [
                *GRPO_ARGS,
                "deepspeed=z2",
                "train.per_device_batch_size=4",
                "train.gradient_accumulation_steps=2",
                "speed.completion_only_logits=false",
                "speed.tied_grads_in_place=false",
                "speed.share_prefix=false",
                "grpo.eval_samples=1",
            ],
            root / "accum",
        ),  # fmt: skip
    }


def _same_steps(a: RunResult, b: RunResult, *, atol: float = LOSS_ATOL) -> None:
    for x, y in zip(a.train_steps(), b.train_steps(), strict=True):
        # Same completions: the rewards and lengths are exactly equal.
        assert (
            x["reward"] == y["reward"]
            and x["completions/mean_length"] == y["completions/mean_length"]
        )
        assert x["loss"] == pytest.approx(y["loss"], abs=atol)
        assert x["kl"] == pytest.approx(y["kl"], abs=atol)


def test_grpo_trains_against_frozen_losses(grpo_runs: dict[str, RunResult]) -> None:
    run = grpo_runs["single"].check()
    steps = run.train_steps()
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/length_penalty/mean",
                "rewards/length_penalty/std", "completions/mean_length",
                "completions/max_length", "completions/clipped_ratio", "advantages/std",
                "clip_ratio/region_mean", "kl", "generation/tokens_per_second",
                "train/tokens_per_second"):  # fmt: skip
        assert all(key in m for m in steps), key
    assert steps[0]["kl"] == 0.0 and steps[-1]["kl"] > 0  # policy = reference at step 1
    assert steps[0]["reward_std"] > 0  # lengths differ: the advantages are not all 0
    for phase in ("before", "after"):
        line = run.eval(phase)
        assert {"eval/reward", "eval/rewards/length_penalty", "eval/completion_length",
                "eval/generation_check"} <= set(line)  # fmt: skip
    assert run.summary_line("reference").startswith("frozen copy")
    assert "prompt + completions" in run.summary_line("rows")
    assert run.losses() == pytest.approx(GRPO_FROZEN, rel=FROZEN_RTOL, abs=1e-7)
    assert [m["reward"] for m in steps] == pytest.approx(GRPO_FROZEN_REWARDS, abs=1e-7)


def test_grpo_two_ranks_zero3_and_accumulation_equal_one_rank(
    grpo_runs: dict[str, RunResult],
) -> None:
    single = grpo_runs["single"].check()
    z3 = grpo_runs["z3-2ranks"].check()
    assert z3.zero_stage() == 3
    assert "gathered once per round" in z3.summary_line("generator")
    _same_steps(z3, single)
    _same_steps(grpo_runs["accum-plain"].check(), single)
    # Held-out greedy answers: the same prompts' mean reward whatever the split.
    assert z3.eval("after")["eval/reward"] == pytest.approx(
        grpo_runs["accum-plain"].eval("after")["eval/reward"], abs=1e-6
    )


def test_grpo_resume_generates_the_same_completions(
    grpo_runs: dict[str, RunResult], tmp_path: Path
) -> None:
    single = grpo_runs["single"].check()
    step2 = single.output_dir / "checkpoints" / "step-2"
    resumed = run_inline(
        [*GRPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8", f"resume={step2}"],
        tmp_path / "resumed",
    ).check()
    got = resumed.train_steps()
    assert [m["step"] for m in got] == [3, 4]
    for a, b in zip(got, single.train_steps()[2:], strict=True):
        assert a["reward"] == b["reward"]
        assert a["completions/mean_length"] == b["completions/mean_length"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)


def test_grpo_sigterm_writes_a_checkpoint_and_resume_continues_the_same_run(
    grpo_runs: dict[str, RunResult], tmp_path: Path
) -> None:
    """SIGTERM after the first logged step: the step finishes, a checkpoint is written, exit
    143; resume=auto then generates the same completions as the uninterrupted run."""
    from test_fault_tolerance import _wait_for_step

    single = grpo_runs["single"].check()
    args = [*GRPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8"]
    run_dir = tmp_path / "run"
    proc = spawn(args, run_dir)
    _wait_for_step(proc, run_dir, 1)
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, run_dir)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.output[-3000:]
    at = max(m["step"] for m in stopped.train_steps())
    assert at < STEPS and checkpoints.verify(run_dir / "checkpoints" / f"step-{at}") is None
    resumed = run_inline([*args, "resume=auto"], run_dir).check()
    steps = [m for m in resumed.metrics if "phase" not in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for a, b in zip(steps, single.train_steps(), strict=True):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)


def test_rloo_trains_against_frozen_losses(tmp_path: Path) -> None:
    run = run_inline([*RLOO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8"],
                     tmp_path / "rloo").check()  # fmt: skip
    steps = run.train_steps()
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    # beta 0.05 (the default): the KL penalty is in the reward; mu = 2 reuses each round once.
    assert steps[0]["kl"] == 0.0
    assert steps[0]["reward"] == steps[1]["reward"] and steps[2]["reward"] == steps[3]["reward"]
    assert steps[1]["clip_ratio/region_mean"] >= 0.0
    assert run.losses() == pytest.approx(RLOO_FROZEN, rel=FROZEN_RTOL, abs=1e-7)
    assert [m["reward"] for m in steps] == pytest.approx(RLOO_FROZEN_REWARDS, abs=1e-7)


# ---------------------------------------------------------------------------- rewards


def test_a_failing_reward_function_stops_before_the_update_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test's reward function raises from its 4th call on (eval before = 1, steps 1-2 =
    2-3, step 3 = 4): the run stops in step 3 with one message naming the function, the data
    row and the completion; step-2's checkpoint (written before) is intact. (In-process: the
    function counts its calls in this process, from 0.)"""
    import rl_test_rewards

    monkeypatch.setattr(rl_test_rewards, "_calls", 0)
    out = tmp_path / "run"
    run = run_inline(
        [*GRPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8",
         "reward.functions=[rl_test_rewards:fails_from_fourth_call]", "checkpoint.every_steps=2"],
        out,
    )  # fmt: skip
    assert run.returncode == 2, run.output[-3000:]
    assert "error: reward in step 3 failed, before that step's optimizer update" in run.output
    assert "fails_from_fourth_call" in run.output and "line " in run.output
    assert "Traceback" not in run.output
    assert [m["step"] for m in run.train_steps()] == [1, 2]
    good = out / "checkpoints" / "step-2"
    assert checkpoints.verify(good) is None
    assert f"{good}, is intact" in run.output
    assert not (out / "checkpoints" / "step-3").exists()


@pytest.fixture(scope="module")
def lora_rm_run(rm_single: RunResult, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """2 ranks under torchrun (the other 2-rank runs here use the deepspeed launcher), ZeRO-3,
    2 steps: LoRA on the policy, whose reference is then the adapter-disabled policy, and a
    reward model trained by task=rm (conftest.rm_single) as the only reward. The two tests
    below read this one run."""
    rm = rm_single.check().output_dir / "final"
    return launch(
        [*GRPO_ARGS, "deepspeed=z3", "train.per_device_batch_size=4", "train.max_steps=2",
         "model.lora.enabled=true", "checkpoint.save_final=true", "reward.functions=[]",
         f"reward.model={rm}"],
        tmp_path_factory.mktemp("lora-rm") / "run",
        launcher="torchrun",
        nproc=2,
    )  # fmt: skip


def test_a_reward_model_trained_by_task_rm_as_the_reward(lora_rm_run: RunResult) -> None:
    run = lora_rm_run.check()
    assert "partitioned ZeRO-3 inference engine" in run.summary_line("reward model")
    steps = run.train_steps()
    assert all(m["reward"] == m["rewards/reward_model/mean"] for m in steps)
    assert steps[0]["reward_std"] > 0  # a trained head tells completions apart
    after = run.eval("after")
    assert after["eval/reward"] == after["eval/rewards/reward_model"]


# ---------------------------------------------------------------------------- LoRA


def test_grpo_lora_under_zero3_uses_the_adapter_disabled_policy_as_reference(
    lora_rm_run: RunResult,
) -> None:
    run = lora_rm_run.check()
    assert "adapters disabled" in run.summary_line("reference")
    steps = run.train_steps()
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0
    assert (run.output_dir / "final" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------------- image prompts


def _image_prompts(folder: Path, *, text_every: int) -> list[str]:
    """Synthetic shapes (`data.synthetic`) as prompt files: the question, its image and the
    answer as a field."""
    from align_anything.data.synthetic import make_dataset

    make_dataset("shapes", folder, rows=24, text_every=text_every)
    for name in ("pref", "pref_eval"):
        rows = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
        keep = ("images", "prompt", "answer")
        (folder / f"{name}_prompts.jsonl").write_text(
            "".join(json.dumps({k: r[k] for k in keep if k in r}) + "\n" for r in rows)
        )
    return [f"data.path={folder / 'pref_prompts.jsonl'}",
            f"data.eval_path={folder / 'pref_eval_prompts.jsonl'}"]  # fmt: skip


VLM_ARGS = [
    "task=grpo", *COMMON, "model.name_or_path=tiny-random-llava", "train.max_steps=3",
    "train.learning_rate=1e-3", "grpo.num_generations=2", "grpo.max_completion_length=8",
    "grpo.eval_samples=3", "grpo.beta=0.1", f"reward.functions=[{LENGTH}]",
    "checkpoint.save_final=false",
]  # fmt: skip


def test_grpo_with_image_prompts_on_the_tiny_vlm(tmp_path: Path) -> None:
    data = _image_prompts(tmp_path / "shapes", text_every=0)
    run = run_inline([*VLM_ARGS, *data, "deepspeed=z0", "train.per_device_batch_size=4"],
                     tmp_path / "vlm").check()  # fmt: skip
    assert [m["step"] for m in run.train_steps()] == [1, 2, 3]
    assert run.train_steps()[-1]["kl"] > 0


def test_mixed_image_and_text_prompts_under_zero3_on_two_ranks_do_not_hang(
    tmp_path: Path,
) -> None:
    """Every other prompt has no image: in some steps one rank's micro-batch holds no image
    while the other's does (its dummy row runs the vision tower), and the ranks generate
    completions of different lengths. A hang fails the test at the launch timeout; the losses
    equal one rank's."""
    data = _image_prompts(tmp_path / "mixed", text_every=2)
    two = launch([*VLM_ARGS, *data, "deepspeed=z3", "train.per_device_batch_size=2"],
                 tmp_path / "two", launcher="deepspeed", nproc=2, timeout_s=180).check()  # fmt: skip
    one = run_inline([*VLM_ARGS, *data, "deepspeed=z0", "train.per_device_batch_size=4"],
                     tmp_path / "one").check()  # fmt: skip
    _same_steps(two, one, atol=1e-5)


# ---------------------------------------------------------------------------- issue 24, 3/4/21


def test_a_step_whose_completions_are_all_masked_still_logs_its_round(tmp_path: Path) -> None:
    """Every completion truncated and masked (max_completion_length=1): no loss items, but the
    round's figures are what happened (every completion clipped, the rewards), not zeros."""
    args = [a for a in GRPO_ARGS if not a.startswith("grpo.max_completion_length")]
    run = run_inline(
        [*args, "deepspeed=z0", "train.per_device_batch_size=8", "train.max_steps=1",
         "grpo.max_completion_length=1", "grpo.mask_truncated_completions=true"],
        tmp_path / "masked",
    ).check()  # fmt: skip
    step = run.train_steps()[0]
    assert step["completions/clipped_ratio"] == 1.0
    assert step["completions/mean_length"] == 1.0
    assert step["reward"] != 0.0  # length_penalty of a 1-token completion


def test_a_step_without_any_reward_opinion_says_so(tmp_path: Path) -> None:
    run = run_inline(
        [*GRPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8", "train.max_steps=1",
         "reward.functions=[rl_test_rewards:no_opinion]", "grpo.eval_samples=0"],
        tmp_path / "none",
    ).check()  # fmt: skip
    assert "warning: step 1: no reward had an opinion on any of its 8 completions" in run.output
    step = run.train_steps()[0]
    assert step["frac_reward_none"] == 1.0
    assert "reward" not in step and "advantages/mean" not in step
    # Evaluation was switched off: the closing summary says that, not that rows were dropped.
    assert "no held-out metrics: grpo.eval_samples=0 switches the held-out evaluation off" in (
        run.output
    )
    assert "was dropped" not in run.output


def test_script_trains_on_two_cpu_ranks(grpo_runs: dict[str, RunResult]) -> None:
    """test_scripts.py's check of scripts/grpo.sh, on its run above."""
    assert_script_trained(grpo_runs["z3-2ranks"], stage=3, steps=STEPS)
