"""Supervised fine-tuning: next-token loss on assistant tokens (prompt, template and padding
masked), averaged over every target token of the global batch."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from align_anything.data import IGNORE_INDEX, collate_sft
from align_anything.data.encode import Encoding
from align_anything.data.layouts import collate_shared_sft, mask_dtype, supports_shared_prompt
from align_anything.forward import completion_forward, shared_prefix_logps
from align_anything.trainers.base import Trainer


class SFTTrainer(Trainer):
    task: ClassVar[str] = "sft"
    record_kind: ClassVar[str] = "conversation"
    count_unit: ClassVar[str] = "tokens"

    def encoding(self) -> Encoding:
        return Encoding("sft", all_labels=not self.cfg.sft.assistant_only_loss)

    def after_engine(self) -> None:
        self.share_prefix = self.cfg.speed.share_prefix and supports_shared_prompt(
            self.engine.module.config
        )

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.share_prefix:
            batch = collate_shared_sft(
                rows,
                pad_id=self.tokenizer.pad_token_id,
                additive_mask_dtype=mask_dtype(self.engine.module),
            )
            if batch is not None:
                return batch
        return collate_sft(rows, pad_id=self.tokenizer.pad_token_id)

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        if "score_targets" in batch:
            return int(batch["score_targets"].numel())
        # Targets are labels[:, 1:] (position t predicts token t+1).
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def compute_loss(
        self, batch: dict[str, torch.Tensor], *, normalizer: float, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        forward = shared_prefix_logps if "score_targets" in batch else completion_forward
        logp_sum, _ = forward(self.engine, batch, completion_only=self.completion_only_logits)
        nll = -logp_sum.sum()
        return nll / normalizer, {"loss": nll}

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if "loss" in metrics:
            metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics
