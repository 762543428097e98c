"""Supervised fine-tuning: next-token loss on assistant tokens (prompt, template and padding
masked), averaged over every target token of the global batch.

With `sft.packing` the training rows are packed once (`data/packing.py`: best-fit decreasing into
sequences of up to `data.max_length` tokens); the training rows become the packed view, so the
seeded batching draws packed sequences, and the loss (a sum over the same scored tokens over
the same global token count) is that of the unpacked rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from align_anything.config import RunConfig
from align_anything.errors import ConfigError
from align_anything.families.language import IGNORE_INDEX, collate_sft
from align_anything.families.language.batches import Layout, SharedPrefix
from align_anything.families.language.encode import Encoding
from align_anything.families.language.family import (
    LANGUAGE_MODELS,
    ModelSide,
    completion_only_logits,
)
from align_anything.families.language.forward import sequence_logps
from align_anything.families.language.layouts import (
    DENSE_MASK_ATTENTION,
    collate_packed_sft,
    collate_shared_sft,
    mask_dtype,
    supports_shared_prompt,
)
from align_anything.families.language.multimodal import MediaSupport
from align_anything.families.language.packing import (
    FLATTENED_KERNELS,
    PACKING_KERNELS,
    PackedRows,
    PackedSequence,
    best_fit_decreasing,
    collate_packed,
    fill_share,
)
from align_anything.training.run import Data, Run
from align_anything.training.sources import RowBatches, row_batches
from align_anything.training.task import LossOutput, Task, TaskSpec


def encoding(cfg: RunConfig) -> Encoding:
    return Encoding("sft", all_labels=not cfg.sft.assistant_only_loss)


def pack_rows(cfg: RunConfig, model: ModelSide, data: Data) -> list[str]:
    """With `sft.packing`: the training rows replaced by their packed view (bins of row
    indices, assigned once by best-fit decreasing); step batches then count packed sequences."""
    if not cfg.sft.packing:
        return []
    if model.media is not None:
        raise ConfigError(
            "sft.packing packs text rows only; this model takes media "
            f"({', '.join(model.media.modalities)}): set sft.packing=false"
        )
    capacity = cfg.data.max_length
    rows = len(data.train)
    bins = best_fit_decreasing(data.lengths, capacity)
    data.train = PackedRows(data.train, bins)
    data.train_unit = "packed sequences"  # what the start-up summary counts
    data.lengths = bins.lengths.tolist()
    # A resume that toggles packing would draw other steps: refuse it as other data.
    data.fingerprints["data_fingerprint"] += f"+packed{capacity}"
    return [
        f"  packing         {rows} rows in {len(bins)} packed sequences of <= {capacity} "
        f"tokens: {fill_share(bins, capacity):.1%} real tokens (sft.packing; the batch "
        "size counts packed sequences)"
    ]


@dataclass
class SFT(Task):
    """The SFT task: a batch is one layout (`Rows`, `Packed` or `SharedPrefix`)."""

    policy: Any
    pad_id: int
    media: MediaSupport | None
    completion_only: bool
    share_prefix: bool  # a micro-batch's common prefix once (speed.share_prefix)
    flatten_packed: bool  # packed rows as one row (flash-attention's varlen layout)
    mask_dtype: torch.dtype | None
    name: str = "sft"
    count_unit: str = "tokens"
    metric_keys: tuple[str, ...] = ("loss",)

    def collate(self, rows: list[dict]) -> Layout:
        if rows and isinstance(rows[0], PackedSequence):
            return collate_packed(rows, pad_id=self.pad_id, flatten=self.flatten_packed)
        if self.share_prefix:
            # The common prefix once when it pays; else short rows sharing rows (no padding
            # to the longest row's width); else plain rows.
            layout = collate_shared_sft(
                rows, pad_id=self.pad_id, additive_mask_dtype=self.mask_dtype
            ) or collate_packed_sft(rows, pad_id=self.pad_id, additive_mask_dtype=self.mask_dtype)
            if layout is not None:
                return layout
        batch = collate_sft(rows, pad_id=self.pad_id)
        return self.media.attach(batch, rows, copies=1) if self.media is not None else batch

    def count_items(self, batch: Layout) -> int:
        if isinstance(batch, SharedPrefix):
            return int(batch.score_targets.numel())
        # Targets are labels[:, 1:] (position t predicts token t+1).
        return int((batch.labels[:, 1:] != IGNORE_INDEX).sum())

    def count_tokens(self, batch: Layout) -> int:
        return batch.tokens

    def loss(self, batch: Layout, *, normalizer: float, training: bool) -> LossOutput:
        logp_sum, _ = sequence_logps(self.policy, batch, completion_only=self.completion_only)
        nll = -logp_sum.sum()
        return LossOutput({"policy": nll / normalizer}, {"loss": nll.detach()})

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if "loss" in metrics:
            metrics["perplexity"] = math.exp(min(metrics["loss"], 50.0))
        return metrics


def build(run: Run) -> tuple[SFT, RowBatches]:
    cfg, policy = run.cfg, run.policy
    kernel = policy.module.config._attn_implementation
    if cfg.sft.packing and kernel not in PACKING_KERNELS:
        raise ConfigError(
            f"sft.packing runs on {', '.join(PACKING_KERNELS)} attention, not {kernel}: "
            "set model.attn_implementation=sdpa"
        )
    share_prefix = (
        cfg.speed.share_prefix
        and not cfg.sft.packing
        and supports_shared_prompt(policy.module.config)
    )
    if cfg.speed.share_prefix and not cfg.sft.packing and not share_prefix:
        run.summary.append(
            f"  shared prefix   off: speed.share_prefix needs a text model with "
            f"{' or '.join(DENSE_MASK_ATTENTION)} attention ({kernel} here), plain rows"
        )
    task = SFT(
        policy=policy, pad_id=run.model.tokenizer.pad_token_id, media=run.model.media,
        completion_only=completion_only_logits(cfg, policy), share_prefix=share_prefix,
        flatten_packed=kernel in FLATTENED_KERNELS, mask_dtype=mask_dtype(policy.module),
    )  # fmt: skip
    return task, row_batches(run, task.collate)


SPEC = TaskSpec(
    name="sft", record_kind="conversation", family=LANGUAGE_MODELS, encoding=encoding,
    build=build, prepare_data=pack_rows,
)  # fmt: skip
