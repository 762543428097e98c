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
  (global rows / (world × grad_accum)) (see `Trainer.compute_loss`): the gradient is that of
  the mean over the global batch, as TRL's mean over its batch.

The reference is the model as loaded: precomputed in one no-grad pass over every row and KL
pair the planned steps use (default), or a frozen model (`kto.reference=model`; with LoRA, the
policy with adapters disabled).

Shared prefixes (`speed.share_prefix`, `collate_rows`): KTO's rows rarely share a prompt, but
every row of a chat model starts with the same template header (SmolLM2: a ~30-token system
prompt), so the policy's trained sequences of a micro-batch run as one row `common prefix +
rest_1 + …`, as SFT's do, and so do its KL sequences (two passes: the KL pass has no backward,
and one row holding both would run the backward pass over the KL tokens too). The reference
has no backward: its 2B sequences run as one such row, or, where the common prefix is too short
to pay, each row's completion and KL completion after their one prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from align_anything.backend import distributed as comm
from align_anything.data import IGNORE_INDEX, collate_unpaired
from align_anything.data.encode import Encoding
from align_anything.data.layouts import (
    collate_shared_prompt,
    collate_shared_sft,
    mask_dtype,
    supports_shared_prompt,
)
from align_anything.data.rows import EncodedRows
from align_anything.errors import ConfigError, UserError
from align_anything.forward import completion_forward, shared_prefix_logps
from align_anything.losses import kto_kl_reference, kto_loss
from align_anything.trainers import generation, reference
from align_anything.trainers.base import Trainer
from align_anything.trainers.batching import step_indices

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


# Where a batch keeps its shared-prefix layouts (`data.layouts`): the trained sequences and the
# KL sequences, each as one row per micro-batch; the reference's 2B sequences.
OWN, KL, PAIR = "shared_own_", "shared_kl_", "pair_"


def _view(batch: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The sub-batch stored under `prefix` (`kl_input_ids` -> `input_ids`, ...)."""
    return {k.removeprefix(prefix): v for k, v in batch.items() if k.startswith(prefix)}


def _sequences(rows: list[dict], completion: str) -> list[dict]:
    """Each row's prompt + `completion` as an SFT-style row (`input_ids`, `labels`)."""
    return [
        {"input_ids": [*r["prompt_ids"], *r[completion]],
         "labels": [IGNORE_INDEX] * len(r["prompt_ids"]) + list(r[completion])}
        for r in rows
    ]  # fmt: skip


def collate_rows(
    rows: list[dict], *, pad_id: int, share_prefix: bool, additive_mask_dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """A KTO batch: `collate_unpaired`'s plain rows (each row's completion; its KL completion
    under `kl_*`), and the rows' precomputed reference log-probs when they carry them.

    With `share_prefix`, also the layouts that compute a shared prefix once (`data.layouts`),
    where they pay: the trained sequences as one row `common prefix + rest_1 + …` (under
    `shared_own_*`; the chat template's system prompt and header are common to every row) and
    the KL sequences likewise (`shared_kl_*`), each where the common prefix saves at least a
    quarter of the tokens (`collate_shared_sft`'s rule); and, for a reference to run (rows
    without precomputed log-probs), the 2B reference sequences (`pair_*`: the own completions,
    then the KL ones) as one such row, or else each row's two after its one prompt."""
    batch = collate_unpaired(rows, pad_id=pad_id)
    layout = {"pad_id": pad_id, "additive_mask_dtype": additive_mask_dtype}
    if share_prefix:
        for prefix, completion in ((OWN, "completion_ids"), (KL, "kl_ids")):
            one_row = collate_shared_sft(_sequences(rows, completion), **layout)
            batch.update({prefix + k: v for k, v in (one_row or {}).items()})
    if all(key in rows[0] for key in REF_KEYS):
        for key in REF_KEYS:
            batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
    elif share_prefix:
        both = collate_shared_sft(
            _sequences(rows, "completion_ids") + _sequences(rows, "kl_ids"), **layout
        ) or collate_shared_prompt(rows, completions=("completion_ids", "kl_ids"), **layout)
        batch.update({PAIR + k: v for k, v in both.items()})
    return batch


def sequence_logps(
    model: Any, batch: dict[str, Any], *, kl: bool, completion_only: bool
) -> torch.Tensor:
    """Summed log-probs of each row's completion (`kl`: of its KL completion) under `model`,
    from the batch's one-row layout where it has one, else from the plain rows."""
    shared = _view(batch, KL if kl else OWN)
    if shared:
        return shared_prefix_logps(model, shared, completion_only=completion_only)[0]
    plain = _view(batch, "kl_") if kl else batch
    return completion_forward(model, plain, completion_only=completion_only)[0]


@torch.no_grad()
def pair_logps(
    model: Any, batch: dict[str, Any], *, completion_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each row's completion and of its KL completion under `model` (the
    reference), from the batch's shared layout where it has one, else the two plain rows."""
    shared = _view(batch, PAIR)
    if shared:
        logps, _ = shared_prefix_logps(model, shared, completion_only=completion_only)
        half = logps.shape[0] // 2
        return logps[:half], logps[half:]
    own = sequence_logps(model, batch, kl=False, completion_only=completion_only)
    return own, sequence_logps(model, batch, kl=True, completion_only=completion_only)


class KTOTrainer(Trainer):
    task: ClassVar[str] = "kto"
    record_kind: ClassVar[str] = "unpaired"

    # ------------------------------------------------------------------ data

    def _load_tokenizer(self) -> None:
        super()._load_tokenizer()
        if self.media is not None:
            raise UserError(
                f"task=kto trains text-only models for now; {self.cfg.model.name_or_path} is an "
                "image-text or audio-text model. Use task=dpo for multimodal preference data"
            )

    def encoding(self) -> Encoding:
        # Preference pairs become a desirable and an undesirable row each (formats.unpair).
        return Encoding("unpaired", unpair=True)

    def prepare_rows(self, rows: EncodedRows, split: str) -> None:
        max_length = self.cfg.data.max_length
        if split == "eval":
            # The held-out rows are one batch for the KL estimate (see the module docstring):
            # row k's prompt with row k - 1's completion, the first with the last.
            n = len(rows)
            rows.derive(lambda k, row: {
                "kl_ids": kl_completion(row, rows.plain((k - 1) % n), max_length=max_length)
            })  # fmt: skip
            return
        desirable = int(rows.column("label").sum())
        cfg = self.cfg.kto
        self.summary_lines += balance_note(
            desirable, len(rows) - desirable, desirable_weight=cfg.desirable_weight,
            undesirable_weight=cfg.undesirable_weight,
        )  # fmt: skip

    def _plan_steps(self) -> None:
        super()._plan_steps()
        plan = self.batch_plan
        if plan.global_batch < 2:
            raise ConfigError(
                "task=kto estimates its KL reference point from mismatched prompt-completion "
                "pairs within the global batch, which needs at least 2 rows; the global batch is "
                f"{plan.describe()}. Raise train.per_device_batch_size or "
                "train.gradient_accumulation_steps"
            )

    def _partners(self, step: int) -> dict[int, int]:
        """Training row -> the row whose completion its prompt is paired with in step `step`."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        order = step_indices(
            len(self.train_rows), global_batch=self.batch_plan.global_batch,
            seed=self.cfg.train.seed, epoch=epoch, step=in_epoch,
        )  # fmt: skip
        return rotated_partners(order)

    def _pair_row(self, i: int, j: int) -> dict:
        """Training row `i` with row `j`'s completion as its KL completion."""
        row = self.train_rows[i]
        return {**row, "kl_ids": kl_completion(row, self.train_rows[j],
                                               max_length=self.cfg.data.max_length)}  # fmt: skip

    def step_rows(self, step: int, indices: list[int]) -> list[dict]:
        partners = self._partners(step)
        rows = [self._pair_row(i, partners[i]) for i in indices]
        if self.reference_logps is not None:
            for row, i in zip(rows, indices, strict=True):
                ref = self.reference_logps[("train", i, partners[i])]
                row["ref_logps"], row["ref_kl_logps"] = ref
        return rows

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return collate_rows(
            rows, pad_id=self.tokenizer.pad_token_id, share_prefix=self.share_prefix,
            additive_mask_dtype=mask_dtype(self.engine.module),
        )  # fmt: skip

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0]

    # ------------------------------------------------------------------ reference model

    def after_engine(self) -> None:
        cfg = self.cfg.kto
        self.share_prefix = self.cfg.speed.share_prefix and supports_shared_prompt(
            self.engine.module.config
        )
        self.reference_logps: dict[tuple, tuple[float, float]] | None = None
        self.reference: reference.Reference | None = reference.build(
            self, offload=cfg.reference_offload
        )
        seconds = None
        if cfg.reference == "precompute":
            start = time.perf_counter()
            self.reference_logps = self._precompute_reference()
            seconds = self.reference_seconds = time.perf_counter() - start
            held_out = [self.reference_logps[("eval", i)] for i in range(len(self.eval_rows))]
            for k, key in enumerate(REF_KEYS):
                self.eval_rows.set_column(key, [pair[k] for pair in held_out])
            self.reference.release()
            self.reference = None
        self.summary_lines += [
            reference.describe(
                self.reference, lora_enabled=self.cfg.model.lora.enabled,
                offload=cfg.reference_offload, precomputed_s=seconds,
            ),
            "  rows            "
            + ("a micro-batch's common prefix once for its trained rows, once for its KL rows "
               "(where that saves a quarter of the tokens), once for the reference's sequences "
               "(speed.share_prefix)"
               if self.share_prefix else "plain rows (speed.share_prefix off, or attention that "
               "takes no dense mask)"),
            "  kl pairs        the prompt of row k with the completion of row k-1 of each step's "
            "global batch (first with last), no gradient, all-reduced, clamped at 0",
        ]  # fmt: skip

    def _precompute_reference(self) -> dict[tuple, tuple[float, float]]:
        """Reference log-probs (own completion, KL completion) of every (row, KL partner) the
        planned steps use, and of every held-out row."""
        pairs: set[tuple] = set()
        for step in range(self.total_steps):
            pairs.update(("train", i, j) for i, j in self._partners(step).items())
        keys = sorted(pairs) + [("eval", i) for i in range(len(self.eval_rows))]

        def score(part: list[tuple]) -> list[tuple[float, float]]:
            rows = [self._pair_row(k[1], k[2]) if k[0] == "train" else self.eval_rows[k[1]]
                    for k in part]  # fmt: skip
            own, kl = self._reference_pass(self._to_device(self.collate(rows)))
            return list(zip(own.tolist(), kl.tolist(), strict=True))

        # No activations are kept for backward, so rows can go in larger batches.
        return reference.precompute(
            keys, score, chunk=self.batch_plan.micro_batch * 2, rank=self.dist.rank,
            world=self.dist.world_size,
        )  # fmt: skip

    def _reference_pass(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's log-probs of each row's completion and of its KL completion."""
        assert self.reference is not None
        return pair_logps(self.reference, batch, completion_only=self.completion_only_logits)

    # ------------------------------------------------------------------ KL reference point

    def before_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        self.kl = self._kl_estimate((batch, True) for batch in micro_batches)

    @torch.no_grad()
    def evaluate(self, *, label: str) -> dict[str, float]:
        if self.eval_rows:
            self.engine.eval()
            self.kl = self._kl_estimate(self._eval_micro_batches())
            self.engine.train()
        return super().evaluate(label=label)

    @torch.no_grad()
    def _kl_estimate(self, batches: Iterable[tuple[dict[str, Any], bool]]) -> torch.Tensor:
        """z₀ of the global batch: the policy − reference log-probs of every KL pair of every
        micro-batch on every rank, averaged (one all-reduce) and clamped at 0. A batch flagged
        False (a rank's dummy eval batch) runs its forward but adds nothing."""
        total = count = 0.0
        for batch, real in batches:
            if "ref_kl_logps" not in batch:
                batch["ref_logps"], batch["ref_kl_logps"] = self._reference_pass(batch)
            policy = sequence_logps(
                self.engine, batch, kl=True, completion_only=self.completion_only_logits
            )
            if real:
                total += float((policy - batch["ref_kl_logps"]).double().sum())
                count += policy.shape[0]
        _, (total, count) = comm.sum_metrics({}, [], total, count)
        return kto_kl_reference(torch.tensor(total, dtype=torch.float64), count).float()

    # ------------------------------------------------------------------ loss

    def compute_loss(
        self, batch: dict[str, torch.Tensor], *, normalizer: float, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg.kto
        only = self.completion_only_logits
        logps = sequence_logps(self.engine, batch, kl=False, completion_only=only)
        if "ref_logps" not in batch:  # a reference model, in evaluation (training: before_step)
            batch["ref_logps"], batch["ref_kl_logps"] = self._reference_pass(batch)
        desirable = batch["desirable"]
        out = kto_loss(
            logps, batch["ref_logps"].to(logps.dtype), desirable, self.kl.to(logps.device),
            beta=cfg.beta, desirable_weight=cfg.desirable_weight,
            undesirable_weight=cfg.undesirable_weight,
        )  # fmt: skip
        undesirable = ~desirable
        # Counts are logged per optimizer step (training) or over the held-out set: each row
        # adds the number of rows that its average is taken over (see finalize_metrics).
        plan = self.batch_plan
        rows = normalizer * plan.world_size * plan.grad_accum if training else len(self.eval_rows)
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
        return out.losses.sum() / normalizer, metrics

    def metric_keys(self) -> list[str]:
        return ["loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen",
                "logps/rejected", "count/chosen", "count/rejected"]  # fmt: skip

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

    def extra_summary(self) -> dict[str, Any]:
        # The precomputed reference pass is part of the training cost (benchmarks add it).
        return {"reference_seconds": getattr(self, "reference_seconds", None)}

    # ------------------------------------------------------------------ generation check

    def evaluate_extra(self, label: str) -> dict[str, float]:
        cfg = self.cfg.kto
        return generation.held_out_check(
            self, samples=cfg.generation_check_samples, max_new_tokens=cfg.generation_max_new_tokens
        )
