"""Direct preference optimisation and its loss family (sigmoid/cDPO, IPO, hinge, robust, the
reference-free SimPO and ORPO, and TRL's other types: APO, BCO, EXO, NCA, SPPO, AOT, DiscoPOP,
length-normalised sigmoid), one type or a weighted sum of several (`losses.dpo_loss`).

Chosen and rejected go through one forward pass (stacked on the batch axis). Log-probs are summed
over completion tokens found on the ids fed to the model. The reference is the model as loaded
at the start of the run, either precomputed in one no-grad pass (default: the reference never
occupies memory during training) or kept as a frozen model (`dpo.reference=model`; under ZeRO-3
a partitioned inference engine).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import numpy as np
import torch

from align_anything.backend import distributed as comm
from align_anything.backend.engine import InferenceEngine
from align_anything.backend.zero_init import model_init_context
from align_anything.data import collate_preference
from align_anything.data.encode import Encoding
from align_anything.data.layouts import collate_shared_prompt, mask_dtype, supports_shared_prompt
from align_anything.forward import completion_forward, shared_prefix_logps
from align_anything.losses import dpo_loss, needs_reference
from align_anything.models import lora
from align_anything.trainers import generation
from align_anything.trainers.base import Trainer
from align_anything.trainers.batching import shard_chunks, step_indices

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


class DPOTrainer(Trainer):
    task: ClassVar[str] = "dpo"
    record_kind: ClassVar[str] = "preference"

    # ------------------------------------------------------------------ data

    def encoding(self) -> Encoding:
        return Encoding("preference")

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.share_prompt:
            batch = collate_shared_prompt(
                rows,
                pad_id=self.tokenizer.pad_token_id,
                additive_mask_dtype=mask_dtype(self.engine.module),
            )
        else:
            batch = collate_preference(rows, pad_id=self.tokenizer.pad_token_id)
        if all(key in rows[0] for key in REF_KEYS):
            for key in REF_KEYS:
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        rows = batch["input_ids"].shape[0]
        return rows if "score_sequences" in batch else rows // 2

    def pair_logps(
        self, model: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed completion log-probs and token counts of the 2B sequences (chosen of every
        pair, then rejected), from either batch layout."""
        if "score_sequences" in batch:
            return shared_prefix_logps(model, batch, completion_only=self.completion_only_logits)
        return completion_forward(model, batch, completion_only=self.completion_only_logits)

    # ------------------------------------------------------------------ reference model

    @property
    def reference_free(self) -> bool:
        return not needs_reference(self.cfg.dpo.loss_terms()[0])

    def after_engine(self) -> None:
        # Media are attached per sequence (two rows per pair): text-only batches share prompts.
        self.share_prompt = (
            self.cfg.speed.share_prefix
            and self.media is None
            and supports_shared_prompt(self.engine.module.config)
        )
        if self.share_prompt:
            self.summary_lines.append(
                "  pairs           one row per pair, the prompt computed once (speed.share_prefix)"
            )
        elif self.cfg.speed.share_prefix:
            self.summary_lines.append(
                "  pairs           two rows per pair (speed.share_prefix needs a text model with "
                "sdpa or eager attention)"
            )
        self.reference: InferenceEngine | lora.AdapterDisabledReference | None = None
        if self.reference_free:
            kinds = [name for name in self.cfg.dpo.loss_terms()[0] if name != "sft"]
            verb = "is" if len(kinds) == 1 else "are"
            self.summary_lines.append(
                f"  reference       none ({', '.join(kinds)} {verb} reference-free)"
            )
            return
        if self.cfg.model.lora.enabled:
            # The base model is the policy with its adapters off: no second model in memory.
            self.reference = lora.AdapterDisabledReference(self.engine)
        else:
            # The reference is always the model as loaded from model.name_or_path (never a
            # resumed checkpoint), so build it before any checkpoint is loaded into the policy.
            with model_init_context(self.ds_config):
                ref_model = self.build_model()
            self.reference = InferenceEngine(
                ref_model, self.deepspeed.reference_config(offload=self.cfg.dpo.reference_offload)
            )
        if self.cfg.dpo.reference == "precompute":
            start = time.perf_counter()
            self._precompute_reference()
            # Part of the training cost (benchmarks add it to the step loop's time).
            self.reference_seconds = time.perf_counter() - start
            self.reference.release()
            self.reference = None
            self.summary_lines.append(
                "  reference       precomputed log-probs (one no-grad pass, "
                f"{self.reference_seconds:.1f} s), "
                + (
                    "from the policy with adapters disabled (no second model)"
                    if self.cfg.model.lora.enabled
                    else "model freed"
                )
            )
        elif self.cfg.model.lora.enabled:
            self.summary_lines.append(
                "  reference       the base model: the policy with adapters disabled (no copy)"
            )
        else:
            where = (
                "partitioned ZeRO-3 inference engine"
                if self.reference.stage == 3
                else "frozen copy"
            )
            where += ", offloaded to CPU" if self.cfg.dpo.reference_offload else ""
            self.summary_lines.append(f"  reference       {where}, no gradients or optimizer state")

    def _rows_needing_reference(self) -> list[int]:
        """Indices of training rows the planned steps will use (all rows after one epoch)."""
        plan = self.batch_plan
        if self.total_steps >= self.steps_per_epoch:
            return list(range(len(self.train_rows)))
        used: set[int] = set()
        for step in range(self.total_steps):
            used.update(
                step_indices(len(self.train_rows), global_batch=plan.global_batch,
                             seed=self.cfg.train.seed, epoch=0, step=step)
            )  # fmt: skip
        return sorted(used)

    @torch.no_grad()
    def _precompute_reference(self) -> None:
        """Reference log-probs of every needed row: each rank computes a shard, then all ranks
        exchange them, since any rank may see any row later. Eval rows are batched exactly as
        `evaluate` batches them, so at step 0 policy and reference agree bit for bit."""
        results: dict[tuple[str, int], tuple[float, float]] = {}
        needed = {"train": self._rows_needing_reference(), "eval": list(range(len(self.eval_rows)))}
        # No activations are kept for backward, so training rows can go in larger batches.
        chunk_sizes = {
            "train": self.batch_plan.micro_batch * 2,
            "eval": self.batch_plan.micro_batch,
        }
        for split, indices in needed.items():
            for chunk in shard_chunks(
                len(indices),
                chunk=chunk_sizes[split],
                rank=self.dist.rank,
                world=self.dist.world_size,
            ):
                keys = [(split, indices[i]) for i in chunk or [0]]
                rows = [self._row(*key) for key in keys]
                batch = self._to_device(self.collate_with_media(rows))
                chosen, rejected = self._sequence_logps(self.reference, batch)
                if chunk is not None:
                    for key, c, r in zip(keys, chosen.tolist(), rejected.tolist(), strict=True):
                        results[key] = (c, r)
        values = {"train": np.full((len(self.train_rows), 2), np.nan),
                  "eval": np.full((len(self.eval_rows), 2), np.nan)}  # fmt: skip
        for part in comm.all_gather_objects(results):
            for (split, i), pair in part.items():
                values[split][i] = pair
        # Rows the planned steps never use keep NaN (no batch ever holds them).
        for split, rows in (("train", self.train_rows), ("eval", self.eval_rows)):
            for k, key in enumerate(REF_KEYS):
                rows.set_column(key, values[split][:, k])

    def _row(self, split: str, index: int) -> dict:
        return (self.train_rows if split == "train" else self.eval_rows)[index]

    def _sequence_logps(
        self, model: Any, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logps, _ = self.pair_logps(model, batch)
        half = logps.shape[0] // 2
        return logps[:half], logps[half:]

    # ------------------------------------------------------------------ loss

    def compute_loss(
        self, batch: dict[str, torch.Tensor], *, normalizer: float, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.cfg.dpo
        logps, counts = self.pair_logps(self.engine, batch)
        half = logps.shape[0] // 2
        chosen, rejected = logps[:half], logps[half:]
        ref_chosen = ref_rejected = None
        if not self.reference_free:
            if "ref_chosen_logps" in batch:
                ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
            else:
                assert self.reference is not None
                with torch.no_grad():
                    ref_chosen, ref_rejected = self._sequence_logps(self.reference, batch)
        # rpo_alpha > 0 appends ("sft", rpo_alpha). aot / aot_unpaired sort this micro-batch:
        # their loss depends on how a step's rows are split (DESIGN.md §4).
        loss_types, loss_weights = cfg.loss_terms()
        out = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=cfg.beta,
            loss_type=loss_types,
            loss_weights=loss_weights,
            label_smoothing=cfg.label_smoothing,
            chosen_token_counts=counts[:half],
            rejected_token_counts=counts[half:],
            simpo_gamma=cfg.simpo_gamma,
            orpo_lambda=cfg.orpo_lambda,
            discopop_tau=cfg.discopop_tau,
        )
        losses = out.losses
        margins = out.chosen_rewards - out.rejected_rewards
        metrics = {
            "loss": losses.detach().sum(),
            "rewards/chosen": out.chosen_rewards.sum(),
            "rewards/rejected": out.rejected_rewards.sum(),
            "rewards/accuracies": (margins > 0).float().sum(),
            "rewards/margins": margins.sum(),
            "logps/chosen": chosen.detach().sum(),
            "logps/rejected": rejected.detach().sum(),
        }
        if "sft" in out.terms:
            metrics["nll_loss"] = out.terms["sft"].detach().sum()
        return losses.sum() / normalizer, metrics

    def extra_summary(self) -> dict[str, Any]:
        # The precomputed reference pass, part of the training cost (the step loop's
        # train_seconds leave it out; the benchmarks add it).
        return {"reference_seconds": getattr(self, "reference_seconds", None)}

    def metric_keys(self) -> list[str]:
        return ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected"]  # fmt: skip

    # ------------------------------------------------------------------ generation check

    def evaluate_extra(self, label: str) -> dict[str, float]:
        cfg = self.cfg.dpo
        return generation.held_out_check(
            self, samples=cfg.generation_check_samples, max_new_tokens=cfg.generation_max_new_tokens
        )
