"""Pad encoded rows into batches. Rows are right-padded to the longest row in the batch.

`attention_mask` comes from the row lengths, never from comparing ids with `pad_id`: many chat
models pad with their end-of-turn token (SmolLM2: `<|im_end|>`, id 2), which is also a real,
trained token inside every row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from align_anything.data.encode import IGNORE_INDEX
from align_anything.errors import DataError


def pad_right(sequences: Sequence[Sequence[int]], *, pad_id: int) -> dict[str, Tensor]:
    """Right-pad token id lists into `input_ids` and `attention_mask` ([B, T], T the longest);
    the mask comes from the lengths (see the module docstring)."""
    if not sequences:
        raise ValueError("cannot collate an empty batch")
    if not isinstance(pad_id, int):
        raise ValueError(
            f"pad_id must be an int, got {pad_id!r}; use tokenizer.pad_token_id, or "
            "tokenizer.eos_token_id for tokenizers without a pad token"
        )
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, ids in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def _pad(
    sequences: Sequence[Sequence[int]], label_sequences: Sequence[Sequence[int]], pad_id: int
) -> dict[str, Tensor]:
    batch = pad_right(sequences, pad_id=pad_id)
    labels = torch.full(batch["input_ids"].shape, IGNORE_INDEX, dtype=torch.long)
    for i, (ids, row_labels) in enumerate(zip(sequences, label_sequences, strict=True)):
        if len(row_labels) != len(ids):
            raise ValueError(f"row {i}: {len(row_labels)} labels for {len(ids)} ids")
        labels[i, : len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
    return {**batch, "labels": labels}


def collate_sft(rows: list[Mapping[str, Any]], *, pad_id: int) -> dict[str, Tensor]:
    """Batch `encode_sft` rows: `input_ids`, `attention_mask`, `labels`, each [B, T]; padding
    is `pad_id` in `input_ids`, 0 in `attention_mask` and -100 in `labels`."""
    return _pad([r["input_ids"] for r in rows], [r["labels"] for r in rows], pad_id)


def collate_preference(rows: list[Mapping[str, Any]], *, pad_id: int) -> dict[str, Tensor]:
    """Batch `encode_preference` rows into 2B sequences: rows 0..B-1 are prompt + chosen,
    rows B..2B-1 prompt + rejected (same order). `labels` is -100 on prompt and padding.
    Adds `margin` [B] (float32) when the rows carry one."""
    sequences, labels = [], []
    for key in ("chosen_ids", "rejected_ids"):
        for row in rows:
            prompt, completion = list(row["prompt_ids"]), list(row[key])
            sequences.append(prompt + completion)
            labels.append([IGNORE_INDEX] * len(prompt) + completion)
    batch = _pad(sequences, labels, pad_id)
    with_margin = [row.get("margin") is not None for row in rows]
    if any(with_margin):
        if not all(with_margin):
            raise DataError(
                f"{with_margin.count(False)} of {len(rows)} rows in a batch have no margin; "
                "give every row a margin or none"
            )
        batch["margin"] = torch.tensor([float(row["margin"]) for row in rows], dtype=torch.float32)
    return batch


def collate_unpaired(rows: list[Mapping[str, Any]], *, pad_id: int) -> dict[str, Tensor]:
    """Batch `encode_unpaired` rows: B sequences prompt + completion (`input_ids`,
    `attention_mask`, `labels` [B, T], -100 on prompt and padding) and `desirable` [B] (bool).
    When the rows carry `kl_ids` (the completion each row's prompt is paired with for KTO's KL
    estimate), also the B sequences prompt + kl_ids as `kl_input_ids`, `kl_attention_mask` and
    `kl_labels` (padded to their own longest row)."""
    batch = _pad(
        [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows],
        [[IGNORE_INDEX] * len(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows],
        pad_id,
    )
    batch["desirable"] = torch.tensor([bool(r["label"]) for r in rows], dtype=torch.bool)
    if "kl_ids" in rows[0]:
        kl = _pad(
            [list(r["prompt_ids"]) + list(r["kl_ids"]) for r in rows],
            [[IGNORE_INDEX] * len(r["prompt_ids"]) + list(r["kl_ids"]) for r in rows],
            pad_id,
        )
        batch.update({f"kl_{key}": value for key, value in kl.items()})
    return batch
