"""Kahneman-Tversky optimisation (KTO, Ethayarajh et al. 2024) from unpaired rows: one prompt,
one completion, and whether it is desirable (thumbs up) or undesirable (thumbs down).
Preference pairs work too: each pair is split into a desirable and an undesirable row.

The loss of a row (`losses.kto_loss`) compares its implied reward r = log π(y|x) − log π_ref(y|x)
(log-probs summed over the completion tokens found on the ids fed to the model) with a
reference point z₀, an estimate of KL(π ‖ π_ref):

- **Which completions the KL pairs.** Within each optimizer step's global batch, taken in the
  order the seeded permutation draws it (`batching.step_indices`), the prompt of row k is
  paired with the completion of row k − 1, and the first row's prompt with the last row's
  completion: TRL's rotation of completions by one, over the global batch instead of each
  device's batch, so the KL completions are the same set as the batch's own completions (the
  KTO paper's recommendation) and the pairs do not depend on how the batch is split over ranks
  and micro-batches. A KL completion is cut to fit `data.max_length` after its prompt. The
  held-out rows are one batch for this: row k's prompt with row k − 1's completion, cyclically.
- **How z₀ is computed.** Without gradient, before any loss of the step: the policy's (and the
  reference's) log-probs of every pair of the global batch, on every rank and every
  micro-batch, summed in one all-reduce; z₀ = max(0, mean of policy − reference). So z₀ is the
  same number on every rank and for every micro-batch of a step, also under gradient
  accumulation, and 2 ranks give the numbers of 1.
- **Normalisation.** A micro-batch's loss is its summed weighted row losses divided by
  (global rows / (world × grad_accum)) (see `training.task.Task.loss`): the gradient is that of
  the mean over the global batch, as TRL's mean over its batch.

The reference is the model as loaded: precomputed in one no-grad pass over every row and KL
pair the planned steps use (default), or a frozen model (`kto.reference=model`; with LoRA, the
policy with adapters disabled).

Shared prefixes (`speed.share_prefix`, `collate_rows`): KTO's rows rarely share a prompt, but
every row of a chat model starts with the same template header (SmolLM2: a ~30-token system
prompt), so the policy's trained sequences of a micro-batch run as one row `common prefix +
rest_1 + …`, as SFT's do, and so do its KL sequences (two passes: the KL pass has no backward,
and one row holding both would run the backward pass over the KL tokens too). Where the common
prefix is too short to pay (long conversations), the sequences are packed best-fit into fewer
rows no wider than the longest instead of each padded to it. The reference has no backward:
its 2B sequences run as one such row, or each row's completion and KL completion after their
one prompt, short groups sharing a row.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from align_anything.backend import distributed as comm
from align_anything.config import RunConfig
from align_anything.errors import ConfigError, UserError
from align_anything.families.language import IGNORE_INDEX, collate_unpaired, reference
from align_anything.families.language import evaluation as generation
from align_anything.families.language.batches import Rows, SharedPrefix
from align_anything.families.language.encode import Encoding
from align_anything.families.language.family import (
    LANGUAGE_MODELS,
    ModelSide,
    completion_only_logits,
    fresh_model_loader,
)
from align_anything.families.language.forward import sequence_logps
from align_anything.families.language.layouts import (
    collate_packed_sft,
    collate_shared_prompt,
    collate_shared_sft,
    mask_dtype,
    supports_shared_prompt,
)
from align_anything.losses import kto_kl_reference, kto_loss
from align_anything.training.batching import step_indices, to_device
from align_anything.training.run import Data, Run, Schedule
from align_anything.training.sources import RowBatches, row_batches, row_schedule
from align_anything.training.task import LossOutput, Task, TaskSpec

# A row's precomputed reference log-probs: of its own completion, of its KL completion.
REF_KEYS = ("ref_logps", "ref_kl_logps")
# The KTO paper's recommended range for λ_D·n_D / (λ_U·n_U) (eq. 8).
BALANCE_RANGE = (1.0, 4.0 / 3.0)


def kl_completion(row: dict, other: dict, *, max_length: int) -> list[int]:
    """The completion of `other` as the KL completion of `row`'s prompt, cut to fit
    `max_length` after it."""
    return list(other["completion_ids"][: max_length - len(row["prompt_ids"])])


def rotated_partners(order: list[int]) -> dict[int, int]:
    """Row -> the row whose completion its prompt is paired with: within `order`, the one before
    it, and for the first row the last (completions rotated by one)."""
    return {row: order[k - 1] for k, row in enumerate(order)}


def balance_note(desirable: int, undesirable: int, *, desirable_weight: float,
                 undesirable_weight: float) -> list[str]:  # fmt: skip
    """Start-up summary lines on the mix of desirable and undesirable training rows and, when
    they are not balanced, the weights the KTO paper recommends for that ratio: λ_D·n_D /
    (λ_U·n_U) in [1, 4/3] (eq. 8), i.e. either weight in its range with the other as set."""
    line = f"  balance         {desirable} desirable, {undesirable} undesirable rows"
    if desirable == undesirable:
        return [line + f" (balanced; weights {desirable_weight:g} / {undesirable_weight:g})"]
    if not desirable or not undesirable:
        return [line + ": one kind only; the loss still trains, without the other's signal"]
    low, high = BALANCE_RANGE
    ratio = desirable_weight * desirable / (undesirable_weight * undesirable)
    d_range = (low * undesirable_weight * undesirable / desirable,
               high * undesirable_weight * undesirable / desirable)  # fmt: skip
    u_range = (desirable_weight * desirable / (high * undesirable),
               desirable_weight * desirable / (low * undesirable))  # fmt: skip
    verdict = "in" if low <= ratio <= high else "outside"
    return [
        line + f" (ratio {desirable / undesirable:.2f}): λ_D·n_D / (λ_U·n_U) = {ratio:.2f}, "
        f"{verdict} the KTO paper's recommended [1, 4/3]",
        f"                  recommended: kto.desirable_weight in [{d_range[0]:.2f}, "
        f"{d_range[1]:.2f}] with kto.undesirable_weight={undesirable_weight:g}, or "
        f"kto.undesirable_weight in [{u_range[0]:.2f}, {u_range[1]:.2f}] with "
        f"kto.desirable_weight={desirable_weight:g}",
    ]


def _sequences(rows: list[dict], completion: str) -> list[dict]:
    """Each row's prompt + `completion` as an SFT-style row (`input_ids`, `labels`)."""
    return [
        {"input_ids": [*r["prompt_ids"], *r[completion]],
         "labels": [IGNORE_INDEX] * len(r["prompt_ids"]) + list(r[completion])}
        for r in rows
    ]  # fmt: skip


