"""task=ppo as an object on the tiny model, in this process: one whole PPO step against a hand
computation, REINFORCE++'s advantages, and the parts of the shared rollout that PPO added (a
round cut into per-completion records and back; each step's mini-batch the same set of
completions on any number of ranks).

The hand computation takes every number from plain forward passes of each row alone (the
policy's log-probs, the reference's, the critic's values) and applies PPO's definitions written
out here with loops (per-token rewards, GAE, whitening, the clipped objectives), so it shares no
code with `losses/ppo.py` or the task beyond the models themselves."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from align_anything.config.sections import PPOSection
from align_anything.families import zoo
from align_anything.families.language import loading
from align_anything.families.language.value import ValueModel, load_critic
from align_anything.tasks.online import common as online
from align_anything.tasks.online import rollouts
from align_anything.tasks.online.ppo import PPO

PATH = zoo.resolve_model_path("tiny-random-llama")
# The config's defaults (configs/task/ppo.yaml) with what this test varies.
PPO_SETTINGS = {
    "advantage_estimator": "gae", "num_generations": 2, "temperature": 1.0, "top_p": 1.0,
    "max_completion_length": 5, "mask_truncated_completions": False, "num_ppo_epochs": 2,
    "num_mini_batches": 1, "epsilon": 0.2, "epsilon_high": None, "dual_clip": None,
    "value_clip": 0.01, "kl_coef": 0.1, "reward_clip": 1.0, "gamma": 0.9, "lam": 0.8,
    "critic_init": "policy", "critic_model": None, "critic_learning_rate": 1e-3,
    "critic_lr_scheduler": "constant", "critic_warmup_ratio": 0.0, "critic_warmup_steps": 0,
    "ptx_coef": 0.0, "ptx_data": None, "eval_samples": 0, "generation_batch_size": 8,
}  # fmt: skip
# A round: 2 prompts x 2 completions of different lengths (ids avoid the pad id 0).
ROWS = [
    {"prompt_ids": [5, 6, 7], "completion_ids": [8, 9, 10, 11], "truncated": False, "row": 0},
    {"prompt_ids": [5, 6, 7], "completion_ids": [12, 13], "truncated": False, "row": 0},
    {"prompt_ids": [20, 21], "completion_ids": [22, 23, 24], "truncated": False, "row": 1},
    {"prompt_ids": [20, 21], "completion_ids": [25, 26, 27, 28, 29], "truncated": True, "row": 1},
]
# Scores from the rewards: the first is clipped to reward_clip = 1.
SCORES = [2.5, -0.3, 0.7, 0.1]


def ppo(**changes: object) -> PPOSection:
    return PPOSection.model_validate({**PPO_SETTINGS, **changes})


@pytest.fixture
def models() -> tuple[torch.nn.Module, torch.nn.Module, ValueModel]:
    """The policy, a reference that differs from it (so the KL terms are not 0), a critic
    with the policy's backbone and a new, seeded value head."""
    policy = loading.load_model(PATH, reward=False, dtype=torch.float32)
    reference = copy.deepcopy(policy).eval()
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=noise))
    torch.manual_seed(2)
    critic = ValueModel(load_critic(PATH, init="policy", dtype=torch.float32))
    with torch.no_grad():  # a head large enough that the values differ visibly per token
        critic.scorer.score.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    return policy, reference, critic


def make_task(
    policy: torch.nn.Module, critic: ValueModel | None, rl: PPOSection
) -> online.OnlineRL:
    algorithm = PPO(rl, critic, None, world=1, grad_accum=1)  # type: ignore[arg-type]
    return online.OnlineRL(
        algorithm=algorithm, rl=rl, policy=policy, generator=None, rewards=None,
        tokenizer=SimpleNamespace(pad_token_id=0), media=None, eval_rows=[], eval_path=None,
        completion_only=True, share_prefix=False, mask_dtype=None, rank=0, world=1,
    )  # fmt: skip


