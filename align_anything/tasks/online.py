"""What the online RL tasks (GRPO, RLOO) share: the `OnlineRL` task, whose algorithm (the
advantages and the loss) is a field, and `Rollouts`, the step source that generates each round.

One optimizer step (with `num_iterations` μ = 1; μ > 1 reuses a round for μ steps):

1. **Prompts.** The step's global batch counts completions (TRL's convention): B completions are
   B / G prompts × G completions. The prompts are a seeded permutation of the training prompts
   cut into rounds (`batching.step_indices`, one round per μ steps); rank r takes the r-th
   slice of micro × grad_accum / G prompts, so a prompt's group never leaves its rank.
2. **Generation** (`training.rollout.HFGenerate`): G completions per prompt, stop at EOS or
   `max_completion_length` (truncated completions counted, optionally masked from the loss).
   Completion j of prompt p in round k is sampled from its own generator seeded by (train.seed,
   k, p, j): the same completions on any number of ranks and after a resume.
3. **No-grad passes** per micro-batch: the reference's per-token log-probs when β > 0 (a frozen
   InferenceEngine, partitioned under ZeRO-3; with LoRA the adapter-disabled policy) and the
   policy's own at generation time when μ > 1 (the old policy of the ratio; RLOO also when
   β > 0: its KL penalty is in the reward).
4. **Rewards** (`rewards.score_completions`: functions, and a reward model) on this rank's
   completions; a function's error stops every rank before any backward pass of the step (the
   ranks agree on it, `comm.fail_together`), so the last checkpoint is the state on disk. The
   rewards of every rank are all-gathered (N floats) and the pure advantage functions of
   `losses.rl` get the whole generation batch, as TRL's do: the group terms need only the
   rank's own rows, but `scale_rewards=batch` and RLOO's `normalize_advantages` need the batch.
5. **Loss**: the loop's step with the algorithm's loss; the normaliser rule of `training.loop`
   (global items / (world × grad_accum)) with the algorithm's items, so 2 ranks give the loss
   of 1 rank on the same completions.

Evaluation before and after training: greedy answers to `eval_samples` held-out prompts; their
mean reward (`eval/reward`, and per function) and, for built-in data, the generation check
(`eval/generation_check`, the check of `training/generation.py`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from align_anything import rewards as reward_fns
from align_anything.backend import distributed as comm
from align_anything.config import RunConfig
from align_anything.data.batches import Rows, SharedPrefix, to_device
from align_anything.data.collate import pad_rows
from align_anything.data.encode import IGNORE_INDEX, Encoding
from align_anything.data.layouts import (
    PrefixGroup,
    collate_shared_prefix,
    mask_dtype,
    supports_shared_prompt,
)
from align_anything.data.media import MEDIA_KEYS
from align_anything.data.multimodal import MediaSupport
from align_anything.errors import ConfigError, UserError
from align_anything.forward import sequence_token_logps
from align_anything.losses import (
    group_reward_std,
    logp_mismatch,
    nanstd,
    truncated_importance_weights,
)
from align_anything.training import checkpoints, generation, reference
from align_anything.training.batching import step_indices
from align_anything.training.reward_model import RewardModel
from align_anything.training.rollout import (
    Completions,
    GenerationBackend,
    HFGenerate,
    Sampling,
    stop_token_ids,
)
from align_anything.training.run import Data, ModelSide, Run, Schedule
from align_anything.training.setup import completion_only_logits, fresh_model_loader
from align_anything.training.task import LossOutput, StepBatches

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
    """Before any data or weights: a misspelt reward function fails in seconds."""
    reward_fns.load_reward_functions(cfg.reward.functions)


@dataclass(frozen=True)
class RoundSizes:
    """How the prompts split: per rank and per round (one round per μ steps)."""

    prompts_per_rank: int
    prompts_per_round: int
    rounds_per_epoch: int


def round_sizes(cfg: RunConfig, prompts: int, batch: Any) -> RoundSizes:
    """The round sizes; the batch must split into whole groups per rank."""
    rl = cfg.section()
    group = rl.num_generations
    per_rank = batch.micro_batch * batch.grad_accum
    if per_rank % group:
        raise ConfigError(
            f"task={cfg.task}: the global batch counts completions, {group} "
            f"({cfg.task}.num_generations) per prompt, and each rank generates for its own "
            f"prompts, so micro-batch x gradient accumulation ({batch.micro_batch} x "
            f"{batch.grad_accum} = {per_rank} completions per rank) must be a multiple of "
            f"{group}; the batch is {batch.describe()}. Set train.per_device_batch_size to a "
            f"multiple of {group} (or adjust {cfg.task}.num_generations)"
        )
    per_round = per_rank // group * batch.world_size
    rounds = prompts // per_round
    if rounds == 0:
        raise ConfigError(
            f"the training set has {prompts} usable prompts, fewer than one step's "
            f"{per_round} ({batch.describe()} completions / {group} per prompt): lower "
            "train.per_device_batch_size, or add prompts"
        )
    return RoundSizes(per_rank // group, per_round, rounds)


def schedule(cfg: RunConfig, data: Data, batch: Any) -> Schedule:
    """Steps from rounds of prompts: μ steps per round."""
    rl, train = cfg.section(), cfg.train
    rounds = round_sizes(cfg, len(data.train), batch).rounds_per_epoch
    per_epoch = rounds * rl.num_iterations
    total = train.max_steps if train.max_steps > 0 else per_epoch * train.epochs
    return Schedule(per_epoch, total, math.ceil(train.warmup_ratio * total))


# ---------------------------------------------------------------------------- batches


@dataclass
class RolloutBatch:
    """A micro-batch of completions: prompt + completion per row (`rows`; labels on the
    completion), the same as one row per prompt group when the prompt is shared (`shared`),
    the loss mask [B, C] over completion tokens (none of a truncated one when masked), and
    what the round attached: advantages, the old policy's and the reference's per-token
    log-probs; with an inference engine its log-probs of the sampled tokens, the trainer's at
    generation time, and the truncated importance weights when corrected."""

    rows: Rows
    shared: SharedPrefix | None
    loss_mask: Tensor
    truncated: Tensor
    advantages: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    engine_logps: Tensor | None = None
    trainer_logps: Tensor | None = None
    is_weights: Tensor | None = None

    @property
    def layout(self) -> Rows | SharedPrefix:
        return self.shared if self.shared is not None else self.rows


class Algorithm(Protocol):
    """What GRPO and RLOO give the online task: advantages from the round's rewards, the loss
    of a micro-batch, its item count."""

    name: str
    # Whether the old policy's log-probs are needed at generation time beyond μ > 1.
    needs_old_logps_for_reward: bool

    def rewards_for_advantages(
        self, rewards: list[float], batches: list[RolloutBatch]
    ) -> tuple[list[float], dict[str, float]]:
        """The reward the advantages are computed from (RLOO subtracts its KL penalty), and
        round metrics of that step (RLOO's `kl`). Collective where it reduces."""
        ...

    def advantages(self, rewards: Tensor) -> Tensor:
        """Advantages of the whole generation batch's completions (all ranks', in order)."""
        ...

    def count_items(self, batch: RolloutBatch) -> int: ...

    def loss(self, logps: Tensor, batch: RolloutBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """(the micro-batch's summed loss, metric sums) from its per-token log-probs."""
        ...


# ---------------------------------------------------------------------------- rewards


class Rewards:
    """The run's rewards: functions (weighted) and a reward model (its weight last)."""

    def __init__(
        self, functions: list, weights: list[float], model: RewardModel | None, *,
        timeout_s: float | None,
    ) -> None:  # fmt: skip
        self.functions = functions
        self.weights = weights
        self.model = model
        self.timeout_s = timeout_s  # each function call's deadline (reward.timeout_seconds)
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
                try:
                    scored, by_name = reward_fns.score_completions(
                        self.functions, self.weights[:count], prompts=prompts,
                        completions=texts, fields=row_fields(rows), row_ids=row_ids,
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
class OnlineRL:
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
        shared = self.shared_layout(rows) if self.share_prefix else None
        return RolloutBatch(batch, shared, mask, torch.tensor([r["truncated"] for r in rows]))

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

    def count_items(self, batch: RolloutBatch) -> int:
        return self.algorithm.count_items(batch)

    def count_tokens(self, batch: RolloutBatch) -> int:
        return batch.rows.tokens

    def before_losses(self, batches: Sequence[RolloutBatch], real: Sequence[bool]) -> None:
        pass  # the round's statistics are the step source's (`Rollouts`)

    def loss(self, batch: RolloutBatch, *, normalizer: float, training: bool) -> LossOutput:
        total, metrics = self.algorithm.loss(self.token_logps(self.policy, batch), batch)
        return LossOutput({"policy": total / normalizer}, metrics)

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Token means (kl, clip ratios) from their sums and the token count."""
        tokens = metrics.pop("count/tokens", None)
        for key in list(metrics):
            if key.startswith("tokens/"):
                value = metrics.pop(key)
                if tokens:
                    metrics[key.removeprefix("tokens/")] = value / tokens
        return metrics

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
        results = {"eval/reward": sums[0] / max(counts[0], 1.0),
                   "eval/completion_length": sums[2] / count}  # fmt: skip
        if check is not None:
            results["eval/generation_check"] = sums[1] / count
        for k, name in enumerate(names):
            results[f"eval/rewards/{name}"] = sums[3 + k] / max(counts[1 + k], 1.0)
        return results

    def summary(self) -> dict[str, Any]:
        return {}


# ---------------------------------------------------------------------------- rounds


@dataclass
class Round:
    """One generation round: this rank's micro-batches (with advantages and the no-grad
    log-probs attached), the round's global metrics, the time it took, a completions table."""

    index: int
    batches: list[RolloutBatch]
    metrics: dict[str, float]
    seconds: float
    table: list[dict[str, Any]] = field(default_factory=list)


class Rollouts:
    """The online step source: a generation round every μ (`num_iterations`) steps, served as
    the micro-batches of each of its steps."""

    def __init__(self, run: Run, task: OnlineRL, reference_model: Any, sizes: RoundSizes) -> None:
        self.task = task
        self.reference = reference_model
        self.sizes = sizes
        self.rows = run.data.train
        self.batch = run.ds_plan.batch
        self.rank = run.dist.rank
        self.seed = run.cfg.train.seed
        self.device = run.policy.device
        self.logging = run.cfg.logging
        self.checkpoints = (run.output.path / "checkpoints", run.output.run_id)
        self.current: Round | None = None
        self.importance = run.cfg.rollout  # truncated importance sampling (rollout.*)

    def step(self, step: int) -> StepBatches:
        round_index = step // self.task.rl.num_iterations
        fresh = self.current is None or self.current.index != round_index
        if fresh:
            self.current = self.rollout(round_index, step)
        assert self.current is not None
        return StepBatches(
            self.current.batches, metrics=dict(self.current.metrics),
            seconds=self.current.seconds if fresh else 0.0,
            table=self.current.table if fresh else [],
        )  # fmt: skip

    def round_prompts(self, round_index: int) -> list[int]:
        """Training prompt rows of a round on this rank."""
        epoch, in_epoch = divmod(round_index, self.sizes.rounds_per_epoch)
        order = step_indices(
            len(self.rows), global_batch=self.sizes.prompts_per_round, seed=self.seed,
            epoch=epoch, step=in_epoch,
        )  # fmt: skip
        per_rank = self.sizes.prompts_per_rank
        return order[self.rank * per_rank : (self.rank + 1) * per_rank]

    def samples(self, prompt_rows: list[int], completions: Completions) -> list[dict]:
        group = self.task.rl.num_generations
        samples = []
        for k, (ids, cut) in enumerate(zip(completions.ids, completions.truncated, strict=True)):
            row = self.rows[prompt_rows[k // group]]
            sample = {"prompt_ids": row["prompt_ids"], "completion_ids": ids, "truncated": cut,
                      "row": prompt_rows[k // group]}  # fmt: skip
            sample.update({key: row[key] for key in MEDIA_KEYS if key in row})
            samples.append(sample)
        return samples

    @torch.no_grad()
    def no_grad_passes(self, batch: RolloutBatch) -> None:
        task, rl = self.task, self.task.rl
        old = rl.num_iterations > 1 or (task.algorithm.needs_old_logps_for_reward and rl.beta > 0)
        if old or batch.engine_logps is not None:
            task.policy.eval()
            logps = task.token_logps(task.policy, batch).detach()
            task.policy.train()
            batch.old_logps = logps if old else None
            # An engine sampled the tokens: the trainer's log-probs at generation time, to
            # compare (and, with rollout.importance_sampling, correct) the engine's against.
            batch.trainer_logps = logps if batch.engine_logps is not None else None
        if self.reference is not None:
            batch.ref_logps = task.token_logps(self.reference, batch).detach()

    def rollout(self, round_index: int, step: int) -> Round:
        """Generate, score and compute advantages for one round (collective)."""
        task, rl, micro = self.task, self.task.rl, self.batch.micro_batch
        start = time.perf_counter()
        prompt_rows = self.round_prompts(round_index)
        prompts = [self.rows[i] for i in prompt_rows]
        seeds = [prompt_seed(self.seed, round_index, i) for i in prompt_rows]
        sampling = Sampling(
            rl.max_completion_length, temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k
        )
        good = lambda: checkpoints.last_complete(*self.checkpoints)  # noqa: E731
        try:
            completions = task.generator.generate(prompts, rl.num_generations, sampling, seeds)
        except UserError as err:  # a rollout server that failed: before this step's update
            raise UserError(failed_reward(str(err), step, good(), what="generation")) from None
        samples = self.samples(prompt_rows, completions)
        batches = [
            to_device(task.collate(samples[m * micro : (m + 1) * micro]), self.device)
            for m in range(self.batch.grad_accum)
        ]
        for m, batch in enumerate(batches):
            if completions.logprobs is not None:
                batch.engine_logps = engine_logps(
                    completions.logprobs[m * micro : (m + 1) * micro], batch.loss_mask
                ).to(batch.loss_mask.device)
            self.no_grad_passes(batch)
        # Collective: every rank has prompts in a training round, and the same backend.
        sampling_figures = self.engine_mismatch(batches) if completions.logprobs is not None else {}
        texts = task.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        sample_rows = [self.rows[s["row"]] for s in samples]
        total, per_function = task.rewards.score(
            sample_rows, texts, row_ids=[r["source_row"] for r in sample_rows], step=step,
            good_checkpoint=good,
        )  # fmt: skip
        local, extra = task.algorithm.rewards_for_advantages(total, batches)
        gathered = torch.tensor(
            [v for part in comm.all_gather_objects(local) for v in part], dtype=torch.float32
        )
        advantages = task.algorithm.advantages(gathered)
        mine = advantages.view(self.batch.world_size, -1)[self.rank]
        for m, batch in enumerate(batches):
            batch.advantages = mine[m * micro : (m + 1) * micro].to(batch.loss_mask.device)
        metrics = (
            round_metrics(total, per_function, completions, advantages, group=rl.num_generations)
            | extra
            | sampling_figures
        )
        if metrics["frac_reward_none"] == 1.0 and self.rank == 0:
            print(
                f"warning: step {step + 1}: no reward had an opinion on any of its "
                f"{int(gathered.numel())} completions (every reward returned None), so every "
                "advantage is 0 and the step changes nothing; check the reward functions' "
                "fields and conditions",
                flush=True,
            )
        table = []
        every = self.logging.completions_every
        if every and (step + 1) % every == 0:
            shown = self.logging.completions_shown
            table = [
                {"prompt": task.tokenizer.decode(s["prompt_ids"], skip_special_tokens=True),
                 "completion": text, "reward": r, "advantage": float(a)}
                for s, text, r, a in zip(samples[:shown], texts, total, mine.tolist(), strict=False)
            ]  # fmt: skip
        return Round(round_index, batches, metrics, time.perf_counter() - start, table)

    def engine_mismatch(self, batches: list[RolloutBatch]) -> dict[str, float]:
        """TRL's `sampling/sampling_logp_difference/mean|max` (|engine − trainer| log-prob
        over the round's counted tokens, all ranks) and, with rollout.importance_sampling, the
        truncated importance weights each batch's loss is multiplied by and their
        `sampling/importance_sampling_ratio/min|mean|max`. Collective."""
        level = getattr(self.task.algorithm, "importance_level", "token")
        diffs, weights = [], []
        for batch in batches:
            assert batch.trainer_logps is not None and batch.engine_logps is not None
            diffs.append(logp_mismatch(batch.trainer_logps, batch.engine_logps, batch.loss_mask))
            if self.importance.importance_sampling:
                batch.is_weights = truncated_importance_weights(
                    batch.trainer_logps, batch.engine_logps, batch.loss_mask,
                    cap=self.importance.importance_sampling_cap, level=level,
                )  # fmt: skip
                counted = batch.loss_mask.bool() if level == "token" else batch.loss_mask.any(-1)
                w = batch.is_weights[counted]
                if w.numel():
                    weights.append((float(w.min()), float(w.sum()), w.numel(), float(w.max())))
        ranks = comm.all_gather_objects((diffs, weights))
        diffs = [d for rank in ranks for d in rank[0]]
        weights = [w for rank in ranks for w in rank[1]]
        figures = {
            "sampling/sampling_logp_difference/mean": sum(d[0] for d in diffs)
            / max(sum(d[1] for d in diffs), 1.0),
            "sampling/sampling_logp_difference/max": max((d[2] for d in diffs), default=0.0),
        }
        if weights:
            figures["sampling/importance_sampling_ratio/min"] = min(w[0] for w in weights)
            figures["sampling/importance_sampling_ratio/mean"] = sum(w[1] for w in weights) / sum(
                w[2] for w in weights
            )
            figures["sampling/importance_sampling_ratio/max"] = max(w[3] for w in weights)
        return figures


def engine_logps(logprobs: list[list[float]], mask: Tensor) -> Tensor:
    """[B, C] the engine's log-probs of a micro-batch's completion tokens (0 past each end),
    aligned with the loss mask and the trainer's per-token log-probs."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for b, values in enumerate(logprobs):
        out[b, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out


def round_metrics(
    total: list[float], per_function: dict[str, list[float]], completions: Completions,
    advantages: Tensor, *, group: int,
) -> dict[str, float]:  # fmt: skip
    """The round's global figures (TRL's names where TRL logs the same thing). Collective."""
    rewards = torch.tensor(
        [v for part in comm.all_gather_objects(total) for v in part], dtype=torch.float64
    )
    lengths = [len(ids) for ids in completions.ids]
    stats = comm.all_gather_objects(
        (lengths, list(completions.truncated), completions.seconds,
         {k: list(v) for k, v in per_function.items()})
    )  # fmt: skip
    all_lengths = [n for s in stats for n in s[0]]
    all_cut = [c for s in stats for c in s[1]]
    seconds = max(s[2] for s in stats)
    none = torch.isnan(rewards)
    metrics = {
        "reward": float(torch.nanmean(rewards)),
        "reward_std": float(nanstd(rewards)),
        # Completions no reward had an opinion on (every function said None): they get
        # advantage 0. When that is all of them the step trains nothing: no figure of
        # rewards or advantages is logged for it (see `Rollouts.rollout`'s warning).
        "frac_reward_none": float(none.double().mean()),
        "frac_reward_zero_std": float((group_reward_std(rewards, group) == 0).double().mean()),
        "completions/mean_length": sum(all_lengths) / len(all_lengths),
        "completions/max_length": float(max(all_lengths)),
        "completions/min_length": float(min(all_lengths)),
        "completions/clipped_ratio": sum(all_cut) / len(all_cut),
        "advantages/mean": float(advantages.mean()),
        "advantages/std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "generation/tokens_per_second": sum(all_lengths) / max(seconds, 1e-9),
        "generation/seconds": seconds,
    }
    for name in per_function:
        values = torch.tensor([v for s in stats for v in s[3][name]], dtype=torch.float64)
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(values))
        metrics[f"rewards/{name}/std"] = float(nanstd(values))
    if bool(none.all()):
        for key in ("frac_reward_zero_std", "advantages/mean", "advantages/std"):
            metrics.pop(key)
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


# ---------------------------------------------------------------------------- build


def generation_backend(run: Run) -> GenerationBackend:
    """rollout.backend: HF `generate` on the policy, or a vLLM engine (colocated or a server;
    `training/rollout_vllm.py`), with the same stop tokens."""
    cfg, policy = run.cfg, run.policy
    stop = stop_token_ids(policy.module, run.model.tokenizer)
    if cfg.rollout.backend == "vllm":
        from align_anything.training import rollout_vllm

        return rollout_vllm.build_backend(run, stop)
    return HFGenerate(
        policy,
        run.model.tokenizer,
        media=run.model.media,
        chunk=cfg.section().generation_batch_size,
    )


def build_online(run: Run, algorithm: Algorithm) -> tuple[OnlineRL, Rollouts]:
    """The online task around `algorithm`, its parts (generation backend, rewards, reference)
    and its step source."""
    cfg, policy = run.cfg, run.policy
    rl = cfg.section()
    media = run.model.media
    generator = generation_backend(run)
    model = None
    if cfg.reward.model is not None:
        if media is not None:
            raise UserError(
                "reward.model scores text, but the policy is an image-text or audio-text "
                "model whose prompts carry media; use reward functions for multimodal runs"
            )
        model = RewardModel(
            cfg.reward.model, policy_tokenizer=run.model.tokenizer,
            precision=run.ds_plan.precision, model_init_config=run.ds_plan.config,
            ds_config=run.ds_plan.reference_config(offload=False), device=policy.device,
        )  # fmt: skip
        run.summary.append(model.describe())
    rewards = Rewards(
        reward_fns.load_reward_functions(cfg.reward.functions),
        cfg.reward.weight_list(),
        model,
        timeout_s=cfg.reward.timeout_seconds,
    )
    frozen = None
    if rl.beta > 0:
        frozen = reference.build(
            policy=policy, lora_enabled=cfg.model.lora.enabled,
            load_model=fresh_model_loader(run), ds_config=run.ds_plan.reference_config(offload=False),
        )  # fmt: skip
        run.summary.append(
            reference.describe(
                frozen, lora_enabled=cfg.model.lora.enabled, offload=False, precomputed_s=None
            )  # fmt: skip
        )
    else:
        run.summary.append(f"  reference       none ({cfg.task}.beta=0)")
    sizes = round_sizes(cfg, len(run.data.train), run.ds_plan.batch)
    run.summary += [
        rewards.describe(),
        f"  generation      {rl.num_generations} completions per prompt, "
        f"{sizes.prompts_per_round} prompts per step ({sizes.prompts_per_rank} per rank), "
        f"at most {rl.max_completion_length} tokens, temperature {rl.temperature:g}, "
        f"top_p {rl.top_p:g}, top_k {rl.top_k}",
        f"  generator       {generator.describe()}",
    ]  # fmt: skip
    # Text models whose attention takes a dense mask (`data.layouts`).
    share_prefix = cfg.speed.share_prefix and supports_shared_prompt(policy.module.config)
    if share_prefix:
        run.summary.append(
            "  rows            the completions of a prompt in a micro-batch as one row "
            "prompt + completions (speed.share_prefix)"
        )
    task = OnlineRL(
        algorithm=algorithm, rl=rl, policy=policy, generator=generator, rewards=rewards,
        tokenizer=run.model.tokenizer, media=media, eval_rows=run.data.eval,
        eval_path=cfg.data.eval_path or cfg.data.path,
        completion_only=completion_only_logits(cfg, policy), share_prefix=share_prefix,
        mask_dtype=mask_dtype(policy.module), rank=run.dist.rank, world=run.dist.world_size,
        name=cfg.task,
        eval_off=f"{cfg.task}.eval_samples=0 switches the held-out evaluation off"
        if rl.eval_samples == 0 else None,
    )  # fmt: skip
    return task, Rollouts(run, task, frozen, sizes)
