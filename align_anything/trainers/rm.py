"""Reward modelling: a scalar head on the language model, read at the last real token of each
sequence; loss −log σ(r+ − r− − margin) with an optional centring term.

The model is `AutoModelForSequenceClassification(num_labels=1)`, so the exported folder scores
exactly as training did: transformers reads the score at the last token that is not the pad
token, which is the last real token whatever the padding side, provided no sequence ends with
the pad id (checked here; another special token is chosen as pad when one would).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from align_anything.data import collate_preference
from align_anything.data.encode import Encoding
from align_anything.data.rows import EncodedRows
from align_anything.errors import DataError
from align_anything.forward import sequence_scores
from align_anything.losses import reward_loss
from align_anything.trainers.base import Trainer


def ending_ids(rows: EncodedRows) -> set[int]:
    """The last token of every sequence the rows make (prompt + chosen, prompt + rejected)."""
    prompt_last = rows.last_ids("prompt_ids")
    ends: set[int] = set()
    for key in ("chosen_ids", "rejected_ids"):
        last = rows.last_ids(key)
        ends.update(np.unique(np.where(last >= 0, last, prompt_last)).tolist())
    return ends


class RMTrainer(Trainer):
    task: ClassVar[str] = "rm"
    record_kind: ClassVar[str] = "preference"

    def encoding(self) -> Encoding:
        return Encoding("preference", margin_column=self.cfg.rm.margin_column or None)

    def prepare_rows(self, rows: EncodedRows, split: str) -> None:
        self._choose_pad_id(rows)

    def _choose_pad_id(self, rows: EncodedRows) -> None:
        """Make sure no sequence ends with the pad id (transformers would then read the score
        one token early)."""
        pad_id = self.tokenizer.pad_token_id
        ends = ending_ids(rows) if len(rows) else set()
        if pad_id not in ends:
            return
        for candidate in self.tokenizer.all_special_ids:
            if candidate not in ends:
                self.tokenizer.pad_token = self.tokenizer.convert_ids_to_tokens(candidate)
                return
        raise DataError(
            "every special token ends some sequence; cannot choose a pad token for the reward model"
        )

    def build_model(self) -> torch.nn.Module:
        model = super().build_model()  # a reward model: see models.loading.model_class
        model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return collate_preference(rows, pad_id=self.tokenizer.pad_token_id)

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def compute_loss(
        self, batch: dict[str, torch.Tensor], *, normalizer: float, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rewards = sequence_scores(self.engine, batch)
        half = rewards.shape[0] // 2
        chosen, rejected = rewards[:half], rewards[half:]
        margin = batch.get("margin")
        # reward_loss averages; the trainer needs per-pair sums to average over the global batch.
        loss_mean, _ = reward_loss(
            chosen, rejected, margin=margin, center_coef=self.cfg.rm.center_coef
        )
        loss_sum = loss_mean * half
        diff = (chosen - rejected).detach()
        both = torch.cat([chosen, rejected]).detach()
        metrics = {
            "loss": loss_sum.detach(),
            "accuracy": (diff > 0).float().sum(),
            "margin": diff.sum(),
            # Sums of r and r² over both completions (two per pair) give the mean and std.
            "reward_sum": both.sum(),
            "reward_sq_sum": (both * both).sum(),
        }
        return loss_sum / normalizer, metrics

    def metric_keys(self) -> list[str]:
        return ["loss", "accuracy", "margin", "reward_sum", "reward_sq_sum"]

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if "reward_sum" in metrics:
            mean = metrics.pop("reward_sum") / 2
            mean_sq = metrics.pop("reward_sq_sum") / 2
            metrics["reward_mean"] = mean
            metrics["reward_std"] = max(mean_sq - mean * mean, 0.0) ** 0.5
        return metrics

    def export_module(self) -> Any:
        module = self.engine.module
        module.config.pad_token_id = self.tokenizer.pad_token_id
        return module