@dataclass
class KTOBatch:
    """B unpaired rows: `own`, each row's prompt + completion (the trained sequences); `kl`,
    each row's prompt + its KL completion (no gradient); whether each is desirable; and either
    the reference's precomputed log-probs of both (`ref_logps`, `ref_kl_logps`) or, when a
    reference model runs, the layout it runs (`reference_pass`: the 2B sequences, own then KL,
    as one shared-prefix row; None: it runs `own` and `kl`)."""

    own: Rows | SharedPrefix
    kl: Rows | SharedPrefix
    desirable: Tensor
    reference_pass: SharedPrefix | None = None
    ref_logps: Tensor | None = None
    ref_kl_logps: Tensor | None = None


def collate_rows(
    rows: list[dict], *, pad_id: int, share_prefix: bool, additive_mask_dtype: torch.dtype | None
) -> KTOBatch:
    """A KTO batch (rows with `kl_ids`, and their precomputed reference log-probs when they
    carry them). With `share_prefix`, the layouts that compute a shared prefix once
    (`data.layouts`), where they pay: the trained sequences as one row `common prefix +
    rest_1 + …` (the chat template's system prompt and header are common to every row) and
    the KL sequences likewise, each where the common prefix saves at least a quarter of the
    tokens (`collate_shared_sft`'s rule), else packed best-fit into fewer rows no wider than
    the longest (`collate_packed_sft`, as SFT's); and, for a reference to run (rows without
    precomputed log-probs), the 2B reference sequences as one such row, or else each row's
    two after its one prompt, short groups sharing a row."""
    layout = {"pad_id": pad_id, "additive_mask_dtype": additive_mask_dtype}
    parts: list[Rows | SharedPrefix] = []
    for completion in ("completion_ids", "kl_ids"):
        shared = None
        if share_prefix:
            sequences = _sequences(rows, completion)
            shared = collate_shared_sft(sequences, **layout) or collate_packed_sft(
                sequences, **layout
            )
        parts.append(shared or collate_unpaired(rows, pad_id=pad_id, completion=completion))
    desirable = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
    batch = KTOBatch(parts[0], parts[1], desirable)
    if all(key in rows[0] for key in REF_KEYS):
        batch.ref_logps, batch.ref_kl_logps = (
            torch.tensor([row[key] for row in rows], dtype=torch.float32) for key in REF_KEYS
        )
    elif share_prefix:
        batch.reference_pass = collate_shared_sft(
            _sequences(rows, "completion_ids") + _sequences(rows, "kl_ids"), **layout
        ) or collate_shared_prompt(
            rows, completions=("completion_ids", "kl_ids"), pack=True, **layout
        )
    return batch


@torch.no_grad()
def reference_logps(model: Any, batch: KTOBatch, *, completion_only: bool) -> tuple[Tensor, Tensor]:
    """Summed log-probs of each row's completion and of its KL completion under `model` (the
    reference), from the batch's shared layout where it has one, else the two layouts."""
    if batch.reference_pass is not None:
        logps, _ = sequence_logps(model, batch.reference_pass, completion_only=completion_only)
        half = logps.shape[0] // 2
        return logps[:half], logps[half:]
    own = sequence_logps(model, batch.own, completion_only=completion_only)[0]
    return own, sequence_logps(model, batch.kl, completion_only=completion_only)[0]


def encoding(cfg: RunConfig) -> Encoding:
    # Preference pairs become a desirable and an undesirable row each (formats.unpair).
    return Encoding("unpaired", unpair=True)


def check_text_only(cfg: RunConfig, model: ModelSide) -> None:
    if model.media is not None:
        raise UserError(
            f"task=kto trains text-only models for now; {cfg.model.name_or_path} is an "
            "image-text or audio-text model. Use task=dpo for multimodal preference data"
        )


def prepare_data(cfg: RunConfig, model: ModelSide, data: Data) -> list[str]:
    """The held-out rows' KL completions (they are one batch for the KL estimate: row k's
    prompt with row k - 1's completion, the first with the last) and the balance of the
    training rows."""
    max_length = cfg.data.max_length
    rows = data.eval
    n = len(rows)
    rows.derive(lambda k, row: {
        "kl_ids": kl_completion(row, rows.plain((k - 1) % n), max_length=max_length)
    })  # fmt: skip
    desirable = int(data.train.column("label").sum())
    section = cfg.kto
    return balance_note(
        desirable, len(data.train) - desirable, desirable_weight=section.desirable_weight,
        undesirable_weight=section.undesirable_weight,
    )  # fmt: skip


def schedule(cfg: RunConfig, data: Data, batch: Any) -> Schedule:
    """Epochs of global batches, which must hold at least 2 rows (the KL pairs)."""
    if batch.global_batch < 2:
        raise ConfigError(
            "task=kto estimates its KL reference point from mismatched prompt-completion "
            "pairs within the global batch, which needs at least 2 rows; the global batch is "
            f"{batch.describe()}. Raise train.per_device_batch_size or "
            "train.gradient_accumulation_steps"
        )
    return row_schedule(cfg, data, batch)


