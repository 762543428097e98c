"""PPO with a critic (Schulman et al. 2017; InstructGPT's RLHF, Ouyang et al. 2022) and, by
`ppo.advantage_estimator`, the critic-free REINFORCE++ and REINFORCE++-baseline (Hu et al.
2025): the `online.Algorithm` of task=ppo, the critic (a second trained engine) and the ptx
rows. Definitions are OpenRLHF's (`losses/ppo.py` says where verl and TRL differ).

The round is `rollouts.Rollouts`' (generation with per-completion seeds, rewards, the no-grad
passes); this file adds, per round:

1. the critic's values of every completion token (no grad, at generation time; gae only) and
   the old policy's entropy (logged);
2. per-token rewards: the score (REINFORCE++-baseline: minus its prompt's mean score; clipped
   to ±`reward_clip`) on the last completion token, −`kl_coef`·(log π_old − log π_ref) on every
   token (`losses.per_token_rewards`);
3. advantages: GAE (γ, λ) with the values (returns = A + V, the critic's target), or
   REINFORCE++'s discounted returns; whitened over the whole round (every rank's tokens: the
   moments are all-reduced, so the split over ranks changes nothing).

and per optimizer step (one mini-batch of the round, `rollouts.Rollouts`):

- actor: PPO-clip per token (with optional dual clip) on the whitened advantages, aggregated as
  GRPO's dapo (the token mean over the global mini-batch), plus `ptx_coef` × the SFT loss
  (token mean over the step's ptx tokens, all ranks) on `ppo.ptx_data` rows;
- critic: the clipped value loss ½·max((V − R)², (clip(V, V_old ± ε_v) − R)²), the same token
  mean; during the first `critic_warmup_steps` steps only the critic trains.

The critic is a reward model whose score head is read at every token (`models.value`): a
`task=rm` folder (`critic_init=reward_model`) or the policy's weights with a new head
(`critic_init=policy`), set up like any trained model (frozen parts, LoRA with the head trained
fully, activation checkpointing, ZeRO-3 partitioned as it loads), with its own AdamW, rate and
schedule (`ppo.critic_*`); it is saved in every checkpoint (`deepspeed-critic/`) and exported
as the reward-model folder it wraps (`final-critic/`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from align_anything.backend import distributed as comm
from align_anything.backend import ds_config as dsc
from align_anything.backend.engine import Engine
from align_anything.backend.params import count_parameters
from align_anything.backend.zero_init import model_init_context
from align_anything.config import RunConfig
from align_anything.config.sections import PPOSection
from align_anything.errors import ConfigError
from align_anything.families import zoo
from align_anything.families.language import IGNORE_INDEX, collate_sft, loading
from align_anything.families.language.encode import Encoding
from align_anything.families.language.family import LANGUAGE_MODELS, ModelSide, build_extra_data
from align_anything.families.language.forward import sequence_logps, sequence_token_values
from align_anything.families.language.prepare import prepare_for_training
from align_anything.families.language.value import ValueModel, check_critic_folder, load_critic
from align_anything.losses import (
    discounted_returns,
    explained_variance_moments,
    gae,
    group_baseline,
    loss_items,
    loss_sum,
    masked_moments,
    moments_mean_var,
    per_token_rewards,
    ppo_policy_loss,
    token_kl,
    value_loss,
    whiten,
)
from align_anything.tasks.online import common as online
from align_anything.tasks.online import rollouts
from align_anything.training.deepspeed_plan import DeepSpeedPlan
from align_anything.training.run import Data, Run, Schedule
from align_anything.training.sources import RowBatches
from align_anything.training.task import TaskSpec

CRITIC = "critic"  # its engine's name (checkpoint folder `deepspeed-critic/`)
PTX = "ptx"  # its rows' name in `Data.extra`


def critic_path(cfg: RunConfig) -> str:
    """The folder the critic starts from (`ppo.critic_model`, else by `ppo.critic_init`)."""
    reward = cfg.reward.model if cfg.reward is not None else None
    return cfg.ppo.critic_path(policy=cfg.model.name_or_path, reward_model=reward)


# ---------------------------------------------------------------------------- set-up hooks


def check(cfg: RunConfig, model: ModelSide) -> None:
    """Before any data or weights: the rewards resolve, the critic's folder is of the kind
    `critic_init` names and reads the policy's token ids (its values are taken on them)."""
    online.check_rewards(cfg, model)
    rl = cfg.ppo
    if rl.ptx_data is not None and model.media is not None:
        raise ConfigError(
            "ppo.ptx_data: the ptx term is for text models; this model takes "
            f"{', '.join(model.media.modalities)}: set ppo.ptx_coef=0 ppo.ptx_data=null"
        )
    if not rl.trains_critic():
        return
    if model.media is not None:
        raise ConfigError(
            "ppo.advantage_estimator=gae trains a text critic, but this model takes "
            f"{', '.join(model.media.modalities)}: use advantage_estimator=reinforce_plus_plus "
            "or reinforce_plus_plus_baseline (no critic)"
        )
    path = zoo.resolve_model_path(critic_path(cfg), key="ppo.critic_model")
    key = "ppo.critic_model" if rl.critic_model else (
        "reward.model" if rl.critic_init == "reward_model" else "model.name_or_path"
    )  # fmt: skip
    # The name as the user gave it (a built-in name resolves again, to the same folder).
    check_critic_folder(critic_path(cfg), init=rl.critic_init, key=key,
                        trust_remote_code=cfg.model.trust_remote_code)  # fmt: skip
    if path != model.path:
        vocab = loading.load_tokenizer(path).get_vocab()
        if vocab != model.tokenizer.get_vocab():
            raise ConfigError(
                f"{key}={critic_path(cfg)!r}: the critic reads the policy's token ids, but its "
                "tokenizer is not the policy's; give a reward model trained from the policy's "
                "family (task=rm from the same base), or use ppo.critic_init=policy"
            )


