"""Reward modelling: a scalar head on the language model, read at the last real token of each
sequence; loss −log σ(r+ − r− − margin) with an optional centring term.

The model is `AutoModelForSequenceClassification(num_labels=1)`, so the exported folder scores
exactly as training did: transformers reads the score at the last token that is not the pad
token, which is the last real token whatever the padding side, provided no sequence ends with
the pad id (checked here; another special token is chosen as pad when one would).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

import torch

from align_anything.data import DataReport, collate_preference, encode_preference
from align_anything.data.formats import SOURCE_ROW, describe_rows, row_label
from align_anything.errors import DataError
from align_anything.forward import sequence_scores
from align_anything.losses import reward_loss
from align_anything.trainers.base import Trainer

# Rows named per kind of bad margin in the error message.
MAX_SHOWN = 5


def _margin_problem(value: Any) -> str | None:
    """What kind of bad margin `value` is, or None for a finite number."""
    if value is None:
        return "missing"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "not a number"
    if not math.isfinite(value):
        return "NaN or infinite"
    return None


def check_margins(records: list[dict], column: str, source: str) -> None:
    """Raise one DataError naming the rows (by their place in `source`, from 1) whose
    `column` is not a finite number."""
    bad: dict[str, list[str]] = {}  # kind of problem -> row labels
    example: dict[str, Any] = {}  # kind of problem -> its first value
    for index, record in enumerate(records):
        kind = _margin_problem(record.get(column))
        if kind is not None:
            bad.setdefault(kind, []).append(row_label(record, index))
            example.setdefault(kind, record.get(column))
    if not bad:
        return
    if all(column not in record for record in records):
        found = sorted(k for k in records[0] if k != SOURCE_ROW)
        raise DataError(
            f"rm.margin_column={column!r}: {source} has no column {column!r}; columns found: "
            f"{', '.join(found)}. Set rm.margin_column to one of them, or null for no margin"
        )
    count = sum(len(rows) for rows in bad.values())
    parts = [
        f"{kind}{f' (e.g. {example[kind]!r})' if kind == 'not a number' else ''} in "
        f"{describe_rows(rows[:MAX_SHOWN])}"
        + (f", ... ({len(rows)} rows)" if len(rows) > MAX_SHOWN else "")
        for kind, rows in bad.items()
    ]
    raise DataError(
        f"rm.margin_column={column!r}: {count} of {len(records)} rows of {source} have no finite "
        f"number there: {'; '.join(parts)} (line and row numbers of the file, from 1). Margins "
        "must be finite numbers such as 0.5: fix those rows, or set rm.margin_column=null"
    )


def _ends_with(rows: list[dict], token_id: int) -> bool:
    return any(
        (row["prompt_ids"] + row[key])[-1] == token_id
        for row in rows
        for key in ("chosen_ids", "rejected_ids")
    )


class RMTrainer(Trainer):
    task: ClassVar[str] = "rm"
    record_kind: ClassVar[str] = "preference"

    def encode(self, records: list[dict], *, split: str) -> tuple[list[dict], DataReport]:
        column = self.cfg.rm.margin_column
        if column:
            data = self.cfg.data
            source = data.eval_path if split == "eval" and data.eval_path else data.path
            check_margins(records, column, source)
            records = [{**r, "margin": float(r[column])} for r in records]
        rows, report = encode_preference(
            records,
            self.tokenizer,
            max_length=self.cfg.data.max_length,
            truncation=self.cfg.data.truncation,
        )
        if not column:
            for row in rows:
                row.pop("margin", None)
        self._choose_pad_id(rows)
        return rows, report

    def _choose_pad_id(self, rows: list[dict]) -> None:
        """Make sure no sequence ends with the pad id (transformers would then read the score
        one token early)."""
        pad_id = self.tokenizer.pad_token_id
        if not _ends_with(rows, pad_id):
            return
        for candidate in self.tokenizer.all_special_ids:
            if not _ends_with(rows, candidate):
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