def row_alone(model: torch.nn.Module, row: dict, *, values: bool = False) -> torch.Tensor:
    """[L] log-probs of the row's completion tokens (or, with `values`, the critic's value of
    the state each was chosen in), from one forward pass of prompt + completion alone."""
    prompt, completion = row["prompt_ids"], row["completion_ids"]
    ids = torch.tensor([prompt + completion])
    out = model(input_ids=ids)
    start = len(prompt) - 1  # position t predicts token t + 1
    if values:
        return out[0, start : start + len(completion)]
    logits = out.logits[0, start : start + len(completion)]
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(completion)), completion]


def hand_round(
    rl: PPOSection, old: list[torch.Tensor], ref: list[torch.Tensor], values: list[torch.Tensor]
) -> tuple[list[list[float]], list[list[float]]]:
    """(whitened advantages, returns) per row: PPO's definitions with loops."""
    advantages, returns = [], []
    for b, score in enumerate(SCORES):
        length = len(old[b])
        rewards = [-rl.kl_coef * float(old[b][t] - ref[b][t]) for t in range(length)]
        rewards[-1] += max(-rl.reward_clip, min(rl.reward_clip, score))
        running, adv = 0.0, [0.0] * length
        for t in reversed(range(length)):
            next_value = float(values[b][t + 1]) if t + 1 < length else 0.0
            delta = rewards[t] + rl.gamma * next_value - float(values[b][t])
            running = delta + rl.gamma * rl.lam * running
            adv[t] = running
        advantages.append(adv)
        returns.append([a + float(v) for a, v in zip(adv, values[b], strict=True)])
    flat = [a for row in advantages for a in row]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / len(flat)  # biased, as OpenRLHF
    whitened = [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in advantages]
    return whitened, returns


def hand_losses(
    rl: PPOSection, policy: torch.nn.Module, critic: ValueModel, old: list[torch.Tensor],
    old_values: list[torch.Tensor], advantages: list[list[float]], returns: list[list[float]],
) -> tuple[torch.Tensor, torch.Tensor, float, float]:  # fmt: skip
    """(policy loss, value loss) as token means over the round (with gradients, from each row
    alone), and the clip fractions of the ratio and of the values."""
    policy_terms, value_terms, clipped, value_clipped = [], [], 0, 0
    for b, row in enumerate(ROWS):
        logps, values = row_alone(policy, row), row_alone(critic, row, values=True)
        for t in range(len(row["completion_ids"])):
            ratio, a = torch.exp(logps[t] - old[b][t]), advantages[b][t]
            bounded = ratio.clamp(1 - rl.epsilon, 1 + rl.epsilon)
            policy_terms.append(-torch.minimum(ratio * a, bounded * a))
            clipped += float(bounded * a < ratio * a)
            v, v_old, r = values[t], old_values[b][t], returns[b][t]
            v_clip = v_old + (v - v_old).clamp(-rl.value_clip, rl.value_clip)
            value_terms.append(0.5 * torch.maximum((v - r) ** 2, (v_clip - r) ** 2))
            value_clipped += float((v_clip - r) ** 2 > (v - r) ** 2)
    count = len(policy_terms)
    return (
        torch.stack(policy_terms).mean(), torch.stack(value_terms).mean(), clipped / count,
        value_clipped / count,
    )  # fmt: skip


