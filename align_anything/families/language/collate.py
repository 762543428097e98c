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

from align_anything.errors import DataError
from align_anything.families.language.batches import Rows
from align_anything.families.language.encode import IGNORE_INDEX


def pad_rows(
    sequences: Sequence[Sequence[int]], label_sequences: Sequence[Sequence[int]], pad_id: int
) -> Rows:
    """Right-pad token sequences and their labels into one `Rows` batch ([B, T], T the
    longest; the mask comes from the lengths, see the module docstring)."""
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
    labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, row_labels) in enumerate(zip(sequences, label_sequences, strict=True)):
        if len(row_labels) != len(ids):
            raise ValueError(f"row {i}: {len(row_labels)} labels for {len(ids)} ids")
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(row_labels, dtype=torch.long)
    return Rows(input_ids, attention_mask, labels)


def collate_sft(rows: list[Mapping[str, Any]], *, pad_id: int) -> Rows:
    """Batch `encode_sft` rows: `input_ids`, `attention_mask`, `labels`, each [B, T]; padding
    is `pad_id` in `input_ids`, 0 in `attention_mask` and -100 in `labels`."""
    return pad_rows([r["input_ids"] for r in rows], [r["labels"] for r in rows], pad_id)


def collate_preference(rows: list[Mapping[str, Any]], *, pad_id: int) -> Rows:
    """Batch `encode_preference` rows into 2B sequences: rows 0..B-1 are prompt + chosen,
    rows B..2B-1 prompt + rejected (same order). `labels` is -100 on prompt and padding."""
    sequences, labels = [], []
    for key in ("chosen_ids", "rejected_ids"):
        for row in rows:
            prompt, completion = list(row["prompt_ids"]), list(row[key])
            sequences.append(prompt + completion)
            labels.append([IGNORE_INDEX] * len(prompt) + completion)
    return pad_rows(sequences, labels, pad_id)


def collate_margins(rows: list[Mapping[str, Any]]) -> Tensor | None:
    """The pairs' `margin` [B] (float32) when the rows carry one (a reward model's margin
    column), None when none does; an error when only some do."""
    with_margin = [row.get("margin") is not None for row in rows]
    if not any(with_margin):
        return None
    if not all(with_margin):
        raise DataError(
            f"{with_margin.count(False)} of {len(rows)} rows in a batch have no margin; "
            "give every row a margin or none"
        )
    return torch.tensor([float(row["margin"]) for row in rows], dtype=torch.float32)


def collate_unpaired(
    rows: list[Mapping[str, Any]], *, pad_id: int, completion: str = "completion_ids"
) -> Rows:
    """Batch `encode_unpaired` rows: B sequences prompt + `completion` (`input_ids`,
    `attention_mask`, `labels` [B, T], -100 on prompt and padding). `completion="kl_ids"`
    gives the sequences of KTO's KL estimate (each prompt with another row's completion)."""
    return pad_rows(
        [list(r["prompt_ids"]) + list(r[completion]) for r in rows],
        [[IGNORE_INDEX] * len(r["prompt_ids"]) + list(r[completion]) for r in rows],
        pad_id,
    )
