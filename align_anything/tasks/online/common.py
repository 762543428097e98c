"""What the online RL tasks (GRPO, RLOO and PPO) share: the `OnlineRL` task, whose algorithm
(the advantages and the loss) is a field, its rollout batches, its rewards and its held-out
evaluation. The rounds that feed it, and `build_online`, are `tasks/rollouts.py`'s.

Evaluation before and after training: greedy answers to `eval_samples` held-out prompts; their
mean reward (`eval/reward`, and per function) and, for built-in data, the generation check
(`eval/generation_check`, the check of `training/generation.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from align_anything.backend import distributed as comm
from align_anything.config import RunConfig
from align_anything.errors import ConfigError, UserError
from align_anything.families.language import evaluation as generation
from align_anything.families.language.batches import Rows, SharedPrefix
from align_anything.families.language.collate import pad_rows
from align_anything.families.language.encode import IGNORE_INDEX, Encoding
from align_anything.families.language.family import ModelSide
from align_anything.families.language.forward import (
    sequence_token_logps,
    sequence_token_logps_and_entropy,
)
from align_anything.families.language.layouts import PrefixGroup, collate_shared_prefix
from align_anything.families.language.multimodal import MediaSupport
from align_anything.generation.rollout import GenerationBackend, Sampling
from align_anything.rewards import functions as reward_fns
from align_anything.rewards.model import RewardModel
from align_anything.rewards.remote import remote_reward_functions
from align_anything.training.run import Data, Schedule
from align_anything.training.task import LossOutput, Task

# Prompt seeds: (train.seed, round, prompt row) mixed into one integer.
_PRIME = 1_000_000_007


def prompt_seed(seed: int, round_index: int, row: int) -> int:
    return ((seed * _PRIME + round_index) * _PRIME + row) % (2**62)


def row_fields(rows: list[dict]) -> dict[str, list[Any]]:
    """The per-row fields reward functions receive (e.g. `answer`), one list per column."""
    keys = list(rows[0]["fields"]) if rows else []
    return {k: [row["fields"].get(k) for row in rows] for k in keys}


# ---------------------------------------------------------------------------- set-up hooks


def encoding(cfg: RunConfig) -> Encoding:
    """Prompt rows (`data.prompts`), cached like every task's; a prompt leaves room for
    `max_completion_length` tokens within `data.max_length` (longer ones dropped, or, with a
    truncating `data.truncation`, cut at the start)."""
    data, rl = cfg.data, cfg.section()
    return Encoding(
        "prompt", max_prompt_length=data.max_length - rl.max_completion_length,
        prompt_truncation="drop" if data.truncation == "drop" else "keep_end",
    )  # fmt: skip


def check_rewards(cfg: RunConfig, model: ModelSide) -> None:
    """Before any data or weights: a misspelt reward function, or a reward server's header
    variable that is not set, fails in seconds."""
    reward_functions(cfg)


def reward_functions(cfg: RunConfig) -> list[tuple[str, Any]]:
    """(name, function) of every reward function and reward server, in `reward.weights`'
    order: the functions, then the remote URLs (`rewards_remote`: one reward each)."""
    reward, remote = cfg.reward, cfg.reward.remote
    return reward_fns.load_reward_functions(reward.functions) + remote_reward_functions(
        remote.urls, timeout_s=remote.timeout_s, retries=remote.retries,
        backoff_s=remote.backoff_s, max_rows=remote.max_rows_per_request,
        headers_env=remote.headers_env,
    )  # fmt: skip


@dataclass(frozen=True)
class RoundSizes:
    """How the prompts split: per rank and per round, and the steps a round serves (E passes
    of M mini-batches)."""

    prompts_per_rank: int
    prompts_per_round: int
    rounds_per_epoch: int
    epochs: int = 1
    mini_batches: int = 1

    @property
    def steps_per_round(self) -> int:
        return self.epochs * self.mini_batches


def round_sizes(
    cfg: RunConfig, prompts: int, batch: Any, *, unit: str = "completions"
) -> RoundSizes:
    """The round sizes; a rank's completions (`unit`: the text-to-image tasks' images) of a
    round must be whole groups."""
    rl = cfg.section()
    group = rl.num_generations
    epochs, mini_batches = rl.round_steps()
    per_rank = batch.micro_batch * batch.grad_accum * mini_batches
    if per_rank % group:
        rounds = f" x {mini_batches} (ppo.num_mini_batches)" if mini_batches > 1 else ""
        raise ConfigError(
            f"task={cfg.task}: the global batch counts {unit}, {group} "
            f"({cfg.task}.num_generations) per prompt, and each rank generates for its own "
            f"prompts, so micro-batch x gradient accumulation{rounds} ({batch.micro_batch} x "
            f"{batch.grad_accum}{f' x {mini_batches}' if rounds else ''} = {per_rank} "
            f"{unit} per rank) must be a multiple of "
            f"{group}; the batch is {batch.describe()}. Set train.per_device_batch_size to a "
            f"multiple of {group} (or adjust {cfg.task}.num_generations)"
        )
    per_round = per_rank // group * batch.world_size
    rounds = prompts // per_round
    if rounds == 0:
        raise ConfigError(
            f"the training set has {prompts} usable prompts, fewer than one step's "
            f"{per_round} ({batch.describe()} {unit} / {group} per prompt): lower "
            "train.per_device_batch_size, or add prompts"
        )
    return RoundSizes(per_rank // group, per_round, rounds, epochs, mini_batches)


def schedule(cfg: RunConfig, data: Data, batch: Any, *, unit: str = "completions") -> Schedule:
    """Steps from rounds of prompts: E × M steps per round."""
    train = cfg.train
    sizes = round_sizes(cfg, len(data.train), batch, unit=unit)
    per_epoch = sizes.rounds_per_epoch * sizes.steps_per_round
    total = train.max_steps if train.max_steps > 0 else per_epoch * train.epochs
    return Schedule(per_epoch, total, math.ceil(train.warmup_ratio * total))


# ---------------------------------------------------------------------------- batches


# What a round attaches to its completions, per token ([B, C]) or per completion ([B]): kept
# per completion when a round is re-cut into mini-batches or saved in a checkpoint.
ATTACHED = ("advantages", "old_logps", "ref_logps", "values", "returns", "is_weights")


@dataclass
class RolloutBatch:
    """A micro-batch of completions: prompt + completion per row (`rows`; labels on the
    completion), the same as one row per prompt group when the prompt is shared (`shared`),
    the loss mask [B, C] over completion tokens (none of a truncated one when masked), each
    completion's length, and what the round attached (`ATTACHED`): advantages (per completion
    or per token), the old policy's and the reference's per-token log-probs, a critic's values
    and returns; the old policy's entropy (logged); with an inference engine its log-probs of
    the sampled tokens, the trainer's at generation time, and the truncated importance weights
    when corrected. Per step: whether the policy trains on it (not in PPO's critic-only
    warm-up), and PPO's ptx rows with their normaliser."""

    rows: Rows
    shared: SharedPrefix | None
    loss_mask: Tensor
    truncated: Tensor
    advantages: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    lengths: Tensor | None = None
    entropy: Tensor | None = None
    train_policy: bool = True
    ptx: Any = None
    ptx_normalizer: float = 1.0
    engine_logps: Tensor | None = None
    trainer_logps: Tensor | None = None
    is_weights: Tensor | None = None

    @property
    def layout(self) -> Rows | SharedPrefix:
        return self.shared if self.shared is not None else self.rows

    def completion_mask(self) -> Tensor:
        """[B, C] 1 on every completion token (truncated ones included), 0 on padding."""
        assert self.lengths is not None
        width = self.loss_mask.shape[1]
        positions = torch.arange(width, device=self.loss_mask.device)
        return (positions[None, :] < self.lengths.to(positions.device)[:, None]).float()


