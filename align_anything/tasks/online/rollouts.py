"""The online RL tasks' step source: `Rollouts` generates each round, scores it, attaches the
no-grad passes and the advantages, and serves it as optimizer steps; it keeps a round inside a
checkpoint. `build_online` puts an `OnlineRL` task (`tasks/online.py`) and its rollouts
together.

A round serves E × M optimizer steps: E passes over it, each cut into M mini-batches of one
global batch (GRPO / RLOO: E = `num_iterations` μ, M = 1, every step the whole round; PPO:
`num_ppo_epochs` × `num_mini_batches`, each pass a seeded shuffle of the round's completions,
so every step after the first is off-policy). One round, with E = M = 1:

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

With M > 1 the round's completions and what was attached to them (log-probs, values,
advantages) are all-gathered after it (a few floats per token), so each step's mini-batch is the
same set of completions on any number of ranks. A checkpoint written inside a round (E·M > 1)
holds the round (`rollout.json` / `rollout.safetensors`: completions, attached tensors, round
metrics), and a run resumed from it continues that round, not a new one from the resumed
weights: the same steps as the run that was never stopped.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from align_anything import atomic
from align_anything.backend import distributed as comm
from align_anything.data.media import MEDIA_KEYS
from align_anything.errors import UserError
from align_anything.families.language import layouts, reference
from align_anything.families.language.encode import IGNORE_INDEX
from align_anything.families.language.family import completion_only_logits, fresh_model_loader
from align_anything.generation.rollout import (
    Completions,
    GenerationBackend,
    HFGenerate,
    Sampling,
    stop_token_ids,
)
from align_anything.losses import (
    group_reward_std,
    logp_mismatch,
    nanstd,
    truncated_importance_weights,
)
from align_anything.rewards.model import RewardModel
from align_anything.tasks.online.common import (
    ATTACHED,
    Algorithm,
    OnlineRL,
    Rewards,
    RolloutBatch,
    RoundSizes,
    failed_reward,
    prompt_seed,
    reward_functions,
    round_sizes,
)
from align_anything.training import checkpoints
from align_anything.training.batching import step_indices, to_device
from align_anything.training.run import Run
from align_anything.training.task import StepBatches

# ---------------------------------------------------------------------------- rounds

# A checkpoint written inside a round holds it in these two files (rank 0 writes them).
ROLLOUT_JSON = "rollout.json"
ROLLOUT_TENSORS = "rollout.safetensors"


@dataclass
class Round:
    """One generation round: this rank's micro-batches (with advantages and the no-grad passes
    attached; M = 1), or the whole round's completions of every rank with what was attached to
    each (`samples`, in round order; M > 1, re-cut into each step's mini-batch), the round's
    global metrics, the time it took, a completions table."""

    index: int
    batches: list[RolloutBatch]
    metrics: dict[str, float]
    seconds: float
    table: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] | None = None
    rows: list[int] = field(default_factory=list)  # each of `batches`' completions' prompt row


def split_batch(batch: RolloutBatch, rows: list[int]) -> list[dict[str, Any]]:
    """A round batch as one record per completion: its prompt row, ids, truncation and each
    attached tensor (`ATTACHED`; per-token ones cut to the completion's length), on the CPU.
    `rows`: the batch's prompt rows; ids from its labels (the completion tokens)."""
    assert batch.lengths is not None
    records = []
    labels = batch.rows.labels
    for b, row in enumerate(rows):
        length = int(batch.lengths[b])
        ids = labels[b][labels[b] != IGNORE_INDEX].tolist()
        record: dict[str, Any] = {"row": row, "completion_ids": ids[:length],
                                  "truncated": bool(batch.truncated[b])}  # fmt: skip
        for name in ATTACHED:
            value = getattr(batch, name)
            if value is not None:
                record[name] = (value[b, :length] if value.dim() == 2 else value[b]).cpu()
        records.append(record)
    return records


def attach_records(batch: RolloutBatch, records: list[dict[str, Any]]) -> RolloutBatch:
    """`batch` (collated from `records`' completions) with their attached tensors, per-token
    ones right-padded with 0 to the batch's width: the tensors the round attached."""
    width = batch.loss_mask.shape[1]
    for name in ATTACHED:
        if name not in records[0]:
            continue
        values = [r[name] for r in records]
        if values[0].dim() == 0:
            setattr(batch, name, torch.stack(values))
        else:
            padded = torch.zeros(len(values), width, dtype=values[0].dtype)
            for b, value in enumerate(values):
                padded[b, : value.shape[0]] = value
            setattr(batch, name, padded)
    return batch


class Rollouts:
    """The online step source: a generation round every E × M steps (`RoundSizes`), served as
    the micro-batches of each of its steps: the whole round each step when M = 1 (GRPO and
    RLOO's μ passes), else the mini-batch of the step's pass (a seeded shuffle of the round's
    completions per pass, cut into M global batches)."""

    def __init__(self, run: Run, task: OnlineRL, reference_model: Any, sizes: RoundSizes) -> None:
        self.task = task
        self.reference = reference_model
        self.sizes = sizes
        self.rows = run.data.train
        self.batch = run.ds_plan.batch
        self.rank = run.dist.rank
        self.world = run.dist.world_size
        self.seed = run.cfg.train.seed
        self.device = run.policy.device
        self.logging = run.cfg.logging
        self.checkpoints = (run.output.path / "checkpoints", run.output.run_id)
        self.current: Round | None = None
        # A checkpoint written inside a round holds it: the first step continues that round.
        self.resume_dir = run.output.resume_dir
        self.importance = run.cfg.rollout  # truncated importance sampling (rollout.*)

    def step(self, step: int) -> StepBatches:
        round_index, within = divmod(step, self.sizes.steps_per_round)
        fresh = self.current is None or self.current.index != round_index
        if fresh:
            self.current = self.restored(round_index) or self.rollout(round_index, step)
            fresh = self.current.seconds > 0  # a restored round was shown when it was generated
        assert self.current is not None
        batches = (
            self.current.batches if self.current.samples is None
            else self.mini_batch(self.current, within)
        )  # fmt: skip
        self.task.algorithm.for_step(batches, step)
        return StepBatches(
            batches, metrics=dict(self.current.metrics),
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

    def sample(self, row_index: int, ids: list[int], truncated: bool) -> dict[str, Any]:
        """One completion as `OnlineRL.collate` reads it: its prompt row's ids (and media)."""
        row = self.rows[row_index]
        sample = {"prompt_ids": row["prompt_ids"], "completion_ids": ids, "truncated": truncated,
                  "row": row_index}  # fmt: skip
        sample.update({key: row[key] for key in MEDIA_KEYS if key in row})
        return sample

    def samples(self, prompt_rows: list[int], completions: Completions) -> list[dict]:
        group = self.task.rl.num_generations
        return [
            self.sample(prompt_rows[k // group], ids, cut)
            for k, (ids, cut) in enumerate(zip(completions.ids, completions.truncated, strict=True))
        ]

    def micro_batches(self, records: list[dict[str, Any]]) -> list[RolloutBatch]:
        """Records (`split_batch`'s) in micro-batches on the device, attached tensors back on."""
        micro = self.batch.micro_batch
        batches = []
        for start in range(0, len(records), micro):
            part = records[start : start + micro]
            samples = [self.sample(r["row"], r["completion_ids"], r["truncated"]) for r in part]
            batch = attach_records(self.task.collate(samples), part)
            batches.append(to_device(batch, self.device))
        return batches

    def mini_batch(self, current: Round, within: int) -> list[RolloutBatch]:
        """This rank's micro-batches of the round's pass `within // M`, mini-batch
        `within % M`: a seeded permutation of the round's completions per pass (the same on
        every rank and world size), cut into global batches, each split over the ranks."""
        assert current.samples is not None
        epoch, part = divmod(within, self.sizes.mini_batches)
        generator = torch.Generator().manual_seed(
            prompt_seed(self.seed, current.index, epoch) ^ 0x5EED
        )
        order = torch.randperm(len(current.samples), generator=generator).tolist()
        plan = self.batch
        chosen = order[part * plan.global_batch : (part + 1) * plan.global_batch]
        per_rank = plan.micro_batch * plan.grad_accum
        mine = chosen[self.rank * per_rank : (self.rank + 1) * per_rank]
        return self.micro_batches([current.samples[i] for i in mine])

    @torch.no_grad()
    def no_grad_passes(self, batch: RolloutBatch) -> None:
        task, algorithm = self.task, self.task.algorithm
        old = algorithm.needs_old_logps()
        if old or batch.engine_logps is not None:
            task.policy.eval()
            if algorithm.logs_entropy:
                logps, entropy = task.token_logps_and_entropy(task.policy, batch)
                batch.entropy = entropy
            else:
                logps = task.token_logps(task.policy, batch)
            logps = logps.detach()
            task.policy.train()
            batch.old_logps = logps if old else None
            # An engine sampled the tokens: the trainer's log-probs at generation time, to
            # compare (and, with rollout.importance_sampling, correct) the engine's against.
            batch.trainer_logps = logps if batch.engine_logps is not None else None
        if self.reference is not None:
            batch.ref_logps = task.token_logps(self.reference, batch).detach()
        algorithm.extra_passes(batch)

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
            to_device(task.collate(samples[m : m + micro]), self.device)
            for m in range(0, len(samples), micro)
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
        shown, advantage_metrics = task.algorithm.attach_advantages(
            batches, gathered, rank=self.rank, world=self.world
        )
        metrics = (
            round_metrics(total, per_function, completions, group=rl.num_generations)
            | advantage_metrics
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
            shown_rows = self.logging.completions_shown
            table = [
                {"prompt": task.tokenizer.decode(s["prompt_ids"], skip_special_tokens=True),
                 "completion": text, "reward": r, "advantage": float(a)}
                for s, text, r, a in zip(samples[:shown_rows], texts, total, shown, strict=False)
            ]  # fmt: skip
        rows, records = [s["row"] for s in samples], None
        if self.sizes.mini_batches > 1:
            # Every rank's completions with what was attached, in round order, so that each
            # step's mini-batch is the same set on any number of ranks.
            records, batches = self.gathered_records(batches, rows), []
        seconds = max(time.perf_counter() - start, 1e-9)
        return Round(round_index, batches, metrics, seconds, table, records, rows)

    def gathered_records(
        self, batches: list[RolloutBatch], rows: list[int]
    ) -> list[dict[str, Any]]:
        """Every rank's completions of the round as `split_batch` records, in round order
        (rank-major: the ranks' prompts are consecutive slices of the round's). Collective."""
        local: list[dict[str, Any]] = []
        start = 0
        for batch in batches:
            count = batch.loss_mask.shape[0]
            local += split_batch(batch, rows[start : start + count])
            start += count
        return [record for part in comm.all_gather_objects(local) for record in part]

    # ------------------------------------------------------------------ inside a checkpoint

    def save(self, folder: Path, step: int) -> None:
        """Inside a round (E × M > 1 and `step` not at its end): the round, so that a resume
        continues it instead of generating a new one from the resumed weights. Rank 0 writes
        `rollout.json` (round index, completions, metrics) and `rollout.safetensors` (what was
        attached to each completion). Collective."""
        current = self.current
        if current is None or step % self.sizes.steps_per_round == 0:
            return
        records = current.samples
        if records is None:
            records = self.gathered_records(current.batches, current.rows)
        if self.rank != 0:
            return
        names = [n for n in ATTACHED if n in records[0]]
        tensors = {
            name: torch.cat([r[name].reshape(-1) for r in records]).contiguous() for name in names
        }
        meta = {
            "round": current.index, "metrics": current.metrics, "attached": names,
            "per_token": [n for n in names if records[0][n].dim() == 1],
            "completions": [[r["row"], r["completion_ids"], r["truncated"]] for r in records],
        }  # fmt: skip
        save_file(tensors, str(folder / ROLLOUT_TENSORS))
        atomic.write_text(folder / ROLLOUT_JSON, json.dumps(meta))

    def restored(self, round_index: int) -> Round | None:
        """The round a resumed run's checkpoint holds, if it holds this one (asked once: the
        resumed run's first step)."""
        folder, self.resume_dir = self.resume_dir, None
        if folder is None or not (folder / ROLLOUT_JSON).is_file():
            return None
        meta = json.loads((folder / ROLLOUT_JSON).read_text())
        if meta["round"] != round_index:
            return None
        tensors = load_file(str(folder / ROLLOUT_TENSORS))
        offsets = dict.fromkeys(meta["attached"], 0)
        records: list[dict[str, Any]] = []
        for row, ids, truncated in meta["completions"]:
            record: dict[str, Any] = {"row": row, "completion_ids": ids, "truncated": truncated}
            for name in meta["attached"]:
                start = offsets[name]
                if name in meta["per_token"]:  # one value per completion token
                    record[name], offsets[name] = (
                        tensors[name][start : start + len(ids)],
                        start + len(ids),
                    )
                else:  # one per completion
                    record[name], offsets[name] = tensors[name][start], start + 1
            records.append(record)
        if self.sizes.mini_batches > 1:
            return Round(round_index, [], meta["metrics"], 0.0, [], records)
        # M = 1: this rank's completions, the slice of the round its prompts give (rank-major).
        per_rank = len(records) // self.world
        mine = records[self.rank * per_rank : (self.rank + 1) * per_rank]
        rows = [r["row"] for r in mine]
        return Round(round_index, self.micro_batches(mine), meta["metrics"], 0.0, rows=rows)

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
    total: list[float], per_function: dict[str, list[float]], completions: Completions, *,
    group: int,
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
        "completions/mean_length": sum(all_lengths) / len(all_lengths),
        "completions/max_length": float(max(all_lengths)),
        "completions/min_length": float(min(all_lengths)),
        "completions/clipped_ratio": sum(all_cut) / len(all_cut),
        "generation/tokens_per_second": sum(all_lengths) / max(seconds, 1e-9),
        "generation/seconds": seconds,
    }
    if group > 1:  # a group of one has no spread
        metrics["frac_reward_zero_std"] = float(
            (group_reward_std(rewards, group) == 0).double().mean()
        )
    for name in per_function:
        values = torch.tensor([v for s in stats for v in s[3][name]], dtype=torch.float64)
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(values))
        metrics[f"rewards/{name}/std"] = float(nanstd(values))
    if bool(none.all()):
        metrics.pop("frac_reward_zero_std", None)
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


# ---------------------------------------------------------------------------- build


def generation_backend(run: Run) -> GenerationBackend:
    """rollout.backend: HF `generate` on the policy, or a vLLM engine (colocated or a server;
    `generation/vllm.py`), with the same stop tokens."""
    cfg, policy = run.cfg, run.policy
    stop = stop_token_ids(policy.module, run.model.tokenizer)
    if cfg.rollout.backend == "vllm":
        from align_anything.generation import vllm as rollout_vllm

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
        reward_functions(cfg),
        cfg.reward.weight_list(),
        model,
        timeout_s=cfg.reward.timeout_seconds,
        media=run.model.media,
    )
    frozen = None
    if rl.uses_reference():
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
        weight = "kl_coef" if cfg.task == "ppo" else "beta"
        run.summary.append(f"  reference       none ({cfg.task}.{weight}=0)")
    sizes = round_sizes(cfg, len(run.data.train), run.ds_plan.batch)
    per = (
        "step" if sizes.steps_per_round == 1 else
        f"round, served over {sizes.steps_per_round} steps ({sizes.epochs} passes x "
        f"{sizes.mini_batches} mini-batches)"
    )  # fmt: skip
    run.summary += [
        rewards.describe(),
        f"  generation      {rl.num_generations} completions per prompt, "
        f"{sizes.prompts_per_round} prompts per {per} ({sizes.prompts_per_rank} per rank), "
        f"at most {rl.max_completion_length} tokens, temperature {rl.temperature:g}, "
        f"top_p {rl.top_p:g}, top_k {rl.top_k}",
        f"  generator       {generator.describe()}",
    ]  # fmt: skip
    # Text models whose attention takes a dense mask (`data.layouts`), and image-text models
    # whose images enter at their placeholders (the prompt's images then run once too).
    config = policy.module.config
    share_prefix = cfg.speed.share_prefix and (
        layouts.supports_shared_prompt(config)
        if media is None
        else layouts.supports_shared_media_prompt(config)
    )
    if share_prefix:
        run.summary.append(
            "  rows            the completions of a prompt in a micro-batch as one row "
            "prompt + completions (speed.share_prefix)"
            + (", the prompt's media once" if media is not None else "")
        )
    task = OnlineRL(
        algorithm=algorithm, rl=rl, policy=policy, generator=generator, rewards=rewards,
        tokenizer=run.model.tokenizer, media=media, eval_rows=run.data.eval,
        eval_path=cfg.data.eval_path or cfg.data.path,
        completion_only=completion_only_logits(cfg, policy), share_prefix=share_prefix,
        mask_dtype=layouts.mask_dtype(policy.module), rank=run.dist.rank, world=run.dist.world_size,
        name=cfg.task,
        eval_off=f"{cfg.task}.eval_samples=0 switches the held-out evaluation off"
        if rl.eval_samples == 0 else None,
    )  # fmt: skip
    return task, Rollouts(run, task, frozen, sizes)
