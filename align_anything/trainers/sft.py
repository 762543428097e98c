"""Supervised fine-tuning: next-token loss on assistant tokens (prompt, template and padding
masked), averaged over every target token of the global batch.

With `sft.packing` the training rows are packed once (`data/packing.py`: best-fit decreasing into
sequences of up to `data.max_length` tokens); `train_rows` becomes the packed view, so the
shared batching draws packed sequences, and the loss (a sum over the same scored tokens over
the same global token count) is that of the unpacked rows."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from align_anything.data import IGNORE_INDEX, collate_sft
from align_anything.data.encode import Encoding
from align_anything.data.layouts import (
    DENSE_MASK_ATTENTION,
    collate_shared_sft,
    mask_dtype,
    supports_shared_prompt,
)
from align_anything.data.packing import (
    FLATTENED_KERNELS,
    PACKING_KERNELS,
    PackedRows,
    PackedSequence,
    best_fit_decreasing,
    collate_packed,
    fill_share,
)
from align_anything.errors import ConfigError
from align_anything.forward import completion_forward, shared_prefix_logps
from align_anything.trainers.base import Trainer


class SFTTrainer(Trainer):
    task: ClassVar[str] = "sft"
    record_kind: ClassVar[str] = "conversation"
    count_unit: ClassVar[str] = "tokens"

    def encoding(self) -> Encoding:
        return Encoding("sft", all_labels=not self.cfg.sft.assistant_only_loss)

    def _build_data(self) -> None:
        super()._build_data()
        if self.cfg.sft.packing:
            self._pack_rows()

    def _pack_rows(self) -> None:
        """Replace the training rows by their packed view (bins of row indices, assigned once
        by best-fit decreasing); step batches then count packed sequences."""
        if self.media is not None:
            raise ConfigError(
                "sft.packing packs text rows only; this model takes media "
                f"({', '.join(self.media.modalities)}): set sft.packing=false"
            )
        capacity = self.cfg.data.max_length
        rows = len(self.train_rows)
        bins = best_fit_decreasing(self._row_lengths, capacity)
        self.train_rows = PackedRows(self.train_rows, bins)
        self.train_unit = "packed sequences"  # what the start-up summary counts
        self._row_lengths = bins.lengths.tolist()
        # A resume that toggles packing would draw other steps: refuse it as other data.
        self.fingerprints["data_fingerprint"] += f"+packed{capacity}"
        self.summary_lines.append(
            f"  packing         {rows} rows in {len(bins)} packed sequences of <= {capacity} "
            f"tokens: {fill_share(bins, capacity):.1%} real tokens (sft.packing; the batch "
            "size counts packed sequences)"
        )

    def after_engine(self) -> None:
        kernel = self.engine.module.config._attn_implementation
        if self.cfg.sft.packing and kernel not in PACKING_KERNELS:
            raise ConfigError(
                f"sft.packing runs on {', '.join(PACKING_KERNELS)} attention, not {kernel}: "
                "set model.attn_implementation=sdpa"
            )
        self.flatten_packed = kernel in FLATTENED_KERNELS
        self.share_prefix = (
            self.cfg.speed.share_prefix
            and not self.cfg.sft.packing
            and supports_shared_prompt(self.engine.module.config)
        )
        if self.cfg.speed.share_prefix and not self.cfg.sft.packing and not self.share_prefix:
            self.summary_lines.append(
                f"  shared prefix   off: speed.share_prefix needs a text model with "
                f"{' or '.join(DENSE_MASK_ATTENTION)} attention ({kernel} here), plain rows"
            )

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if rows and isinstance(rows[0], PackedSequence):
            return collate_packed(
                rows, pad_id=self.tokenizer.pad_token_id, flatten=self.flatten_packed
            )
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
