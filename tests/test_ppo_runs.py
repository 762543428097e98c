"""task=ppo end to end: the real entry point on the tiny random Llama (CPU fp32, seed 42) with
the built-in arithmetic prompts, rewarded by the built-in `length_penalty` (as
tests/test_grpo_runs.py explains: the random model never answers right, and lengths differ).

The PPO runs here serve each round over 2 passes x 2 mini-batches (4 optimizer steps, the last
three off-policy), with a critic from the policy's weights (a new value head) and a KL penalty
to a frozen reference, so each run has two trained engines, a reference and the shuffled
mini-batches. Also here, because they share PPO's round machinery: a GRPO run resumed inside a
round (`num_iterations` 2, issue #24 case 2) and remote rewards wired into an online run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import rank_hash_seeds
from conftest import COMMON, RunResult, _kill_group, finish, run_inline, spawn
from conftest import launch as conftest_launch

from align_anything.rewards import length_penalty
from align_anything.training import checkpoints

# Slow (end-to-end). Runs compared by their numbers are in-process (conftest.run_inline); the
# 2-rank runs and the SIGTERM of a process are launched (minutes each on 2 shared cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def launch(*args, **kwargs) -> RunResult:
    """conftest's launch with a longer limit: a PPO run holds two trained engines, a reference
    and the rounds' passes, several times a GRPO run's work (minutes on 2 shared cores)."""
    kwargs.setdefault("timeout_s", 900)
    return conftest_launch(*args, **kwargs)


STEPS = 6  # a round of 4 steps, then half of the next
DATA = ["data.path=arith-prompts", "data.eval_path=arith-prompts-eval"]
LENGTH = "align_anything.rewards:length_penalty"
PPO_ARGS = [
    "task=ppo", *COMMON, *DATA, f"train.max_steps={STEPS}", "train.learning_rate=1e-3",
    "ppo.num_generations=4", "ppo.max_completion_length=8", "ppo.eval_samples=2",
    "ppo.num_ppo_epochs=2", "ppo.num_mini_batches=2", "ppo.critic_learning_rate=1e-3",
    # Pinned here, not left to configs/task/ppo.yaml, whose defaults follow the main job.
    "ppo.critic_init=policy", "ppo.kl_coef=0.05", "ppo.value_clip=0.2", "ppo.reward_clip=10.0",
    "ppo.gamma=1.0", "ppo.lam=0.95", "ppo.temperature=1.0", "ppo.epsilon=0.2",
    "ppo.critic_lr_scheduler=constant", "train.lr_scheduler=constant",
    f"reward.functions=[{LENGTH}]", "checkpoint.save_final=false",
]  # fmt: skip
# Frozen per-step losses of the 1-rank run (torch 2.13 CPU / deepspeed 0.19.8 / transformers
# 5.24): the policy loss and the critic's value loss. Step 1 is on-policy (ratio 1: the
# whitened advantages average to 0 over the round, but not over one mini-batch). Change them
# only for an intended change of the model, data, sampling or loss, and say so in the commit.
PPO_FROZEN = [
    -0.02996573969721794, 0.03247027099132538, -0.19265078008174896, -0.042164839804172516,
    -0.133777916431427, 0.134177103638649,
]  # fmt: skip
VALUE_FROZEN = [
    0.019050560891628265, 0.0652880147099495, 0.0043350700289011, 0.013506237417459488,
    0.0020531052723526955, 0.005589792039245367,
]  # fmt: skip
FROZEN_RTOL = 1e-4
# 2 ranks vs 1, accumulation vs none: fp32 summation order only (relative for the explained
# variance, whose scale is that of Var[R − V] / Var[R]).
ATOL = 1e-5
RTOL = 1e-4


# Ranks whose string hashes disagree (tests/rank_hash_seeds.py): PYTHONHASHSEED 0 and 1 iterate
# the set {"policy", "critic"} in opposite orders. Issue #23: the loop stepped PPO's two engines
# in a set's order, so in the 2-rank ZeRO-3 runs whose random seeds disagreed (about one in two)
# rank 0 stepped the policy while rank 1 stepped the critic, and gloo hung for 600 s. Run with
# these seeds, every such run would.
RANK_HASH_SEEDS = ("0", "1")
NAMES_ORDER = 'names = set(); names.add("policy"); names.add("critic"); print(list(names))'


def rank_hash_seed_env() -> dict[str, str]:
    """The environment of a 2-rank run through `rank_hash_seeds` (ranks that hash strings
    differently), with gloo's collective check on (TORCH_DISTRIBUTED_DEBUG=DETAIL: ranks that
    issue different collectives fail at once with both stacks instead of hanging until gloo's
    timeout). Checks first that the two seeds do order the engines' names differently."""
    orders = [
        subprocess.run(
            [sys.executable, "-c", NAMES_ORDER], env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        for seed in RANK_HASH_SEEDS
    ]  # fmt: skip
    assert orders[0] != orders[1], f"PYTHONHASHSEED {RANK_HASH_SEEDS} agree ({orders}): pick others"
    path = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        rank_hash_seeds.VARIABLE: ",".join(RANK_HASH_SEEDS),
        "PYTHONPATH": os.pathsep.join(path),
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    }


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    """The 2-rank run is launched first and awaited last; the 1-rank runs go in-process
    meanwhile."""
    root = tmp_path_factory.mktemp("ppo")
    # 2 ranks under ZeRO-3 (actor, critic, reference all partitioned), a checkpoint inside the
    # first round for the resume across stages and world sizes below.
    z3 = spawn(
        [*PPO_ARGS, "deepspeed=z3", "train.per_device_batch_size=4",
         "checkpoint.every_steps=2", "checkpoint.keep_last=5"],
        root / "z3-2ranks", launcher="deepspeed", nproc=2, module="rank_hash_seeds",
        extra_env=rank_hash_seed_env(),
    )  # fmt: skip
    try:
        runs = {
            # Global batch 8 completions = 2 prompts x 4; a round = 2 mini-batches = 4 prompts.
            "single": run_inline(
                [*PPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8",
                 "checkpoint.every_steps=1", "checkpoint.keep_last=10"],
                root / "single",
            ),
            # 1 rank, 2 micro-batches of 4, every speed switch off.
            "accum-plain": run_inline(
                [*PPO_ARGS, "deepspeed=z2", "train.per_device_batch_size=4",
                 "train.gradient_accumulation_steps=2", "speed.completion_only_logits=false",
                 "speed.tied_grads_in_place=false", "speed.share_prefix=false"],
                root / "accum-plain",
            ),
        }  # fmt: skip
    except BaseException:
        _kill_group(z3)
        z3.communicate()
        raise
    runs["z3-2ranks"] = finish(z3, root / "z3-2ranks", timeout_s=1500)
    return runs