def test_one_ppo_step_against_a_hand_computation(models) -> None:
    """A round of 4 completions on the tiny model: its rewards, GAE and whitening; the first
    step's losses and their gradients (the update SGD makes from them), then the second pass
    over the round, off-policy (the ratio moved, some tokens clip), against the same
    definitions written out by hand from each row's own forward passes."""
    policy, reference, critic = models
    rl = ppo()
    task = make_task(policy, critic, rl)
    batch = task.collate(ROWS)
    # The round's no-grad passes, as `Rollouts` runs them.
    source = SimpleNamespace(task=task, reference=reference)
    rollouts.Rollouts.no_grad_passes(source, batch)  # type: ignore[arg-type]
    with torch.no_grad():
        old = [row_alone(policy, row) for row in ROWS]
        ref = [row_alone(reference, row) for row in ROWS]
        values = [row_alone(critic, row, values=True) for row in ROWS]
    for b, row in enumerate(ROWS):  # the batched passes are the rows' own numbers
        n = len(row["completion_ids"])
        torch.testing.assert_close(batch.old_logps[b, :n], old[b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.ref_logps[b, :n], ref[b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.values[b, :n], values[b], rtol=1e-5, atol=1e-5)
    shown, metrics = task.algorithm.attach_advantages(
        [batch], torch.tensor(SCORES), rank=0, world=1
    )
    advantages, returns = hand_round(rl, old, ref, values)
    for b, row in enumerate(ROWS):
        n = len(row["completion_ids"])
        assert batch.advantages[b, :n].tolist() == pytest.approx(advantages[b], abs=1e-5)
        assert batch.returns[b, :n].tolist() == pytest.approx(returns[b], abs=1e-5)
        assert shown[b] == pytest.approx(sum(advantages[b]) / n, abs=1e-5)
    kl = [float((old[b] - ref[b]).sum()) for b in range(4)]
    assert metrics["kl"] == pytest.approx(sum(kl) / 4, abs=1e-5)
    clipped = [max(-1.0, min(1.0, s)) for s in SCORES]
    assert metrics["reward_with_kl"] == pytest.approx(
        sum(c - rl.kl_coef * k for c, k in zip(clipped, kl, strict=True)) / 4, abs=1e-5
    )
    tokens = task.count_items(batch)
    assert tokens == 14

    step = torch.optim.SGD  # the update: θ − lr·∇ for both models
    actor_opt, critic_opt = step(policy.parameters(), lr=0.5), step(critic.parameters(), lr=1e-4)
    for attempt in ("on-policy", "off-policy"):
        actor_opt.zero_grad(), critic_opt.zero_grad()
        # The loop's normaliser on 1 rank without accumulation: the global token count.
        out = task.loss(batch, normalizer=float(tokens), training=True)
        got = {name: float(loss.detach()) for name, loss in out.losses.items()}
        out.losses["policy"].backward()
        out.losses["critic"].backward()
        task_grads = [p.grad.clone() for p in [*policy.parameters(), *critic.parameters()]]
        actor_opt.zero_grad(), critic_opt.zero_grad()
        want_policy, want_value, clip_frac, value_clip_frac = hand_losses(
            rl, policy, critic, old, values, advantages, returns
        )
        (want_policy + want_value).backward()
        assert got["policy"] == pytest.approx(float(want_policy), abs=1e-6), attempt
        assert got["critic"] == pytest.approx(float(want_value), rel=1e-5, abs=1e-7), attempt
        assert float(out.metrics["clip_ratio"]) / tokens == pytest.approx(clip_frac), attempt
        assert float(out.metrics["value_clip_fraction"]) / tokens == pytest.approx(value_clip_frac)
        hand_grads = [p.grad.clone() for p in [*policy.parameters(), *critic.parameters()]]
        for mine, hand in zip(task_grads, hand_grads, strict=True):
            torch.testing.assert_close(mine, hand, rtol=1e-4, atol=1e-6)
        # The update: the task's gradients give θ − lr·(the hand gradient), for both models.
        before = [p.detach().clone() for p in [*policy.parameters(), *critic.parameters()]]
        rates = [0.5] * len(list(policy.parameters())) + [1e-4] * len(list(critic.parameters()))
        for param, grad in zip([*policy.parameters(), *critic.parameters()], task_grads,
                               strict=True):  # fmt: skip
            param.grad = grad
        actor_opt.step(), critic_opt.step()
        after = [*policy.parameters(), *critic.parameters()]
        for param, old_value, hand, rate in zip(after, before, hand_grads, rates, strict=True):
            torch.testing.assert_close(param.detach(), old_value - rate * hand, rtol=1e-5,
                                       atol=1e-6)  # fmt: skip
        if attempt == "on-policy":
            # Ratio 1: the whitened advantages average to 0 over the round's tokens.
            assert got["policy"] == pytest.approx(0.0, abs=1e-6)
            assert clip_frac == 0.0
        else:
            # The first update moved both models: the ratio left 1, past the clip on some
            # tokens, and some values left their clip range.
            assert 0.0 < clip_frac < 1.0 and abs(got["policy"]) > 1e-4
            assert 0.0 < value_clip_frac < 1.0


def test_critic_only_warmup_steps_train_no_policy(models) -> None:
    policy, reference, critic = models
    task = make_task(policy, critic, ppo(critic_warmup_steps=1))
    batch = task.collate(ROWS)
    rollouts.Rollouts.no_grad_passes(SimpleNamespace(task=task, reference=reference), batch)  # type: ignore[arg-type]
    task.algorithm.attach_advantages([batch], torch.tensor(SCORES), rank=0, world=1)
    task.algorithm.for_step([batch], 0)
    out = task.loss(batch, normalizer=14.0, training=True)
    assert set(out.losses) == {"critic"} and "policy_loss" not in out.metrics
    task.algorithm.for_step([batch], 1)
    assert set(task.loss(batch, normalizer=14.0, training=True).losses) == {"policy", "critic"}


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_plus_plus_advantages_by_hand(models, baseline: bool) -> None:
    """No critic: the discounted return of the per-token rewards (baseline: each score minus
    its prompt's mean score first), whitened over the round."""
    policy, reference, _ = models
    estimator = "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"
    rl = ppo(advantage_estimator=estimator, reward_clip=None)
    task = make_task(policy, None, rl)
    batch = task.collate(ROWS)
    rollouts.Rollouts.no_grad_passes(SimpleNamespace(task=task, reference=reference), batch)  # type: ignore[arg-type]
    assert batch.values is None
    task.algorithm.attach_advantages([batch], torch.tensor(SCORES), rank=0, world=1)
    scores = list(SCORES)
    if baseline:  # groups of 2: rows 0-1 and 2-3
        scores = [
            s - (scores[b // 2 * 2] + scores[b // 2 * 2 + 1]) / 2 for b, s in enumerate(scores)
        ]
    returns = []
    for b in range(4):
        old, ref = batch.old_logps[b], batch.ref_logps[b]
        n = len(ROWS[b]["completion_ids"])
        rewards = [-rl.kl_coef * float(old[t] - ref[t]) for t in range(n)]
        rewards[-1] += scores[b]
        row, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = rewards[t] + rl.gamma * running
            row[t] = running
        returns.append(row)
    flat = [g for row in returns for g in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((g - mean) ** 2 for g in flat) / len(flat) + 1e-8)
    for b, row in enumerate(returns):
        got = batch.advantages[b, : len(row)].tolist()
        assert got == pytest.approx([(g - mean) / std for g in row], abs=1e-5)
    out = task.loss(batch, normalizer=14.0, training=True)
    assert set(out.losses) == {"policy"}  # no critic, no value loss


def test_a_round_cut_into_records_and_back_is_the_same_batch(models) -> None:
    """What a checkpoint inside a round stores and what a pass's mini-batches are made of:
    per-completion records, collated again, give the very tensors the round attached."""
    policy, reference, critic = models
    task = make_task(policy, critic, ppo())
    batch = task.collate(ROWS)
    rollouts.Rollouts.no_grad_passes(SimpleNamespace(task=task, reference=reference), batch)  # type: ignore[arg-type]
    task.algorithm.attach_advantages([batch], torch.tensor(SCORES), rank=0, world=1)
    # Importance weights of a vLLM round (rollout.importance_sampling), 0 past each completion.
    batch.is_weights = torch.rand(batch.loss_mask.shape) * batch.completion_mask()
    records = rollouts.split_batch(batch, [r["row"] for r in ROWS])
    assert [r["completion_ids"] for r in records] == [r["completion_ids"] for r in ROWS]
    again = rollouts.attach_records(task.collate(ROWS), records)
    for name in online.ATTACHED:
        assert torch.equal(getattr(again, name), getattr(batch, name)), name


def test_each_mini_batch_is_the_same_set_on_one_and_two_ranks() -> None:
    """A round of 16 completions in 2 mini-batches of 8: the permutation of each pass depends
    on the seed, the round and the pass only, and the ranks take consecutive slices of each
    mini-batch, so the union over 2 ranks is the mini-batch of 1 rank."""
    records = [{"row": i, "completion_ids": [i + 5], "truncated": False} for i in range(16)]

    def chosen(world: int, rank: int, within: int) -> list[int]:
        fake = SimpleNamespace(
            sizes=SimpleNamespace(mini_batches=2), seed=42, rank=rank,
            batch=SimpleNamespace(global_batch=8, micro_batch=8 // world // 2, grad_accum=2),
            micro_batches=lambda part: [r["row"] for r in part],
        )  # fmt: skip
        current = rollouts.Round(3, [], {}, 1.0, samples=records)
        return rollouts.Rollouts.mini_batch(fake, current, within)  # type: ignore[arg-type]

    for within in range(4):  # 2 passes x 2 mini-batches
        one = chosen(1, 0, within)
        assert sorted(one) == sorted(chosen(2, 0, within) + chosen(2, 1, within))
        assert len(set(one)) == 8
    # Each pass covers the round once; the two passes order it differently.
    assert sorted(chosen(1, 0, 0) + chosen(1, 0, 1)) == list(range(16))
    assert chosen(1, 0, 0) + chosen(1, 0, 1) != chosen(1, 0, 2) + chosen(1, 0, 3)


def test_the_memory_planner_and_deepspeed_auto_count_the_critic() -> None:
    """The critic's weights, gradients and Adam moments (fp32 on CPU: 16 bytes a parameter
    under ZeRO-0) and its activations join the policy's; `deepspeed=auto` with a budget that
    fits the run without a critic but not with one leaves ZeRO-0."""
    from align_anything.config import load_config
    from align_anything.families.language.family import LANGUAGE_MODELS
    from align_anything.families.language.sizes import model_sizes
    from align_anything.training import memory_plan as plan

    def estimates(overrides: list[str]) -> list:
        return plan.plan(load_config(overrides), LANGUAGE_MODELS.estimate_memory, world_size=1)[
            0
        ].estimates

    base = ["task=ppo", "model.name_or_path=tiny-random-llama", "train.per_device_batch_size=8",
            "ppo.num_generations=4", "train.precision=fp32"]  # fmt: skip
    with_critic = estimates(base)
    without = estimates([*base, "ppo.advantage_estimator=reinforce_plus_plus"])
    critic = model_sizes("tiny-random-llama", reward=True, trust_remote_code=False, adapters=None)
    z0, z0_without = with_critic[0], without[0]
    assert z0.preset == "z0"
    assert z0.model_states - z0_without.model_states == pytest.approx(16 * critic.total)
    assert z0.activations > z0_without.activations
    for a, b in zip(with_critic, without, strict=True):
        assert a.total > b.total, a.preset
    budget = (z0.total + z0_without.total) / 2 / plan.HEADROOM
    assert plan.choose(without, budget)[0].preset == "z0"
    assert plan.choose(with_critic, budget)[0].preset != "z0"


def test_a_zero3_checkpoint_resumes_under_zero3_only() -> None:
    """Cross-stage resume goes through DeepSpeed's universal checkpoint (every trained engine's
    folder); DeepSpeed 0.19.8 cannot load one converted from ZeRO-3 into ZeRO-1/2, so that
    change is refused before any weights load, naming the presets that work."""
    from align_anything.backend.ds_config import universal_change
    from align_anything.errors import ConfigError

    assert universal_change(source_stage=3, source_world=2, stage=3, world=1) == (
        "ZeRO-3 on 2 rank(s) -> ZeRO-3 on 1 rank(s)"
    )
    assert universal_change(source_stage=2, source_world=2, stage=3, world=1)
    with pytest.raises(ConfigError, match="Resume with deepspeed=z3 or z3_offload"):
        universal_change(source_stage=3, source_world=2, stage=2, world=1)
