"""What the online RL trainers (GRPO, RLOO) share: each step's prompts, generation, rewards,
advantages and the no-grad passes, fitted into `Trainer`'s lifecycle.

One optimizer step (with `num_iterations` μ = 1; μ > 1 reuses a round for μ steps):

1. **Prompts.** The step's global batch counts completions (TRL's convention): B completions are
   B / G prompts × G completions. The prompts are a seeded permutation of the training prompts
   cut into rounds (`batching.step_indices`, one round per μ steps); rank r takes the r-th
   slice of micro × grad_accum / G prompts, so a prompt's group never leaves its rank.
2. **Generation** (`rollout.HFGenerate`): G completions per prompt, stop at EOS or
   `max_completion_length` (truncated completions counted, optionally masked from the loss).
   Completion j of prompt p in round k is sampled from its own generator seeded by (train.seed,
   k, p, j): the same completions on any number of ranks and after a resume.
3. **No-grad passes** per micro-batch: the reference's per-token log-probs when β > 0 (a frozen
   InferenceEngine, partitioned under ZeRO-3; with LoRA the adapter-disabled policy) and the
   policy's own at generation time when μ > 1 (the old policy of the ratio; RLOO also when
   β > 0: its KL penalty is in the reward).
4. **Rewards** (`rewards.score_completions`: functions, and a reward model) on this rank's
   completions; a function's error stops every rank before any backward pass of the step (the
   ranks agree on it through one gather), so the last checkpoint is the state on disk. The
   rewards of every rank are all-gathered (N floats) and the pure advantage functions of
   `losses.rl` get the whole generation batch, as TRL's do: the group terms need only the
   rank's own rows, but `scale_rewards=batch` and RLOO's `normalize_advantages` need the batch.
5. **Loss**: `Trainer.train_step` with the trainer's `compute_loss`; the normaliser rule of
   `base.py` (global items / (world × grad_accum)) with `losses.loss_items` as the items, so
   2 ranks give the loss of 1 rank on the same completions.

Evaluation before and after training: greedy answers to `eval_samples` held-out prompts; their
mean reward (`eval/reward`, and per function) and, for built-in data, the generation check
(`eval/generation_check`, the check of `trainers/generation.py`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from align_anything import rewards as reward_fns
from align_anything.backend import distributed as comm
from align_anything.data import IGNORE_INDEX, DataReport
from align_anything.data.layouts import (
    PrefixGroup,
    collate_shared_prefix,
    mask_dtype,
    supports_shared_prompt,
)
from align_anything.data.media import MEDIA_KEYS
from align_anything.data.prompts import encode_prompts
from align_anything.errors import ConfigError, UserError
from align_anything.forward import completion_token_logps, shared_prefix_token_logps
from align_anything.trainers import checkpoints, generation, reference
from align_anything.trainers.base import Trainer
from align_anything.trainers.batching import step_indices
from align_anything.trainers.reward_model import RewardModel
from align_anything.trainers.rollout import HFGenerate, Sampling
from align_anything.trainers.tracking import StepResult, completions_table

# Where a micro-batch keeps its shared-prompt layout (`data.layouts`).
SHARED = "shared_"
# Prompt seeds: (train.seed, round, prompt row) mixed into one integer.
_PRIME = 1_000_000_007


def prompt_seed(seed: int, round_index: int, row: int) -> int:
    return ((seed * _PRIME + round_index) * _PRIME + row) % (2**62)


def row_fields(rows: list[dict]) -> dict[str, list[Any]]:
    """The per-row fields reward functions receive (e.g. `answer`), one list per column."""
    keys = list(rows[0]["fields"]) if rows else []
    return {k: [row["fields"].get(k) for row in rows] for k in keys}


@dataclass
class Round:
    """One generation round: this rank's micro-batches (tensors with advantages and the
    no-grad log-probs attached) and the round's global metrics."""

    index: int
    micro_batches: list[dict[str, Any]]
    metrics: dict[str, float]
    seconds: float
    table: list[dict[str, Any]] = field(default_factory=list)