def _same_steps(a: RunResult, b: RunResult, *, atol: float = ATOL, exact: bool = False) -> None:
    steps_a, steps_b = a.train_steps(), b.train_steps()
    assert [m["step"] for m in steps_a] == [m["step"] for m in steps_b]
    for x, y in zip(steps_a, steps_b, strict=True):
        # The same completions: rewards and lengths exactly equal.
        assert x["reward"] == y["reward"], x["step"]
        assert x["completions/mean_length"] == y["completions/mean_length"]
        for key in ("loss", "value_loss", "kl", "advantages/std", "explained_variance"):
            if exact:
                assert x[key] == y[key], (x["step"], key)
            else:
                assert x[key] == pytest.approx(y[key], rel=RTOL, abs=atol), (x["step"], key)


def test_ppo_trains_two_engines_against_frozen_losses(ppo_runs: dict[str, RunResult]) -> None:
    run = ppo_runs["single"].check()
    steps = run.train_steps()
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for key in (
        "reward",
        "reward_with_kl",
        "kl",
        "loss",
        "policy_loss",
        "value_loss",
        "value_clip_fraction",
        "clip_ratio",
        "approx_kl",
        "explained_variance",
        "returns/mean",
        "returns/std",
        "advantages/mean",
        "advantages/std",
        "values/mean",
        "entropy",
        "completions/mean_length",
        "grad_norm",
        "grad_norm/critic",
        "learning_rate/critic",
        "rewards/length_penalty/mean",
    ):
        assert all(key in m for m in steps), key  # fmt: skip
    assert steps[0]["learning_rate/critic"] == pytest.approx(1e-3)
    # One round per 4 steps: its figures repeat, the next round's differ.
    assert steps[0]["reward"] == steps[3]["reward"] != steps[4]["reward"]
    assert steps[0]["kl"] == 0.0 and steps[4]["kl"] != 0.0  # policy = reference in round 1
    assert steps[0]["clip_ratio"] == 0.0 and steps[2]["clip_ratio"] > 0  # off-policy later
    assert "(policy): values at every token" in run.summary_line("critic")
    assert "2 passes x 2 mini-batches" in run.summary_line("generation")
    step1 = run.output_dir / "checkpoints" / "step-1"
    assert (step1 / "deepspeed-critic").is_dir() and (step1 / "rollout.json").is_file()
    assert not (run.output_dir / "checkpoints" / "step-4" / "rollout.json").exists()
    for phase in ("before", "after"):
        assert "eval/reward" in run.eval(phase)
    assert run.losses() == pytest.approx(PPO_FROZEN, rel=FROZEN_RTOL, abs=1e-7)
    assert [m["value_loss"] for m in steps] == pytest.approx(VALUE_FROZEN, rel=FROZEN_RTOL)


def test_ppo_two_ranks_zero3_and_accumulation_equal_one_rank(
    ppo_runs: dict[str, RunResult],
) -> None:
    single = ppo_runs["single"].check()
    z3 = ppo_runs["z3-2ranks"].check()
    assert z3.zero_stage() == 3
    assert "ZeRO stage 3" in z3.summary_line("critic")
    _same_steps(z3, single)
    _same_steps(ppo_runs["accum-plain"].check(), single)


def test_ppo_resume_inside_a_round_continues_it_exactly(
    ppo_runs: dict[str, RunResult], tmp_path: Path
) -> None:
    """From step 3's checkpoint (the round's second pass, one mini-batch left): the round comes
    from the checkpoint, both engines, both optimizers and the RNG from theirs; steps 4-6 are
    the uninterrupted run's, bit for bit."""
    single = ppo_runs["single"].check()
    step3 = single.output_dir / "checkpoints" / "step-3"
    resumed = run_inline(
        [*PPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8", f"resume={step3}"],
        tmp_path / "resumed",
    ).check()  # fmt: skip
    assert [m["step"] for m in resumed.train_steps()] == [4, 5, 6]
    expected = RunResult(0, "", single.train_steps()[3:], single.output_dir)
    _same_steps(resumed, expected, exact=True)
    for a, b in zip(resumed.train_steps(), expected.metrics, strict=True):
        assert a["grad_norm"] == b["grad_norm"] and a["grad_norm/critic"] == b["grad_norm/critic"]


def test_ppo_resume_across_world_sizes_and_the_refused_stage_change(
    ppo_runs: dict[str, RunResult], tmp_path: Path
) -> None:
    """ZeRO-3 on 2 ranks -> ZeRO-3 on 1 rank from step 2 (inside the round): both engines'
    checkpoints are converted to DeepSpeed's universal format and loaded; the steps continue as
    the 1-rank run's. ZeRO-3 -> ZeRO-2, which DeepSpeed 0.19.8's universal loader cannot do, is
    one error before any weights load."""
    z3 = ppo_runs["z3-2ranks"].check()
    step2 = z3.output_dir / "checkpoints" / "step-2"
    refused = run_inline(
        [*PPO_ARGS, "deepspeed=z2", "train.per_device_batch_size=8", f"resume={step2}"],
        tmp_path / "refused",
    )  # fmt: skip
    assert refused.returncode == 2 and "does not load a ZeRO-3 checkpoint into" in refused.output
    resumed = run_inline(
        [*PPO_ARGS, "deepspeed=z3", "train.per_device_batch_size=8", f"resume={step2}"],
        tmp_path / "universal",
    ).check()  # fmt: skip
    assert (step2 / "universal").is_dir() and (step2 / "universal-critic").is_dir()
    # Steps 3-4 finish the round the checkpoint holds, steps 5-6 are the next round, generated
    # from the converted weights: all as the 1-rank run's. (Steps 5-6 were 2% off while
    # DeepSpeed's ZeRO-3 universal load left one Adam step count shared by both parameter
    # groups of each engine: see backend/universal.unshare_step_counts.)
    steps = ppo_runs["single"].train_steps()
    _same_steps(resumed, RunResult(0, "", steps[2:], step2))


def test_ppo_sigterm_writes_a_checkpoint_and_resume_continues_the_same_run(
    ppo_runs: dict[str, RunResult], tmp_path: Path
) -> None:
    from test_fault_tolerance import _wait_for_step

    single = ppo_runs["single"].check()
    args = [*PPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8"]
    run_dir = tmp_path / "run"
    proc = spawn(args, run_dir)
    _wait_for_step(proc, run_dir, 1, timeout_s=900)
    proc.send_signal(signal.SIGTERM)
    stopped = finish(proc, run_dir, timeout_s=900)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.output[-3000:]
    at = max(m["step"] for m in stopped.train_steps())
    folder = run_dir / "checkpoints" / f"step-{at}"
    assert at < STEPS and checkpoints.verify(folder) is None
    assert (folder / "deepspeed-critic").is_dir()
    resumed = run_inline([*args, "resume=auto"], run_dir).check()
    steps = [m for m in resumed.metrics if "phase" not in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    _same_steps(RunResult(0, "", steps, run_dir), single, exact=True)


def test_ppo_lora_on_actor_and_critic_under_zero3_with_torchrun(tmp_path: Path) -> None:
    """2 ranks under torchrun; LoRA adapters on the actor and on the critic (its value head
    trained fully); the reference is the adapter-disabled policy; both exported."""
    run = launch(
        [*PPO_ARGS, "deepspeed=z3", "train.per_device_batch_size=4", "train.max_steps=2",
         "model.lora.enabled=true", "checkpoint.save_final=true"],
        tmp_path / "lora", launcher="torchrun", nproc=2, module="rank_hash_seeds",
        extra_env=rank_hash_seed_env(),
    ).check()  # fmt: skip
    assert "adapters disabled" in run.summary_line("reference")
    assert "score" in run.summary_line("critic adapters")
    assert [m["step"] for m in run.train_steps()] == [1, 2]
    assert (run.output_dir / "final" / "adapter_model.safetensors").is_file()
    assert (run.output_dir / "final-critic" / "adapter_model.safetensors").is_file()


def test_ppo_zero3_offload(tmp_path: Path) -> None:
    run = run_inline(
        [*PPO_ARGS, "deepspeed=z3_offload", "train.per_device_batch_size=8",
         "train.max_steps=2", "ppo.num_mini_batches=1", "ppo.num_ppo_epochs=1"],
        tmp_path / "offload",
    ).check()  # fmt: skip
    assert run.zero_stage() == 3
    assert all(m["value_loss"] > 0 for m in run.train_steps())


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_trains_without_a_critic(estimator: str, tmp_path: Path) -> None:
    run = run_inline(
        [*PPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8", "train.max_steps=2",
         f"ppo.advantage_estimator={estimator}", "checkpoint.every_steps=1"],
        tmp_path / estimator,
    ).check()  # fmt: skip
    assert "no critic" in run.summary_line("advantages")
    assert "  critic " not in run.output
    steps = run.train_steps()
    assert all("value_loss" not in m and "grad_norm/critic" not in m for m in steps)
    assert steps[0]["clip_ratio"] == 0.0 and steps[1]["clip_ratio"] >= 0.0
    assert not (run.output_dir / "checkpoints" / "step-1" / "deepspeed-critic").exists()


def test_critic_warmup_and_ptx(tmp_path: Path) -> None:
    """Step 1 trains the critic only (no policy loss, no policy update); from step 2 the actor's
    loss carries the ptx term on built-in SFT conversations."""
    run = run_inline(
        [*PPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=8", "train.max_steps=2",
         "ppo.critic_warmup_steps=1", "ppo.ptx_coef=0.5", "ppo.ptx_data=arith-sft"],
        tmp_path / "warmup",
    ).check()  # fmt: skip
    first, second = run.train_steps()
    assert "policy_loss" not in first and "grad_norm" not in first and "value_loss" in first
    assert second["loss"] == pytest.approx(second["policy_loss"] + 0.5 * second["ptx_loss"])
    assert second["ptx_loss"] > 1.0  # the random model's NLL on real text
    assert "arith-sft" in run.summary_line("ptx data")


# ---------------------------------------------------------------------------- the shared round

GRPO_ARGS = [
    "task=grpo", *COMMON, *DATA, "train.max_steps=4", "train.learning_rate=1e-3",
    "grpo.num_generations=4", "grpo.max_completion_length=8", "grpo.eval_samples=2",
    "grpo.num_iterations=2", "grpo.beta=0.1", "deepspeed=z0", "train.per_device_batch_size=8",
    "checkpoint.save_final=false",
]  # fmt: skip


def test_grpo_resume_inside_a_round_is_exact(tmp_path: Path) -> None:
    """Issue #24 case 2: μ = 2, resumed from step 1's checkpoint (inside round 1): step 2
    trains on round 1 again (the checkpoint holds it), not on a round generated anew from the
    updated weights (which would have ratio 1 and clip nothing)."""
    whole = run_inline([*GRPO_ARGS, f"reward.functions=[{LENGTH}]", "checkpoint.every_steps=1",
                        "checkpoint.keep_last=5"], tmp_path / "whole").check()  # fmt: skip
    step1 = whole.output_dir / "checkpoints" / "step-1"
    assert (step1 / "rollout.json").is_file()
    resumed = run_inline([*GRPO_ARGS, f"reward.functions=[{LENGTH}]", f"resume={step1}"],
                         tmp_path / "resumed").check()  # fmt: skip
    for a, b in zip(resumed.train_steps(), whole.train_steps()[1:], strict=True):
        assert a["step"] == b["step"]
        assert a["reward"] == b["reward"] and a["loss"] == b["loss"] and a["kl"] == b["kl"]


class _LengthServer(BaseHTTPRequestHandler):
    """`length_penalty` behind the reward.remote protocol."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        rewards = length_penalty(body["prompts"], body["completions"])
        data = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def length_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _LengthServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/score"
    server.shutdown()
    server.server_close()
    thread.join()


def test_remote_rewards_score_an_online_run(length_server: str, tmp_path: Path) -> None:
    """The reward from a server on 127.0.0.1 (reward.remote.urls) gives the run the reward
    function's numbers: the same completions, rewards and losses."""
    args = [*GRPO_ARGS, "train.max_steps=2", "grpo.num_iterations=1"]
    local = run_inline([*args, f"reward.functions=[{LENGTH}]"], tmp_path / "local").check()
    remote = run_inline(
        [*args, "reward.functions=[]", f"reward.remote.urls=[{length_server}]"],
        tmp_path / "remote",
    ).check()  # fmt: skip
    assert "remote x1" in remote.summary_line("rewards")
    for a, b in zip(remote.train_steps(), local.train_steps(), strict=True):
        assert a["reward"] == b["reward"] and a["loss"] == b["loss"]
        assert a["rewards/remote/mean"] == b["rewards/length_penalty/mean"]
