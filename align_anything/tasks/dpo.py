"""Direct preference optimisation and its loss family (sigmoid/cDPO, IPO, hinge, robust, the
reference-free SimPO and ORPO, and TRL's other types: APO, BCO, EXO, NCA, SPPO, AOT, DiscoPOP,
length-normalised sigmoid), one type or a weighted sum of several (`losses.dpo_loss`).

Chosen and rejected go through one forward pass (stacked on the batch axis, or, with
`speed.share_prefix`, one row per pair, short pairs sharing a row: the prompt once). Log-probs
are summed over completion tokens found on the ids fed to the model. The reference is the
model as loaded at the start of the run (`training.reference`), either precomputed in one
no-grad pass (default: the reference never occupies memory during training) or kept as a
frozen model (`dpo.reference=model`; under ZeRO-3 a partitioned inference engine; with LoRA
the policy with its adapters disabled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from align_anything.config import RunConfig
from align_anything.families.language import collate_preference, reference
from align_anything.families.language import evaluation as generation
from align_anything.families.language.batches import Rows, SharedPrefix
from align_anything.families.language.encode import Encoding
from align_anything.families.language.family import (
    LANGUAGE_MODELS,
    completion_only_logits,
    fresh_model_loader,
    shared_prompt_pairs,
)
from align_anything.families.language.forward import sequence_logps
from align_anything.families.language.layouts import collate_shared_prompt, mask_dtype
from align_anything.families.language.multimodal import MediaSupport
from align_anything.losses import dpo_loss, needs_reference
from align_anything.training.batching import step_indices, to_device
from align_anything.training.run import Run
from align_anything.training.sources import RowBatches, row_batches
from align_anything.training.task import LossOutput, Task, TaskSpec

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip


def encoding(cfg: RunConfig) -> Encoding:
    return Encoding("preference")


@dataclass
class PairBatch:
    """B preference pairs: their 2B sequences (chosen of every pair, then rejected) as plain
    rows or one shared-prompt row per pair, and the reference's precomputed log-probs of the
    pairs' chosen and rejected completions (None: the reference model runs)."""

    sequences: Rows | SharedPrefix
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None

    @property
    def pairs(self) -> int:
        seqs = self.sequences
        total = seqs.num_sequences if isinstance(seqs, SharedPrefix) else seqs.num_real
        return total // 2