class OnlineTrainer(Trainer):
    """The shared online-RL step; subclasses give the advantages and the loss."""

    record_kind: ClassVar[str] = "prompt"
    # The loss's items are tokens for dapo: no samples_per_second (generation/* and
    # train/tokens_per_second give the throughput).
    count_unit: ClassVar[str] = "tokens"
    # Whether the old policy's log-probs are needed at generation time beyond μ > 1.
    needs_old_logps_for_reward: ClassVar[bool] = False

    @property
    def rl(self) -> Any:
        return self.cfg.section()

    # ------------------------------------------------------------------ data

    def _load_tokenizer(self) -> None:
        super()._load_tokenizer()
        # Before any weights: a misspelt reward function fails in seconds.
        self.reward_functions = reward_fns.load_reward_functions(self.cfg.reward.functions)

    def encode(self, records: list[dict], *, split: str) -> tuple[list[dict], DataReport]:
        """Prompt rows (`data.prompts`); a prompt leaves room for `max_completion_length`
        tokens within `data.max_length` (longer ones dropped, or, with a truncating
        `data.truncation`, cut at the start)."""
        data = self.cfg.data
        return encode_prompts(
            records, self.tokenizer,
            max_prompt_length=data.max_length - self.rl.max_completion_length,
            truncation="drop" if data.truncation == "drop" else "keep_end",
        )  # fmt: skip

    def _plan_steps(self) -> None:
        """Steps from rounds of prompts; the batch must split into whole groups per rank."""
        plan, rl, train = self.batch_plan, self.rl, self.cfg.train
        group = rl.num_generations
        per_rank = plan.micro_batch * plan.grad_accum
        if per_rank % group:
            raise ConfigError(
                f"task={self.task}: the global batch counts completions, {group} "
                f"({self.task}.num_generations) per prompt, and each rank generates for its own "
                f"prompts, so micro-batch x gradient accumulation ({plan.micro_batch} x "
                f"{plan.grad_accum} = {per_rank} completions per rank) must be a multiple of "
                f"{group}; the batch is {plan.describe()}. Set train.per_device_batch_size to a "
                f"multiple of {group} (or adjust {self.task}.num_generations)"
            )
        self.prompts_per_rank = per_rank // group
        self.prompts_per_round = self.prompts_per_rank * plan.world_size
        rounds = len(self.train_rows) // self.prompts_per_round
        if rounds == 0:
            raise ConfigError(
                f"the training set has {len(self.train_rows)} usable prompts, fewer than one "
                f"step's {self.prompts_per_round} ({plan.describe()} completions / "
                f"{group} per prompt): lower train.per_device_batch_size, or add prompts"
            )
        self.rounds_per_epoch = rounds
        self.steps_per_epoch = rounds * rl.num_iterations
        total = train.max_steps if train.max_steps > 0 else self.steps_per_epoch * train.epochs
        self.total_steps, self.warmup_steps = total, math.ceil(train.warmup_ratio * total)

    # ------------------------------------------------------------------ set-up

    def after_engine(self) -> None:
        rl = self.rl
        self.backend = HFGenerate(
            self.engine, self.tokenizer, media=self.media, chunk=rl.generation_batch_size
        )
        self.reward_names = [name for name, _ in self.reward_functions]
        self.reward_model: RewardModel | None = None
        if self.cfg.reward.model is not None:
            if self.media is not None:
                raise UserError(
                    "reward.model scores text, but the policy is an image-text or audio-text "
                    "model whose prompts carry media; use reward functions for multimodal runs"
                )
            self.reward_model = RewardModel(self, self.cfg.reward.model)
            self.reward_names.append("reward_model")
            self.summary_lines.append(self.reward_model.describe())
        self.reward_weights = self.cfg.reward.weight_list()
        self.reference: reference.Reference | None = None
        if rl.beta > 0:
            self.reference = reference.build(self, offload=False)
            self.summary_lines.append(
                reference.describe(
                    self.reference,
                    lora_enabled=self.cfg.model.lora.enabled,
                    offload=False,
                    precomputed_s=None,
                )  # fmt: skip
            )
        else:
            self.summary_lines.append(f"  reference       none ({self.task}.beta=0)")
        self.summary_lines += [
            f"  rewards         {', '.join(f'{n} x{w:g}' for n, w in zip(self.reward_names, self.reward_weights, strict=True))}",
            f"  generation      {rl.num_generations} completions per prompt, "
            f"{self.prompts_per_round} prompts per step ({self.prompts_per_rank} per rank), "
            f"at most {rl.max_completion_length} tokens, temperature {rl.temperature:g}, "
            f"top_p {rl.top_p:g}; HF generate"
            + (", ZeRO-3 parameters gathered once per round" if self.engine.zero_stage == 3 else ""),
        ]  # fmt: skip
        self._round: Round | None = None
        # Text models whose attention takes a dense mask (`data.layouts`).
        self.share_prefix = self.cfg.speed.share_prefix and supports_shared_prompt(
            self.engine.module.config
        )
        if self.share_prefix:
            self.summary_lines.append(
                "  rows            the completions of a prompt in a micro-batch as one row "
                "prompt + completions (speed.share_prefix)"
            )

    # ------------------------------------------------------------------ a round

    def _round_prompts(self, round_index: int) -> list[int]:
        """Training prompt rows of a round on this rank."""
        epoch, in_epoch = divmod(round_index, self.rounds_per_epoch)
        order = step_indices(
            len(self.train_rows), global_batch=self.prompts_per_round, seed=self.cfg.train.seed,
            epoch=epoch, step=in_epoch,
        )  # fmt: skip
        rank = self.dist.rank
        return order[rank * self.prompts_per_rank : (rank + 1) * self.prompts_per_rank]

    def _micro_batches_for_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        round_index = step // self.rl.num_iterations
        if self._round is None or self._round.index != round_index:
            self._round = self._rollout(round_index, step)
        return self._round.micro_batches

    def _sample_rows(self, prompt_rows: list[int], completions: Any) -> list[dict]:
        group = self.rl.num_generations
        samples = []
        for k, (ids, cut) in enumerate(zip(completions.ids, completions.truncated, strict=True)):
            row = self.train_rows[prompt_rows[k // group]]
            sample = {"prompt_ids": row["prompt_ids"], "completion_ids": ids, "truncated": cut,
                      "row": prompt_rows[k // group]}  # fmt: skip
            sample.update({key: row[key] for key in MEDIA_KEYS if key in row})
            samples.append(sample)
        return samples

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """prompt + completion per row, right-padded; labels on the completion only; the loss
        mask [B, C] (completion tokens; none of a truncated one when masked)."""
        pad = self.tokenizer.pad_token_id
        width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
        longest = max(len(r["completion_ids"]) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), max(longest, 1)), dtype=torch.float32)
        drop = self.rl.mask_truncated_completions
        for b, row in enumerate(rows):
            prompt, completion = row["prompt_ids"], row["completion_ids"]
            ids = [*prompt, *completion]
            input_ids[b, : len(ids)] = torch.tensor(ids)
            attention[b, : len(ids)] = 1
            labels[b, len(prompt) : len(ids)] = torch.tensor(completion, dtype=torch.long)
            if not (drop and row["truncated"]):
                mask[b, : len(completion)] = 1.0
        batch = {"input_ids": input_ids, "attention_mask": attention, "labels": labels,
                 "loss_mask": mask,
                 "truncated": torch.tensor([r["truncated"] for r in rows])}  # fmt: skip
        if self.share_prefix:
            batch.update({SHARED + k: v for k, v in self._shared_layout(rows).items()})
        return batch

    def _shared_layout(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """The micro-batch's completions of one prompt as one row `prompt + c_1 + … + c_k`
        (`data.layouts`): the prompt, most of each sequence in chat data, runs once per group
        instead of once per completion. Groups are consecutive rows, so the scored tokens come
        out in row order (what `_token_logps` relies on)."""
        groups: list[PrefixGroup] = []
        for index, row in enumerate(rows):
            if groups and rows[index - 1]["row"] == row["row"]:
                groups[-1].suffixes.append(list(row["completion_ids"]))
                groups[-1].suffix_labels.append(list(row["completion_ids"]))
                groups[-1].sequence_ids.append(index)
            else:
                ids = list(row["completion_ids"])
                groups.append(PrefixGroup(list(row["prompt_ids"]), [ids], [list(ids)], [index]))
        return collate_shared_prefix(
            groups, num_sequences=len(rows), pad_id=self.tokenizer.pad_token_id,
            additive_mask_dtype=mask_dtype(self.engine.module),
        )  # fmt: skip

    def collate_with_media(self, rows: list[dict]) -> dict[str, Any]:
        batch = self.collate(rows)
        if self.media is not None:
            batch = self.media.attach(batch, rows, copies=1)
        return batch

    def _token_logps(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """[B, C] per-token completion log-probs, padded to the loss mask's width; from the
        shared-prompt layout where the batch has one."""
        only = self.completion_only_logits
        width = batch["loss_mask"].shape[1]
        shared = {k.removeprefix(SHARED): v for k, v in batch.items() if k.startswith(SHARED)}
        if shared:
            flat = shared_prefix_token_logps(model, shared, completion_only=only)
            lengths = torch.bincount(
                shared["score_sequences"], minlength=int(shared["num_sequences"])
            )
            slots = (
                torch.arange(width, device=flat.device)[None, :] < lengths.to(flat.device)[:, None]
            )
            out = torch.zeros(lengths.shape[0], width, dtype=flat.dtype, device=flat.device)
            return out.masked_scatter(slots, flat)
        logps = completion_token_logps(model, batch, completion_only=only)
        if logps.shape[1] < width:
            logps = torch.nn.functional.pad(logps, (0, width - logps.shape[1]))
        return logps

    @torch.no_grad()
    def _no_grad_passes(self, batch: dict[str, Any]) -> None:
        rl = self.rl
        if rl.num_iterations > 1 or (self.needs_old_logps_for_reward and rl.beta > 0):
            self.engine.eval()
            batch["old_logps"] = self._token_logps(self.engine, batch).detach()
            self.engine.train()
        if self.reference is not None:
            batch["ref_logps"] = self._token_logps(self.reference, batch).detach()

    def _rollout(self, round_index: int, step: int) -> Round:
        """Generate, score and compute advantages for one round (collective)."""
        rl, plan = self.rl, self.batch_plan
        start = time.perf_counter()
        prompt_rows = self._round_prompts(round_index)
        prompts = [self.train_rows[i] for i in prompt_rows]
        seeds = [prompt_seed(self.cfg.train.seed, round_index, i) for i in prompt_rows]
        sampling = Sampling(rl.max_completion_length, temperature=rl.temperature, top_p=rl.top_p)
        completions = self.backend.generate(prompts, rl.num_generations, sampling, seeds)
        samples = self._sample_rows(prompt_rows, completions)
        micro_batches = [
            self._to_device(self.collate_with_media(samples[m * plan.micro_batch :
                                                            (m + 1) * plan.micro_batch]))
            for m in range(plan.grad_accum)
        ]  # fmt: skip
        for batch in micro_batches:
            self._no_grad_passes(batch)
        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        total, per_function = self._score(
            [self.train_rows[s["row"]] for s in samples], texts,
            row_ids=[self.train_rows[s["row"]]["source_row"] for s in samples], step=step,
        )  # fmt: skip
        local = self._reward_for_advantages(total, micro_batches)
        gathered = torch.tensor(
            [v for part in comm.all_gather_objects(local) for v in part], dtype=torch.float32
        )
        advantages = self.advantages(gathered)
        mine = advantages.view(plan.world_size, -1)[self.dist.rank]
        for m, batch in enumerate(micro_batches):
            part = mine[m * plan.micro_batch : (m + 1) * plan.micro_batch]
            batch["advantages"] = part.to(batch["loss_mask"].device)
        metrics = self._round_metrics(
            total, per_function, completions, samples, advantages, gathered
        )
        table = []
        every = self.cfg.logging.completions_every
        if every and (step + 1) % every == 0:
            shown = self.cfg.logging.completions_shown
            table = [
                {"prompt": self.tokenizer.decode(s["prompt_ids"], skip_special_tokens=True),
                 "completion": text, "reward": r, "advantage": float(a)}
                for s, text, r, a in zip(samples[:shown], texts, total, mine.tolist(), strict=False)
            ]  # fmt: skip
        return Round(round_index, micro_batches, metrics, time.perf_counter() - start, table)

    def _reward_for_advantages(
        self, total: list[float], micro_batches: list[dict[str, Any]]
    ) -> list[float]:
        """The reward the advantages are computed from (RLOO subtracts its KL penalty)."""
        return total

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ rewards

    def _score(
        self, rows: list[dict], texts: list[str], *, row_ids: list[Any], step: int | None
    ) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted total per completion (NaN: no reward had an opinion), each reward's
        values). Every rank learns whether any rank's reward function failed, and all stop."""
        error: str | None = None
        total: list[float] = []
        per: dict[str, list[float]] = {}
        prompts = [row["prompt"] for row in rows]
        # The reward model first: its forward is collective under ZeRO-3, so every rank runs
        # it, also when a reward function on this rank is about to fail.
        scores = self.reward_model.score(prompts, texts) if self.reward_model else None
        try:
            count = len(self.reward_functions)
            total, per = [math.nan] * len(texts), {}
            if count:
                scored, by_name = reward_fns.score_completions(
                    self.reward_functions, self.reward_weights[:count], prompts=prompts,
                    completions=texts, fields=row_fields(rows), row_ids=row_ids,
                )  # fmt: skip
                total, per = scored.tolist(), {k: v.tolist() for k, v in by_name.items()}
            if scores is not None:
                per["reward_model"] = scores
                weight = self.reward_weights[count]
                total = [s * weight if math.isnan(t) else t + s * weight
                         for t, s in zip(total, scores, strict=True)]  # fmt: skip
        except reward_fns.RewardError as err:
            error = str(err)
        errors = [e for e in comm.all_gather_objects(error) if e]
        if errors:
            if step is None:
                raise UserError(f"reward in the held-out evaluation failed: {errors[0]}")
            good = checkpoints.last_complete(self.output_dir / "checkpoints", self.run_id)
            raise UserError(
                f"reward in step {step + 1} failed, before that step's optimizer update: "
                f"{errors[0]}"
                + (
                    f"\nThe last complete checkpoint, {good}, is intact (resume=auto)."
                    if good
                    else "\nNo checkpoint was written by this run yet."
                )  # fmt: skip
            )
        return list(total), per

    # ------------------------------------------------------------------ metrics

    def _round_metrics(
        self, total: list[float], per_function: dict[str, list[float]], completions: Any,
        samples: list[dict], advantages: torch.Tensor, gathered: torch.Tensor,
    ) -> dict[str, float]:  # fmt: skip
        """The round's global figures (TRL's names where TRL logs the same thing)."""
        from align_anything.losses import group_reward_std, nanstd

        group = self.rl.num_generations
        rewards = torch.tensor(
            [v for part in comm.all_gather_objects(total) for v in part], dtype=torch.float64
        )
        lengths = [len(ids) for ids in completions.ids]
        stats = comm.all_gather_objects(
            (
                lengths,
                list(completions.truncated),
                completions.seconds,
                {k: list(v) for k, v in per_function.items()},
            )  # fmt: skip
        )
        all_lengths = [n for s in stats for n in s[0]]
        all_cut = [c for s in stats for c in s[1]]
        seconds = max(s[2] for s in stats)
        metrics = {
            "reward": float(torch.nanmean(rewards)),
            "reward_std": float(nanstd(rewards)),
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
        return {k: v for k, v in metrics.items() if math.isfinite(v)}

    def train_step(self) -> StepResult:
        """The base step (generation happens in `_micro_batches_for_step`), plus the round's
        global metrics and the training throughput without generation."""
        start = time.perf_counter()
        fresh = self._round is None or self._round.index != self.step // self.rl.num_iterations
        result = super().train_step()
        assert self._round is not None
        seconds = time.perf_counter() - start - (self._round.seconds if fresh else 0.0)
        metrics = dict(self._round.metrics)
        metrics["train/tokens_per_second"] = result.tokens / max(seconds, 1e-9)
        for key, value in metrics.items():
            result.sums[key] = value * result.items
        if self._round.table and self.dist.is_main and fresh:
            completions_table(
                self._round.table, step=self.step, logger=self.logger,
                console="console" in self.cfg.logging.backends,
            )  # fmt: skip
        return result

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Token means (kl, clip ratios) from their sums and the token count."""
        tokens = metrics.pop("count/tokens", None)
        for key in list(metrics):
            if key.startswith("tokens/"):
                value = metrics.pop(key)
                if tokens:
                    metrics[key.removeprefix("tokens/")] = value / tokens
        return metrics

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, *, label: str) -> dict[str, float]:
        """Greedy answers to the first `eval_samples` held-out prompts: the mean reward (total
        and per reward) and, for built-in data, the share passing the generation check."""
        count = min(self.rl.eval_samples, len(self.eval_rows))
        if not count:
            return {}
        rank, world = self.dist.rank, self.dist.world_size
        indices = list(range(rank, count, world))
        rows = [self.eval_rows[i] for i in indices]
        sampling = Sampling(self.rl.max_completion_length, greedy=True)
        completions = self.backend.generate(rows, 1, sampling, [0] * len(rows))
        texts = self.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
        if self.reward_model is not None:
            # Reward-model forwards are collective under ZeRO-3: equal calls on every rank.
            self.reward_model.pad_calls_to(math.ceil(count / world))
        total, per = self._score(rows, texts, row_ids=[r["source_row"] for r in rows], step=None)
        check = generation.property_check(self.cfg.data.eval_path or self.cfg.data.path)
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