class Algorithm(Protocol):
    """What GRPO, RLOO and PPO give the online task: what the round computes (no-grad passes,
    advantages), the loss of a micro-batch and its item count."""

    name: str
    # Whether the rollout's old-policy pass also gives the entropy (logged as `entropy`).
    logs_entropy: bool

    def needs_old_logps(self) -> bool:
        """Whether the policy's log-probs at generation time are needed (the ratio's old
        policy when a round serves several steps; a KL penalty in the reward)."""
        ...

    def extra_passes(self, batch: RolloutBatch) -> None:
        """No-grad passes at generation time beyond the old and reference log-probs (PPO's
        critic values), attached to the batch."""
        ...

    def rewards_for_advantages(
        self, rewards: list[float], batches: list[RolloutBatch]
    ) -> tuple[list[float], dict[str, float]]:
        """The reward the advantages are computed from (RLOO subtracts its KL penalty), and
        round metrics of that step (RLOO's `kl`). Collective where it reduces."""
        ...

    def attach_advantages(
        self, batches: list[RolloutBatch], rewards: Tensor, *, rank: int, world: int
    ) -> tuple[list[float], dict[str, float]]:
        """Attach this rank's advantages (and returns) to its round batches, from the whole
        generation batch's rewards (`rewards`: all ranks', in order); returns one advantage per
        completion of this rank (for the completions table) and round metrics. Collective."""
        ...

    def for_step(self, batches: list[RolloutBatch], step: int) -> None:
        """Per-step attachments to the batches step `step` (0-based) trains on (PPO: whether
        the policy trains, the ptx rows). Collective where it reduces."""
        ...

    def count_items(self, batch: RolloutBatch) -> int: ...

    def loss(
        self, task: OnlineRL, batch: RolloutBatch, *, normalizer: float
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(engine name -> the micro-batch's loss divided by `normalizer` (see `Task.loss`),
        metric sums)."""
        ...

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The algorithm's derived figures from the averaged metrics."""
        ...


@dataclass
class SequenceAdvantages:
    """What GRPO and RLOO share as algorithms: one advantage per completion from the whole
    generation batch's rewards (`advantages`), the old policy's pass only when a round serves
    several steps (μ > 1) or `old_logps_for_reward` says so, nothing per step."""

    logs_entropy = False

    def needs_old_logps(self) -> bool:
        return self.rl.num_iterations > 1 or self.old_logps_for_reward()  # type: ignore[attr-defined]

    def old_logps_for_reward(self) -> bool:
        return False

    def extra_passes(self, batch: RolloutBatch) -> None:
        pass

    def advantages(self, rewards: Tensor) -> Tensor:
        raise NotImplementedError

    def attach_advantages(
        self, batches: list[RolloutBatch], rewards: Tensor, *, rank: int, world: int
    ) -> tuple[list[float], dict[str, float]]:
        advantages = self.advantages(rewards)
        mine = advantages.view(world, -1)[rank]
        start = 0
        for batch in batches:
            count = batch.loss_mask.shape[0]
            batch.advantages = mine[start : start + count].to(batch.loss_mask.device)
            start += count
        metrics = {
            "advantages/mean": float(advantages.mean()),
            "advantages/std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        }
        if bool(torch.isnan(rewards).all()):
            metrics = {}  # no reward had an opinion: every advantage is 0, nothing to show
        return mine.tolist(), metrics

    def for_step(self, batches: list[RolloutBatch], step: int) -> None:
        pass

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


# ---------------------------------------------------------------------------- rewards


class Rewards:
    """The run's rewards: functions (weighted) and a reward model (its weight last)."""

    def __init__(
        self, functions: list, weights: list[float], model: RewardModel | None, *,
        timeout_s: float | None, media: MediaSupport | None = None,
    ) -> None:  # fmt: skip
        self.functions = functions
        self.weights = weights
        self.model = model
        self.timeout_s = timeout_s  # each function call's deadline (reward.timeout_seconds)
        # An image-text or audio-text policy's: the functions also get each row's own media
        # (`prompt_images`, `prompt_audio`: `MediaSupport.prompt_media`).
        self.media = media
        self.names = [name for name, _ in functions] + (["reward_model"] if model else [])

    def describe(self) -> str:
        pairs = zip(self.names, self.weights, strict=True)
        return f"  rewards         {', '.join(f'{n} x{w:g}' for n, w in pairs)}"

    def score(
        self, rows: list[dict], texts: list[str], *, row_ids: list[Any], step: int | None,
        good_checkpoint: Any,
    ) -> tuple[list[float], dict[str, list[float]]]:  # fmt: skip
        """(weighted total per completion (NaN: no reward had an opinion), each reward's
        values). Every rank learns whether any rank's reward function failed, and all stop."""
        prompts = [row["prompt"] for row in rows]
        # The reward model first: its forward is collective under ZeRO-3, so every rank runs
        # it, also when a reward function on this rank is about to fail.
        scores = self.model.score(prompts, texts) if self.model else None

        def functions() -> tuple[list[float], dict[str, list[float]]]:
            count = len(self.functions)
            total, per = [math.nan] * len(texts), {}
            if count:
                fields = row_fields(rows)
                if self.media is not None:
                    fields.update(self.media.prompt_media(rows))
                try:
                    scored, by_name = reward_fns.score_completions(
                        self.functions, self.weights[:count], prompts=prompts,
                        completions=texts, fields=fields, row_ids=row_ids,
                        timeout_s=self.timeout_s,
                    )  # fmt: skip
                except reward_fns.RewardError as err:
                    raise UserError(failed_reward(str(err), step, good_checkpoint())) from None
                total, per = scored.tolist(), {k: v.tolist() for k, v in by_name.items()}
            if scores is not None:
                per["reward_model"] = scores
                weight = self.weights[count]
                total = [s * weight if math.isnan(t) else t + s * weight
                         for t, s in zip(total, scores, strict=True)]  # fmt: skip
            return total, per

        result = comm.fail_together(functions, what="reward")
        assert result is not None
        return result


def failed_reward(error: str, step: int | None, good: Any, *, what: str = "reward") -> str:
    """The message of a failed reward (or generation): where (held-out evaluation, or which
    step, before its update) and the last complete checkpoint."""
    if step is None:
        return f"{what} in the held-out evaluation failed: {error}"
    return (
        f"{what} in step {step + 1} failed, before that step's optimizer update: {error}"
        + (f"\nThe last complete checkpoint, {good}, is intact (resume=auto)." if good
           else "\nNo checkpoint was written by this run yet.")
    )  # fmt: skip


# ---------------------------------------------------------------------------- the task


@dataclass
class OnlineRL(Task):
    """The online-RL task: rollout batches, per-token log-probs, the algorithm's loss, and the
    greedy held-out evaluation. The rounds come from `Rollouts`."""

    algorithm: Algorithm
    rl: Any  # the task's config section
    policy: Any
    generator: GenerationBackend
    rewards: Rewards
    tokenizer: Any
    media: MediaSupport | None
    eval_rows: Any
    eval_path: Any
    completion_only: bool
    share_prefix: bool
    mask_dtype: torch.dtype | None
    rank: int
    world: int
    name: str = "online"
    # The loss's items are tokens for dapo: no samples_per_second (generation/* and
    # train/tokens_per_second give the throughput).
    count_unit: str = "tokens"
    metric_keys: tuple[str, ...] = ("loss",)
    eval_loss: bool = False
    eval_off: str | None = None  # why the held-out evaluation is off (eval_samples=0)

    def collate(self, rows: list[dict]) -> RolloutBatch:
        """prompt + completion per row, right-padded; labels on the completion only; the loss
        mask [B, C] (completion tokens; none of a truncated one when masked)."""
        sequences = [[*r["prompt_ids"], *r["completion_ids"]] for r in rows]
        labels = [[IGNORE_INDEX] * len(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
        batch = pad_rows(sequences, labels, self.tokenizer.pad_token_id)
        if self.media is not None:
            batch = self.media.attach(batch, rows, copies=1)
        longest = max(len(r["completion_ids"]) for r in rows)
        mask = torch.zeros((len(rows), max(longest, 1)), dtype=torch.float32)
        drop = self.rl.mask_truncated_completions
        for b, row in enumerate(rows):
            if not (drop and row["truncated"]):
                mask[b, : len(row["completion_ids"])] = 1.0
        shared = None
        if self.share_prefix:
            # An image-text batch shares its prompts only when every row has its media: a row
            # without would need a dummy item, which the shared rows have no place for.
            if self.media is None:
                shared = self.shared_layout(rows)
            elif self.media.has_all_media(rows):
                shared = self.shared_layout(rows)
                firsts = [r for i, r in enumerate(rows) if i == 0 or rows[i - 1]["row"] != r["row"]]
                shared.media = self.media.features(firsts)
        lengths = torch.tensor([len(r["completion_ids"]) for r in rows])
        truncated = torch.tensor([r["truncated"] for r in rows])
        return RolloutBatch(batch, shared, mask, truncated, lengths=lengths)

    def shared_layout(self, rows: list[dict]) -> SharedPrefix:
        """The micro-batch's completions of one prompt as one row `prompt + c_1 + … + c_k`
        (`data.layouts`): the prompt, most of each sequence in chat data, runs once per group
        instead of once per completion. Groups are consecutive rows, so the scored tokens come
        out in row order (what `sequence_token_logps` relies on)."""
        groups: list[PrefixGroup] = []
        for index, row in enumerate(rows):
            ids = list(row["completion_ids"])
            if groups and rows[index - 1]["row"] == row["row"]:
                groups[-1].suffixes.append(ids)
                groups[-1].suffix_labels.append(list(ids))
                groups[-1].sequence_ids.append(index)
            else:
                groups.append(PrefixGroup(list(row["prompt_ids"]), [ids], [list(ids)], [index]))
        return collate_shared_prefix(
            groups, num_sequences=len(rows), pad_id=self.tokenizer.pad_token_id,
            additive_mask_dtype=self.mask_dtype,
        )  # fmt: skip

    def token_logps(self, model: Any, batch: RolloutBatch) -> Tensor:
        """[B, C] per-token completion log-probs, padded to the loss mask's width."""
        return sequence_token_logps(
            model, batch.layout, width=batch.loss_mask.shape[1],
            completion_only=self.completion_only,
        )  # fmt: skip

    def token_logps_and_entropy(self, model: Any, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """`token_logps` and the entropy at the same positions (no gradient), one forward."""
        return sequence_token_logps_and_entropy(
            model, batch.layout, width=batch.loss_mask.shape[1],
            completion_only=self.completion_only,
        )  # fmt: skip

    def count_items(self, batch: RolloutBatch) -> int:
        return self.algorithm.count_items(batch)

    def count_tokens(self, batch: RolloutBatch) -> int:
        return batch.rows.tokens

    def loss(self, batch: RolloutBatch, *, normalizer: float, training: bool) -> LossOutput:
        losses, metrics = self.algorithm.loss(self, batch, normalizer=normalizer)
        return LossOutput(losses, metrics)

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Token means (kl, clip ratios) from their sums and the token count, then the
        algorithm's own figures."""
        tokens = metrics.pop("count/tokens", None)
        for key in list(metrics):
            if key.startswith("tokens/"):
                value = metrics.pop(key)
                if tokens:
                    metrics[key.removeprefix("tokens/")] = value / tokens
        return self.algorithm.finalize_metrics(metrics)

    @torch.no_grad()
    def evaluate_extra(self, label: str) -> dict[str, float]:
        """Greedy answers to the first `eval_samples` held-out prompts: the mean reward (total
        and per reward) and, for built-in data, the share passing the generation check."""
        count = min(self.rl.eval_samples, len(self.eval_rows))
        if not count:
            return {}
        indices = list(range(self.rank, count, self.world))
        rows = [self.eval_rows[i] for i in indices]
        sampling = Sampling(self.rl.max_completion_length, greedy=True)
        completions = self.generator.generate(rows, 1, sampling, [0] * len(rows))
        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        if self.rewards.model is not None:
            # Reward-model forwards are collective under ZeRO-3: equal calls on every rank.
            self.rewards.model.pad_calls_to(math.ceil(count / self.world))
        total, per = self.rewards.score(
            rows, texts, row_ids=[r["source_row"] for r in rows], step=None,
            good_checkpoint=lambda: None,
        )  # fmt: skip
        check = generation.property_check(self.eval_path)
        passed = (
            sum(bool(check(row["fields"], t)) for row, t in zip(rows, texts, strict=True))
            if check
            else 0
        )
        names = sorted(per)
        sums = [sum(v for v in total if not math.isnan(v)), float(passed),
                float(sum(map(len, completions.ids)))]  # fmt: skip
        counts = [float(sum(not math.isnan(v) for v in total))]
        for name in names:
            sums.append(sum(v for v in per[name] if not math.isnan(v)))
            counts.append(float(sum(not math.isnan(v) for v in per[name])))
        _, reduced = comm.sum_metrics({}, [], *sums, *counts)
        sums, counts = reduced[: len(sums)], reduced[len(sums) :]
        # A mean over no opinion is no figure: a reward that had none on any held-out
        # completion is left out (not shown as 0), its share `eval/frac_reward_none` says so.
        results = {"eval/completion_length": sums[2] / count,
                   "eval/frac_reward_none": 1.0 - counts[0] / count}  # fmt: skip
        if counts[0]:
            results["eval/reward"] = sums[0] / counts[0]
        elif self.rank == 0:
            print(f"warning: eval ({label}): no reward had an opinion on any of the {count} "
                  "held-out completions (every one returned None): eval/reward is left out, "
                  "not shown as 0", flush=True)  # fmt: skip
        if check is not None:
            results["eval/generation_check"] = sums[1] / count
        for k, name in enumerate(names):
            if counts[1 + k]:
                results[f"eval/rewards/{name}"] = sums[3 + k] / counts[1 + k]
        return results