@dataclass
class DPO(Task):
    """The DPO task. `reference`: the frozen reference model, or None when its log-probs are
    precomputed into the rows or the loss is reference-free."""

    cfg: Any  # the dpo section
    policy: Any
    reference: reference.Reference | None
    pad_id: int
    media: MediaSupport | None
    completion_only: bool
    share_prompt: bool
    mask_dtype: torch.dtype | None
    check_generation: Any  # label -> held-out generation figures
    reference_seconds: float | None = None
    name: str = "dpo"
    metric_keys: tuple[str, ...] = METRICS
    reference_free: bool = field(default=False)

    def collate(self, rows: list[dict]) -> PairBatch:
        sequences: Rows | SharedPrefix
        if self.share_prompt:
            sequences = collate_shared_prompt(
                rows, pad_id=self.pad_id, additive_mask_dtype=self.mask_dtype, pack=True
            )
        else:
            sequences = collate_preference(rows, pad_id=self.pad_id)
            if self.media is not None:
                sequences = self.media.attach(sequences, rows, copies=2)
        batch = PairBatch(sequences)
        if all(key in rows[0] for key in REF_KEYS):
            batch.ref_chosen, batch.ref_rejected = (
                torch.tensor([row[key] for row in rows], dtype=torch.float32) for key in REF_KEYS
            )
        return batch

    def count_items(self, batch: PairBatch) -> int:
        return batch.pairs

    def count_tokens(self, batch: PairBatch) -> int:
        return batch.sequences.tokens

    def pair_logps(self, model: Any, batch: PairBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Summed completion log-probs of the chosen and rejected completions, and the token
        counts of all 2B sequences."""
        logps, counts = sequence_logps(model, batch.sequences, completion_only=self.completion_only)
        half = logps.shape[0] // 2
        return logps[:half], logps[half:], counts

    def loss(self, batch: PairBatch, *, normalizer: float, training: bool) -> LossOutput:
        cfg = self.cfg
        chosen, rejected, counts = self.pair_logps(self.policy, batch)
        ref_chosen, ref_rejected = batch.ref_chosen, batch.ref_rejected
        if not self.reference_free and ref_chosen is None:
            assert self.reference is not None
            with torch.no_grad():
                ref_chosen, ref_rejected, _ = self.pair_logps(self.reference, batch)
        half = chosen.shape[0]
        # rpo_alpha > 0 appends ("sft", rpo_alpha). aot / aot_unpaired sort this micro-batch:
        # their loss depends on how a step's rows are split (DESIGN.md §4).
        loss_types, loss_weights = cfg.loss_terms()
        out = dpo_loss(
            chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta, loss_type=loss_types,
            loss_weights=loss_weights, label_smoothing=cfg.label_smoothing,
            chosen_token_counts=counts[:half], rejected_token_counts=counts[half:],
            simpo_gamma=cfg.simpo_gamma, orpo_lambda=cfg.orpo_lambda,
            discopop_tau=cfg.discopop_tau,
        )  # fmt: skip
        margins = out.chosen_rewards - out.rejected_rewards
        metrics = {
            "loss": out.losses.detach().sum(),
            "rewards/chosen": out.chosen_rewards.sum(),
            "rewards/rejected": out.rejected_rewards.sum(),
            "rewards/accuracies": (margins > 0).float().sum(),
            "rewards/margins": margins.sum(),
            "logps/chosen": chosen.detach().sum(),
            "logps/rejected": rejected.detach().sum(),
        }
        if "sft" in out.terms:
            metrics["nll_loss"] = out.terms["sft"].detach().sum()
        return LossOutput({"policy": out.losses.sum() / normalizer}, metrics)

    def evaluate_extra(self, label: str) -> dict[str, float]:
        return self.check_generation()

    def summary(self) -> dict[str, Any]:
        # The precomputed reference pass, part of the training cost (the step loop's
        # train_seconds leave it out; the benchmarks add it).
        return {"reference_seconds": self.reference_seconds}


def rows_needing_reference(run: Run) -> list[int]:
    """Indices of training rows the planned steps will use (all rows after one epoch)."""
    rows, schedule = len(run.data.train), run.schedule
    if schedule.total_steps >= schedule.steps_per_epoch:
        return list(range(rows))
    used: set[int] = set()
    for step in range(schedule.total_steps):
        used.update(
            step_indices(rows, global_batch=run.ds_plan.batch.global_batch,
                         seed=run.cfg.train.seed, epoch=0, step=step)
        )  # fmt: skip
    return sorted(used)


@torch.no_grad()
def precompute_reference(run: Run, task: DPO) -> None:
    """Reference log-probs of every needed row, set as the rows' `ref_*` columns. Eval rows are
    batched exactly as the evaluation batches them, so at step 0 policy and reference agree
    bit for bit; training rows go in batches twice as large (no activations kept)."""
    micro = run.ds_plan.batch.micro_batch
    for rows, indices, chunk in (
        (run.data.train, rows_needing_reference(run), micro * 2),
        (run.data.eval, list(range(len(run.data.eval))), micro),
    ):

        def score(part: list[int], rows: Any = rows) -> list[tuple[float, float]]:
            batch = to_device(task.collate([rows[i] for i in part]), run.policy.device)
            chosen, rejected, _ = task.pair_logps(task.reference, batch)
            return list(zip(chosen.tolist(), rejected.tolist(), strict=True))

        found = reference.precompute(
            indices, score, chunk=chunk, rank=run.dist.rank, world=run.dist.world_size
        )
        # Rows the planned steps never use keep NaN (no batch ever holds them).
        values = np.full((len(rows), 2), np.nan)
        for i, pair in found.items():
            values[i] = pair
        for k, key in enumerate(REF_KEYS):
            rows.set_column(key, values[:, k])


def build(run: Run) -> tuple[DPO, RowBatches]:
    cfg, policy = run.cfg, run.policy
    section = cfg.dpo
    share_prompt = shared_prompt_pairs(run)
    reference_free = not needs_reference(section.loss_terms()[0])
    lora_enabled = cfg.model.lora.enabled
    frozen = None
    if not reference_free:
        frozen = reference.build(
            policy=policy, lora_enabled=lora_enabled, load_model=fresh_model_loader(run),
            ds_config=run.ds_plan.reference_config(offload=section.reference_offload),
        )  # fmt: skip
    task = DPO(
        cfg=section, policy=policy, reference=frozen, pad_id=run.model.tokenizer.pad_token_id,
        media=run.model.media, completion_only=completion_only_logits(cfg, policy),
        share_prompt=share_prompt, mask_dtype=mask_dtype(policy.module),
        check_generation=generation.held_out_checker(
            run, samples=section.generation_check_samples,
            max_new_tokens=section.generation_max_new_tokens,
        ),
        reference_free=reference_free,
    )  # fmt: skip
    if reference_free:
        kinds = [name for name in section.loss_terms()[0] if name != "sft"]
        verb = "is" if len(kinds) == 1 else "are"
        run.summary.append(f"  reference       none ({', '.join(kinds)} {verb} reference-free)")
    elif section.reference == "precompute":
        start = time.perf_counter()
        precompute_reference(run, task)
        task.reference_seconds = time.perf_counter() - start
        assert task.reference is not None
        task.reference.release()
        task.reference = None
    if not reference_free:
        run.summary.append(
            reference.describe(
                frozen, lora_enabled=lora_enabled, offload=section.reference_offload,
                precomputed_s=task.reference_seconds,
            )
        )  # fmt: skip
    return task, row_batches(run, task.collate)


SPEC = TaskSpec(
    name="dpo",
    record_kind="preference",
    family=LANGUAGE_MODELS,
    encoding=encoding,
    build=build,
)