@dataclass
class KTO(Task):
    """The KTO task. `reference`: the frozen reference model, or None when its log-probs are
    precomputed (`reference_logps`: (split, row[, partner]) -> (own, KL))."""

    cfg: Any  # the kto section
    policy: Any
    reference: reference.Reference | None
    train_rows: Any
    eval_rows: int
    pad_id: int
    max_length: int
    global_batch: int
    world_size: int
    grad_accum: int
    seed: int
    steps_per_epoch: int
    completion_only: bool
    share_prefix: bool
    mask_dtype: torch.dtype | None
    check_generation: Any  # () -> held-out generation figures
    reference_logps: dict[tuple, tuple[float, float]] | None = None
    reference_seconds: float | None = None
    kl: Tensor | None = None  # z0 of the current step or evaluation
    name: str = "kto"
    metric_keys: tuple[str, ...] = ("loss", "kl", "rewards/chosen", "rewards/rejected",
                                    "logps/chosen", "logps/rejected", "count/chosen",
                                    "count/rejected")  # fmt: skip

    # ------------------------------------------------------------------ rows and batches

    def partners(self, step: int) -> dict[int, int]:
        """Training row -> the row whose completion its prompt is paired with in step `step`."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        order = step_indices(
            len(self.train_rows), global_batch=self.global_batch, seed=self.seed, epoch=epoch,
            step=in_epoch,
        )  # fmt: skip
        return rotated_partners(order)

    def pair_row(self, i: int, j: int) -> dict:
        """Training row `i` with row `j`'s completion as its KL completion."""
        row = self.train_rows[i]
        return {**row, "kl_ids": kl_completion(row, self.train_rows[j],
                                               max_length=self.max_length)}  # fmt: skip

    def rows_of_step(self, step: int, indices: list[int]) -> list[dict]:
        partners = self.partners(step)
        rows = [self.pair_row(i, partners[i]) for i in indices]
        if self.reference_logps is not None:
            for row, i in zip(rows, indices, strict=True):
                row["ref_logps"], row["ref_kl_logps"] = self.reference_logps[
                    ("train", i, partners[i])
                ]
        return rows

    def collate(self, rows: list[dict]) -> KTOBatch:
        return collate_rows(
            rows, pad_id=self.pad_id, share_prefix=self.share_prefix,
            additive_mask_dtype=self.mask_dtype,
        )  # fmt: skip

    def count_items(self, batch: KTOBatch) -> int:
        return int(batch.desirable.shape[0])

    def count_tokens(self, batch: KTOBatch) -> int:
        return batch.own.tokens

    def run_reference(self, batch: KTOBatch) -> None:
        """The reference's log-probs of the batch's completions, where not precomputed."""
        if batch.ref_kl_logps is None:
            assert self.reference is not None
            batch.ref_logps, batch.ref_kl_logps = reference_logps(
                self.reference, batch, completion_only=self.completion_only
            )

    # ------------------------------------------------------------------ KL reference point

    @torch.no_grad()
    def before_losses(self, batches: Sequence[KTOBatch], real: Sequence[bool]) -> None:
        """z₀ of the global batch: the policy − reference log-probs of every KL pair of every
        micro-batch on every rank, averaged (one all-reduce) and clamped at 0. A batch flagged
        False (a rank's dummy eval batch) runs its forward but adds nothing."""
        total = count = 0.0
        for batch, is_real in zip(batches, real, strict=True):
            self.run_reference(batch)
            policy = sequence_logps(self.policy, batch.kl, completion_only=self.completion_only)[0]
            if is_real:
                total += float((policy - batch.ref_kl_logps).double().sum())
                count += policy.shape[0]
        _, (total, count) = comm.sum_metrics({}, [], total, count)
        self.kl = kto_kl_reference(torch.tensor(total, dtype=torch.float64), count).float()

    # ------------------------------------------------------------------ loss

    def loss(self, batch: KTOBatch, *, normalizer: float, training: bool) -> LossOutput:
        cfg = self.cfg
        assert self.kl is not None, "before_losses computes the step's KL point first"
        logps = sequence_logps(self.policy, batch.own, completion_only=self.completion_only)[0]
        self.run_reference(batch)
        desirable = batch.desirable
        out = kto_loss(
            logps, batch.ref_logps.to(logps.dtype), desirable, self.kl.to(logps.device),
            beta=cfg.beta, desirable_weight=cfg.desirable_weight,
            undesirable_weight=cfg.undesirable_weight,
        )  # fmt: skip
        undesirable = ~desirable
        # Counts are logged per optimizer step (training) or over the held-out set: each row
        # adds the number of rows that its average is taken over (see finalize_metrics).
        rows = normalizer * self.world_size * self.grad_accum if training else self.eval_rows
        logps = logps.detach()
        metrics = {
            "loss": out.losses.detach().sum(),
            "kl": self.kl * logps.shape[0],
            "rewards/chosen": out.rewards[desirable].sum(),
            "rewards/rejected": out.rewards[undesirable].sum(),
            "logps/chosen": logps[desirable].sum(),
            "logps/rejected": logps[undesirable].sum(),
            "count/chosen": desirable.sum().double() * rows,
            "count/rejected": undesirable.sum().double() * rows,
        }
        return LossOutput({"policy": out.losses.sum() / normalizer}, metrics)

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Rewards and log-probs as means over the rows of their kind (TRL's figures), not over
        all rows; `rewards/margins` = chosen − rejected where both kinds are present."""
        chosen, rejected = metrics.get("count/chosen"), metrics.get("count/rejected")
        if chosen is None or rejected is None:
            return metrics
        total = max(chosen + rejected, 1e-12)
        for side, share in (("chosen", chosen / total), ("rejected", rejected / total)):
            for name in ("rewards", "logps"):
                value = metrics.pop(f"{name}/{side}", None)
                if value is not None and share > 0:
                    metrics[f"{name}/{side}"] = value / share
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return metrics

    def evaluate_extra(self, label: str) -> dict[str, float]:
        return self.check_generation()

    def summary(self) -> dict[str, Any]:
        # The precomputed reference pass is part of the training cost (benchmarks add it).
        return {"reference_seconds": self.reference_seconds}


def precompute_reference(run: Run, task: KTO) -> dict[tuple, tuple[float, float]]:
    """Reference log-probs (own completion, KL completion) of every (row, KL partner) the
    planned steps use, and of every held-out row."""
    pairs: set[tuple] = set()
    for step in range(run.schedule.total_steps):
        pairs.update(("train", i, j) for i, j in task.partners(step).items())
    keys = sorted(pairs) + [("eval", i) for i in range(len(run.data.eval))]

    def score(part: list[tuple]) -> list[tuple[float, float]]:
        rows = [task.pair_row(k[1], k[2]) if k[0] == "train" else run.data.eval[k[1]]
                for k in part]  # fmt: skip
        batch = to_device(task.collate(rows), run.policy.device)
        own, kl = reference_logps(task.reference, batch, completion_only=task.completion_only)
        return list(zip(own.tolist(), kl.tolist(), strict=True))

    # No activations are kept for backward, so rows can go in larger batches.
    return reference.precompute(
        keys, score, chunk=run.ds_plan.batch.micro_batch * 2, rank=run.dist.rank,
        world=run.dist.world_size,
    )  # fmt: skip


def build(run: Run) -> tuple[KTO, RowBatches]:
    cfg, policy, plan = run.cfg, run.policy, run.ds_plan.batch
    section = cfg.kto
    share_prefix = cfg.speed.share_prefix and supports_shared_prompt(policy.module.config)
    lora_enabled = cfg.model.lora.enabled
    task = KTO(
        cfg=section, policy=policy,
        reference=reference.build(
            policy=policy, lora_enabled=lora_enabled, load_model=fresh_model_loader(run),
            ds_config=run.ds_plan.reference_config(offload=section.reference_offload),
        ),
        train_rows=run.data.train, eval_rows=len(run.data.eval),
        pad_id=run.model.tokenizer.pad_token_id, max_length=cfg.data.max_length,
        global_batch=plan.global_batch, world_size=plan.world_size, grad_accum=plan.grad_accum,
        seed=cfg.train.seed, steps_per_epoch=run.schedule.steps_per_epoch,
        completion_only=completion_only_logits(cfg, policy), share_prefix=share_prefix,
        mask_dtype=mask_dtype(policy.module),
        check_generation=generation.held_out_checker(
            run, samples=section.generation_check_samples,
            max_new_tokens=section.generation_max_new_tokens,
        ),
    )  # fmt: skip
    kept = task.reference
    if section.reference == "precompute":
        start = time.perf_counter()
        task.reference_logps = precompute_reference(run, task)
        task.reference_seconds = time.perf_counter() - start
        held_out = [task.reference_logps[("eval", i)] for i in range(len(run.data.eval))]
        for k, key in enumerate(REF_KEYS):
            run.data.eval.set_column(key, [pair[k] for pair in held_out])
        kept.release()
        task.reference = None
    run.summary += [
        reference.describe(
            kept, lora_enabled=lora_enabled, offload=section.reference_offload,
            precomputed_s=task.reference_seconds,
        ),
        "  rows            "
        + ("a micro-batch's common prefix once for its trained rows, once for its KL rows "
           "(where that saves a quarter of the tokens), once for the reference's sequences "
           "(speed.share_prefix)"
           if share_prefix else "plain rows (speed.share_prefix off, or attention that "
           "takes no dense mask)"),
        "  kl pairs        the prompt of row k with the completion of row k-1 of each step's "
        "global batch (first with last), no gradient, all-reduced, clamped at 0",
    ]  # fmt: skip
    return task, row_batches(run, task.collate, rows_of_step=task.rows_of_step)


SPEC = TaskSpec(
    name="kto", record_kind="unpaired", family=LANGUAGE_MODELS, encoding=encoding,
    build=build, check=check_text_only, prepare_data=prepare_data, schedule=schedule,
)  # fmt: skip
