"""Reward modelling: a scalar head on the language model, read at the last real token of each
sequence; loss −log σ(r+ − r− − margin) with an optional centring term.

The model is `AutoModelForSequenceClassification(num_labels=1)`, so the exported folder scores
exactly as training did: transformers reads the score at the last token that is not the pad
token, which is the last real token whatever the padding side, provided no sequence ends with
the pad id (checked here; another special token is chosen as pad when one would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from align_anything.config import RunConfig
from align_anything.errors import DataError
from align_anything.families.language import collate_preference
from align_anything.families.language.batches import Rows, SharedPrefix
from align_anything.families.language.collate import collate_margins
from align_anything.families.language.encode import Encoding
from align_anything.families.language.family import LANGUAGE_MODELS, ModelSide, shared_prompt_pairs
from align_anything.families.language.forward import sequence_scores, shared_prefix_scores
from align_anything.families.language.layouts import collate_shared_prompt, mask_dtype
from align_anything.families.language.multimodal import MediaSupport
from align_anything.families.language.rows import EncodedRows
from align_anything.losses import reward_loss
from align_anything.training.run import Data, Run
from align_anything.training.sources import RowBatches, row_batches
from align_anything.training.task import LossOutput, Task, TaskSpec


def encoding(cfg: RunConfig) -> Encoding:
    return Encoding("preference", margin_column=cfg.rm.margin_column or None)


def ending_ids(rows: EncodedRows) -> set[int]:
    """The last token of every sequence the rows make (prompt + chosen, prompt + rejected)."""
    prompt_last = rows.last_ids("prompt_ids")
    ends: set[int] = set()
    for key in ("chosen_ids", "rejected_ids"):
        last = rows.last_ids(key)
        ends.update(np.unique(np.where(last >= 0, last, prompt_last)).tolist())
    return ends


def choose_pad_id(cfg: RunConfig, model: ModelSide, data: Data) -> list[str]:
    """Make sure no sequence of either split ends with the pad id (transformers would then read
    the score one token early): another special token becomes the pad token when one would."""
    tokenizer = model.tokenizer
    for rows in (data.train, data.eval):
        ends = ending_ids(rows) if len(rows) else set()
        if tokenizer.pad_token_id not in ends:
            continue
        candidate = next((c for c in tokenizer.all_special_ids if c not in ends), None)
        if candidate is None:
            raise DataError(
                "every special token ends some sequence; cannot choose a pad token for the "
                "reward model"
            )
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(candidate)
    return []


@dataclass
class PairScores:
    """B preference pairs as 2B sequences (chosen of every pair, then rejected) and their
    margins: 2B rows, or the pairs' shared-prompt rows."""

    sequences: Rows | SharedPrefix
    margin: Tensor | None


@dataclass
class RM(Task):
    """The reward-model task."""

    policy: Any
    pad_id: int
    center_coef: float
    media: MediaSupport | None
    share_prompt: bool = False
    mask_dtype: torch.dtype | None = None
    name: str = "rm"
    metric_keys: tuple[str, ...] = ("loss", "accuracy", "margin", "reward_sum", "reward_sq_sum")

    def collate(self, rows: list[dict]) -> PairScores:
        if self.share_prompt:
            shared = collate_shared_prompt(
                rows, pad_id=self.pad_id, additive_mask_dtype=self.mask_dtype, pack=True
            )
            return PairScores(shared, collate_margins(rows))
        sequences = collate_preference(rows, pad_id=self.pad_id)
        if self.media is not None:
            sequences = self.media.attach(sequences, rows, copies=2)
        return PairScores(sequences, collate_margins(rows))

    def count_items(self, batch: PairScores) -> int:
        if isinstance(batch.sequences, SharedPrefix):
            return batch.sequences.num_sequences // 2
        return batch.sequences.num_real // 2

    def count_tokens(self, batch: PairScores) -> int:
        return batch.sequences.tokens

    def loss(self, batch: PairScores, *, normalizer: float, training: bool) -> LossOutput:
        if isinstance(batch.sequences, SharedPrefix):
            rewards = shared_prefix_scores(self.policy, batch.sequences)
        else:
            rewards = sequence_scores(self.policy, batch.sequences)
        half = rewards.shape[0] // 2
        chosen, rejected = rewards[:half], rewards[half:]
        # reward_loss averages; the loop needs per-pair sums to average over the global batch.
        loss_mean, _ = reward_loss(
            chosen, rejected, margin=batch.margin, center_coef=self.center_coef
        )
        loss_sum = loss_mean * half
        diff = (chosen - rejected).detach()
        both = rewards.detach()
        metrics = {
            "loss": loss_sum.detach(),
            "accuracy": (diff > 0).float().sum(),
            "margin": diff.sum(),
            # Sums of r and r² over both completions (two per pair) give the mean and std.
            "reward_sum": both.sum(),
            "reward_sq_sum": (both * both).sum(),
        }
        return LossOutput({"policy": loss_sum / normalizer}, metrics)

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if "reward_sum" in metrics:
            mean = metrics.pop("reward_sum") / 2
            mean_sq = metrics.pop("reward_sq_sum") / 2
            metrics["reward_mean"] = mean
            metrics["reward_std"] = max(mean_sq - mean * mean, 0.0) ** 0.5
        return metrics


def build(run: Run) -> tuple[RM, RowBatches]:
    cfg, policy = run.cfg, run.policy
    share_prompt = shared_prompt_pairs(run)
    task = RM(
        policy=policy, pad_id=run.model.tokenizer.pad_token_id,
        center_coef=cfg.rm.center_coef, media=run.model.media, share_prompt=share_prompt,
        mask_dtype=mask_dtype(policy.module),
    )  # fmt: skip
    return task, row_batches(run, task.collate)


SPEC = TaskSpec(
    name="rm", record_kind="preference", family=LANGUAGE_MODELS, encoding=encoding,
    build=build, reward_head=True, prepare_data=choose_pad_id,
)  # fmt: skip