def prepare_ptx(cfg: RunConfig, model: ModelSide, data: Data) -> list[str]:
    """`ppo.ptx_data` encoded as SFT conversations (assistant tokens scored) through the data
    cache, into `data.extra["ptx"]`; its fingerprint joins the training data's (a resume with
    other ptx rows is other data)."""
    rl = cfg.ppo
    if rl.ptx_data is None:
        return []
    prepared, fingerprint = build_extra_data(
        cfg, model, task="ppo-ptx", path=rl.ptx_data, kind="conversation",
        encoding=Encoding("sft"), key="ppo.ptx_data",
    )  # fmt: skip
    data.extra[PTX] = prepared.train
    data.fingerprints["data_fingerprint"] += f"+ptx{fingerprint}"
    return [
        f"  ptx data        {rl.ptx_data}: {len(prepared.train)} conversations, "
        f"x {rl.ptx_coef:g} SFT loss in the actor's ({prepared.note})"
    ]


def critic_engines(
    cfg: RunConfig, model: ModelSide, ds_plan: DeepSpeedPlan, schedule: Schedule
) -> tuple[dict[str, Engine], list[str]]:
    """The critic's engine (gae only): the critic's reward model loaded (ZeRO-3: partitioned),
    prepared as the policy is (frozen parts, LoRA with the head trained fully, activation
    checkpointing), wrapped in `ValueModel`, trained by its own AdamW with `ppo.critic_*`."""
    rl, train = cfg.ppo, cfg.train
    if not rl.trains_critic():
        return {}, []
    path = zoo.resolve_model_path(critic_path(cfg), key="ppo.critic_model")
    with model_init_context(ds_plan.config):
        scorer = load_critic(
            path, init=rl.critic_init, dtype=dsc.torch_dtype(ds_plan.precision),
            attn_implementation=model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
        )  # fmt: skip
    # transformers reads a score at the last non-pad token; the values are read everywhere.
    scorer.config.pad_token_id = model.tokenizer.pad_token_id
    prepared, lines = prepare_for_training(
        scorer, name=f"{critic_path(cfg)} (critic)", freeze=cfg.model.freeze,
        adapters=cfg.model.lora.adapters(), reward=True,
        gradient_checkpointing=cfg.speed.gradient_checkpointing,
    )  # fmt: skip
    config = ds_plan.config
    if isinstance(config.get("optimizer"), dict):  # a preset's own optimizer: the critic's rate
        config = {**config, "optimizer": {**config["optimizer"]}}
        config["optimizer"]["params"] = {
            **config["optimizer"].get("params", {}),
            "lr": rl.critic_learning_rate,
        }
    engine = Engine(
        ValueModel(prepared), config,
        adam=dsc.AdamSettings(rl.critic_learning_rate, train.adam_betas, train.adam_eps,
                              train.weight_decay),
        schedule=rl.critic_lr_scheduler, total_steps=schedule.total_steps,
        warmup_steps=math.ceil(rl.critic_warmup_ratio * schedule.total_steps),
    )  # fmt: skip
    trainable, total = count_parameters(engine.module)
    warmup = (
        f"; the first {rl.critic_warmup_steps} steps train the critic only"
        if rl.critic_warmup_steps else ""
    )  # fmt: skip
    summary = [
        f"  critic          {critic_path(cfg)} ({rl.critic_init}): values at every token, "
        f"{trainable / 1e6:.2f}M of {(trainable + total) / 1e6:.2f}M parameters trained, "
        f"lr {rl.critic_learning_rate:g} ({rl.critic_lr_scheduler}), ZeRO stage "
        f"{engine.zero_stage}{warmup}",
        *(line.replace("  adapters        ", "  critic adapters ") for line in lines),
    ]
    return {CRITIC: engine}, summary


# ---------------------------------------------------------------------------- the algorithm


@dataclass
class PPO:
    """PPO's (and REINFORCE++'s) round and loss: the `online.Algorithm` of task=ppo. `critic`:
    the critic's engine (None for REINFORCE++); `ptx`: the ptx rows as a step source."""

    rl: PPOSection
    critic: Engine | None
    ptx: RowBatches | None
    world: int
    grad_accum: int
    name: str = "ppo"
    importance_level: str = "token"  # rollout.importance_sampling weighs each token's loss
    logs_entropy: bool = True

    def needs_old_logps(self) -> bool:
        return True  # the ratio's old policy, and the KL penalty in the reward

    @torch.no_grad()
    def extra_passes(self, batch: online.RolloutBatch) -> None:
        if self.critic is None:
            return
        self.critic.eval()
        batch.values = sequence_token_values(
            self.critic, batch.layout, width=batch.loss_mask.shape[1]
        ).detach()
        self.critic.train()

    def rewards_for_advantages(
        self, rewards: list[float], batches: list[online.RolloutBatch]
    ) -> tuple[list[float], dict[str, float]]:
        return rewards, {}  # the KL penalty goes on every token (`attach_advantages`)

    def attach_advantages(
        self, batches: list[online.RolloutBatch], rewards: Tensor, *, rank: int, world: int
    ) -> tuple[list[float], dict[str, float]]:
        """Per-token rewards, GAE (or discounted returns), whitened over the whole round;
        logged: `kl` and `reward_with_kl` (per completion), the advantages before whitening,
        the returns, the values and the explained variance (gae), the old policy's entropy
        (token means). Collective (one all-reduce)."""
        rl = self.rl
        scores = rewards
        if rl.advantage_estimator == "reinforce_plus_plus_baseline":
            scores = group_baseline(rewards, rl.num_generations)
        mine = scores.view(world, -1)[rank]
        parts, sums = [], {}

        def add(key: str, value: Tensor) -> None:
            sums[key] = sums.get(key, 0.0) + value.double()

        start = 0
        for batch in batches:
            mask, full = batch.loss_mask, batch.completion_mask()
            count = mask.shape[0]
            score = mine[start : start + count].to(mask.device)
            start += count
            kl = None
            if batch.ref_logps is not None:
                assert batch.old_logps is not None
                kl = token_kl(batch.old_logps, batch.ref_logps, full)
                add("kl", kl.sum())
            clipped = torch.nan_to_num(score.double(), nan=0.0)
            if rl.reward_clip is not None:
                clipped = clipped.clamp(-rl.reward_clip, rl.reward_clip)
            penalty = rl.kl_coef * kl.double().sum(-1) if kl is not None else 0.0
            add("reward_with_kl", (clipped - penalty).sum())
            # On the loss mask: a masked (truncated) completion gets no reward and no advantage.
            token_rewards = per_token_rewards(
                score, mask, kl=kl, kl_coef=rl.kl_coef, reward_clip=rl.reward_clip
            )
            if self.critic is not None:
                assert batch.values is not None
                advantages, returns = gae(token_rewards, batch.values, mask, gamma=rl.gamma,
                                          lam=rl.lam)  # fmt: skip
                add("values", masked_moments(batch.values, mask))
                add("explained", explained_variance_moments(batch.values, returns, mask))
            else:
                returns = discounted_returns(token_rewards, mask, gamma=rl.gamma)
                advantages = returns
            add("advantages", masked_moments(advantages, mask))
            add("returns", masked_moments(returns, mask))
            if batch.entropy is not None:
                add("entropy", torch.stack([(batch.entropy * full).sum(), full.sum()]))
            parts.append((batch, advantages, returns))
        keys = sorted(sums)
        flat = {f"{k}/{i}": v.reshape(-1)[i] for k, v in sums.items() for i in range(v.numel())}
        order = sorted(flat)
        values, (completions,) = comm.sum_metrics(flat, order, float(len(mine)))
        total = dict(zip(order, values, strict=True))

        def moments(key: str, size: int = 3) -> Tensor:
            return torch.tensor([total[f"{key}/{i}"] for i in range(size)], dtype=torch.float64)

        advantage_moments = moments("advantages")
        shown = []
        for batch, advantages, returns in parts:
            mask = batch.loss_mask
            batch.advantages = whiten(advantages, mask, moments=advantage_moments.to(mask.device))
            if self.critic is not None:
                batch.returns = returns
            per_row = (batch.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            shown += per_row.tolist()
        metrics = {}
        for key in ("advantages", "returns", "values"):
            if key in keys:
                mean, var = moments_mean_var(moments(key))
                metrics[f"{key}/mean"], metrics[f"{key}/std"] = float(mean), float(var.sqrt())
        if "kl" in keys:
            metrics["kl"] = total["kl/0"] / completions
        metrics["reward_with_kl"] = total["reward_with_kl/0"] / completions
        if "explained" in keys:  # 1 − Var[R − V] / Var[R] over the round's tokens
            (_, residual), (_, spread) = (moments_mean_var(m) for m in
                                          moments("explained", 6).split(3))  # fmt: skip
            metrics["explained_variance"] = float(1 - residual / spread) if spread > 0 else math.nan
        if "entropy" in keys:
            metrics["entropy"] = total["entropy/0"] / max(total["entropy/1"], 1.0)
        return shown, {k: v for k, v in metrics.items() if math.isfinite(v)}

    def for_step(self, batches: list[online.RolloutBatch], step: int) -> None:
        """Critic-only warm-up steps; the step's ptx rows, one micro-batch beside each rollout
        micro-batch, with the normaliser of the global ptx token count (one all-reduce)."""
        train_policy = step >= self.rl.critic_warmup_steps
        for batch in batches:
            batch.train_policy, batch.ptx = train_policy, None
        if self.ptx is None or not train_policy:
            return
        ptx = self.ptx.step(step).batches
        tokens = sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in ptx)
        _, (total,) = comm.sum_metrics({}, [], tokens)
        normalizer = max(total, 1.0) / (self.world * self.grad_accum)
        for batch, rows in zip(batches, ptx, strict=True):
            batch.ptx, batch.ptx_normalizer = rows, normalizer

    def count_items(self, batch: online.RolloutBatch) -> int:
        return loss_items(batch.loss_mask, loss_type="dapo")

    def loss(
        self, task: online.OnlineRL, batch: online.RolloutBatch, *, normalizer: float
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        rl, mask = self.rl, batch.loss_mask
        losses: dict[str, Tensor] = {}
        metrics: dict[str, Tensor] = {}
        if batch.train_policy:
            low, high = rl.clip_range()
            logps = task.token_logps(task.policy, batch)
            assert batch.old_logps is not None and batch.advantages is not None
            per_token, stats = ppo_policy_loss(
                logps, batch.old_logps, batch.advantages, epsilon_low=low, epsilon_high=high,
                dual_clip=rl.dual_clip,
            )  # fmt: skip
            if batch.is_weights is not None:  # rollout.importance_sampling, per token as GRPO's
                per_token = per_token * batch.is_weights
            policy = loss_sum(per_token, mask, loss_type="dapo",
                              max_completion_length=rl.max_completion_length)  # fmt: skip
            actor = policy / normalizer
            metrics.update({
                "policy_loss": policy.detach(),
                "clip_ratio": (stats.clipped * mask).sum(),
                "approx_kl": (stats.approx_kl * mask).sum(),
            })  # fmt: skip
            if rl.dual_clip is not None:
                metrics["dual_clip_ratio"] = (stats.dual_clipped * mask).sum()
            if batch.ptx is not None:
                logp_sums, counts = sequence_logps(
                    task.policy, batch.ptx, completion_only=task.completion_only
                )
                nll = -logp_sums.sum()
                actor = actor + rl.ptx_coef * nll / batch.ptx_normalizer
                metrics["ptx/nll"], metrics["ptx/tokens"] = nll.detach(), counts.sum().double()
            losses["policy"] = actor
        if self.critic is not None:
            assert batch.values is not None and batch.returns is not None
            values = sequence_token_values(self.critic, batch.layout, width=mask.shape[1])
            per_token, clipped = value_loss(values, batch.values, batch.returns,
                                            value_clip=rl.value_clip)  # fmt: skip
            critic = loss_sum(per_token, mask, loss_type="dapo",
                              max_completion_length=rl.max_completion_length)  # fmt: skip
            losses[CRITIC] = critic / normalizer
            metrics["value_loss"] = critic.detach()
            metrics["value_clip_fraction"] = (clipped * mask).sum()
        return losses, metrics

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """`ptx_loss` (the ptx rows' token mean) and `loss`, the actor's: the policy loss plus
        ptx_coef × ptx_loss."""
        nll, tokens = metrics.pop("ptx/nll", None), metrics.pop("ptx/tokens", None)
        if nll is not None and tokens:
            metrics["ptx_loss"] = nll / tokens
        if "policy_loss" in metrics:
            metrics["loss"] = metrics["policy_loss"] + self.rl.ptx_coef * metrics.get(
                "ptx_loss", 0.0
            )
        return metrics


# ---------------------------------------------------------------------------- build


def ptx_batches(run: Run) -> RowBatches | None:
    """The ptx rows as seeded batches: each step a global batch of them (as many rows as the
    step's completions), split over ranks and micro-batches like the rollout's."""
    cfg = run.cfg
    rows = run.data.extra.get(PTX)
    if rows is None:
        return None
    plan = run.ds_plan.batch
    per_epoch = len(rows) // plan.global_batch
    if per_epoch == 0:
        raise ConfigError(
            f"ppo.ptx_data={cfg.ppo.ptx_data!r} has {len(rows)} usable conversations, fewer than "
            f"one step's {plan.global_batch} ({plan.describe()}): add rows, or lower "
            "train.per_device_batch_size"
        )
    pad = run.model.tokenizer.pad_token_id
    return RowBatches(
        rows, plan, rank=run.dist.rank, seed=cfg.train.seed, steps_per_epoch=per_epoch,
        collate=lambda part: collate_sft(part, pad_id=pad), device=run.policy.device,
    )  # fmt: skip


def build(run: Run) -> tuple[online.OnlineRL, rollouts.Rollouts]:
    cfg = run.cfg
    rl = cfg.ppo
    critic = run.engines.get(CRITIC)
    algorithm = PPO(
        rl, critic, ptx_batches(run), world=run.dist.world_size,
        grad_accum=run.ds_plan.batch.grad_accum,
    )  # fmt: skip
    estimator = {
        "gae": f"GAE (gamma {rl.gamma:g}, lambda {rl.lam:g}) with the critic",
        "reinforce_plus_plus": f"REINFORCE++: discounted returns (gamma {rl.gamma:g}), no critic",
        "reinforce_plus_plus_baseline": "REINFORCE++-baseline: the prompt's mean score "
        f"subtracted, discounted returns (gamma {rl.gamma:g}), no critic",
    }[rl.advantage_estimator]
    run.summary.append(
        f"  advantages      {estimator}; whitened over each round; KL penalty "
        f"{rl.kl_coef:g} per token in the reward; each round {rl.num_ppo_epochs} pass(es) x "
        f"{rl.num_mini_batches} mini-batch(es)"
    )
    return rollouts.build_online(run, algorithm)


SPEC = TaskSpec(
    name="ppo", record_kind="prompt", family=LANGUAGE_MODELS, encoding=online.encoding,
    build=build, check=check, prepare_data=prepare_ptx, schedule=online.schedule,
    engines=critic_engines,
)  # fmt: skip
