"""Shared prefixes computed once: sequences that start alike run as one row.

DPO: the plain path runs `prompt + chosen` and `prompt + rejected` as two rows, so the prompt
goes through the model twice; in chat data it is most of each row (SmolLM2's template adds a
system prompt of ~30 tokens). Here each pair is one row `prompt + chosen + rejected`. KTO's
reference passes score a row's completion and its KL completion after the same prompt, so they
take the same layout.
SFT: the rows of a micro-batch usually share the system prompt and the template's header; the
micro-batch becomes one row `common prefix + rest_1 + rest_2 + …`.

An attention mask lets each suffix see the prefix and itself but no other suffix, and position
ids restart every suffix where the prefix ends. Every token then sees exactly the keys and
positions it sees in its own row on the plain path, so the log-probs are the same numbers (up to
float summation order), from the prefix once instead of once per sequence, and without padding
between the sequences of a group.

Kernels (`model.attn_implementation`): these layouts run on `sdpa` and `eager`
(`DENSE_MASK_ATTENTION`). transformers passes a 4D mask through unchanged (`masking_utils`), to
SDPA as a boolean mask and to eager attention as an additive float mask. FlashAttention takes no
dense mask, and position ids cannot stand in for it here: a suffix must see the prefix but not
its sibling suffixes, which is no set of separate sequences (packing is, and runs on every kernel:
`data/packing.py`). flex_attention would need the mask rebuilt as a BlockMask; not done. With
those kernels the trainers use plain rows and the start-up summary says why
(`supports_shared_prompt`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from align_anything.data.batches import SharedPrefix
from align_anything.data.encode import IGNORE_INDEX

# Attention implementations that accept a dense 4D mask as given.
DENSE_MASK_ATTENTION = ("sdpa", "eager")


def supports_shared_prompt(config: Any) -> bool:
    """Whether a model (by its config) can run shared-prompt rows: a text-only model whose
    attention takes a dense 4D mask."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text_config is config and getattr(config, "_attn_implementation", None) in (
        DENSE_MASK_ATTENTION
    )


class PrefixGroup(NamedTuple):
    """Sequences that start with the same tokens: `prefix` (no scored target inside it) and the
    rest of each sequence, with its labels (`IGNORE_INDEX` where not scored) and the index of
    the sequence whose sum its log-probs go to."""

    prefix: list[int]
    suffixes: list[list[int]]
    suffix_labels: list[list[int]]
    sequence_ids: list[int]


def mask_dtype(model: Any) -> torch.dtype | None:
    """The `additive_mask_dtype` a model needs: its dtype for eager attention (which adds the
    mask to the scores), None for SDPA (which takes a boolean mask)."""
    return model.dtype if model.config._attn_implementation == "eager" else None


def collate_shared_prefix(
    groups: Sequence[PrefixGroup],
    *,
    num_sequences: int,
    pad_id: int,
    additive_mask_dtype: torch.dtype | None,
) -> SharedPrefix:
    """Batch prefix groups into one right-padded row each: `prefix + suffix_1 + suffix_2 + …`.

    A suffix attends to the prefix and to itself (causally), never to another suffix, and its
    positions continue from the end of the prefix, so every token sees exactly what it sees in
    its own sequence. Returns `input_ids` and `attention_mask` ([G, L]; the 2D mask marks real
    tokens, for counting only), `position_ids` [G, L], `shared_prefix_mask` [G, 1, L, L]
    (boolean, True = may attend; additive 0 / dtype-min when `additive_mask_dtype` is given, for
    eager attention), the scored tokens flattened: `score_positions` (g·L + the position whose
    logits predict the token), `score_targets`, `score_sequences` (the group's sequence id), and
    `num_sequences` (0-d). The first token of every suffix is predicted from the last prefix
    position, which is therefore read once per suffix.
    """
    if not groups:
        raise ValueError("cannot collate an empty batch")
    lengths = [len(g.prefix) + sum(len(s) for s in g.suffixes) for g in groups]
    width = max(lengths)
    shape = (len(groups), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    # Segment per position: 0 prefix, j + 1 suffix j, -1 padding.
    segment = torch.full(shape, -1, dtype=torch.long)
    positions, targets, sequences = [], [], []
    for g, group in enumerate(groups):
        p = len(group.prefix)
        if p == 0:
            raise ValueError("a prefix group needs at least one prefix token")
        ids = list(group.prefix)
        segment[g, :p] = 0
        position_ids[g, :p] = torch.arange(p)
        for j, (suffix, labels, seq) in enumerate(
            zip(group.suffixes, group.suffix_labels, group.sequence_ids, strict=True)
        ):
            start = len(ids)
            ids += suffix
            segment[g, start : len(ids)] = j + 1
            position_ids[g, start : len(ids)] = torch.arange(p, p + len(suffix))
            # Suffix token k is predicted by the position before it in its own sequence.
            for k, label in enumerate(labels):
                if label != IGNORE_INDEX:
                    positions.append(g * width + (p - 1 if k == 0 else start + k - 1))
                    targets.append(label)
                    sequences.append(seq)
        input_ids[g, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[g, : len(ids)] = 1
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # [L(query), L(key)]
    query_seg, key_seg = segment[:, :, None], segment[:, None, :]
    allowed = causal[None] & ((key_seg == 0) | (key_seg == query_seg))
    # A padding query attends to itself only: a row with no allowed key would give NaN.
    eye = torch.eye(width, dtype=torch.bool)[None]
    allowed = torch.where(query_seg == -1, eye, allowed)[:, None]
    mask: Tensor = allowed
    if additive_mask_dtype is not None:
        mask = torch.zeros(allowed.shape, dtype=additive_mask_dtype)
        mask.masked_fill_(~allowed, torch.finfo(additive_mask_dtype).min)
    return SharedPrefix(
        input_ids, attention_mask, position_ids, mask,
        score_positions=torch.tensor(positions, dtype=torch.long),
        score_targets=torch.tensor(targets, dtype=torch.long),
        score_sequences=torch.tensor(sequences, dtype=torch.long),
        num_sequences=num_sequences,
    )  # fmt: skip


def collate_shared_prompt(
    rows: Sequence[Mapping[str, Any]], *, pad_id: int, additive_mask_dtype: torch.dtype | None,
    completions: tuple[str, str] = ("chosen_ids", "rejected_ids"),
) -> SharedPrefix:  # fmt: skip
    """Batch rows with one prompt and two completions into B rows `prompt + first + second`
    (see `collate_shared_prefix`); row i's first completion is sequence i, its second B + i,
    the layout of the plain path. `completions` names the two: a DPO pair's chosen and rejected
    (`encode_preference` rows), or a KTO row's completion and the completion its prompt is
    paired with for the KL estimate."""
    batch = len(rows)
    first, second = completions
    groups = [
        PrefixGroup(
            list(row["prompt_ids"]),
            [list(row[first]), list(row[second])],
            [list(row[first]), list(row[second])],
            [i, batch + i],
        )
        for i, row in enumerate(rows)
    ]
    return collate_shared_prefix(
        groups, num_sequences=2 * batch, pad_id=pad_id, additive_mask_dtype=additive_mask_dtype
    )


def common_unscored_prefix(
    sequences: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]
) -> int:
    """Length of the longest prefix all sequences share, holding no scored target and leaving
    every sequence at least one token of its own."""
    limit = min(len(s) for s in sequences) - 1
    length = 0
    while length < limit and all(s[length] == sequences[0][length] for s in sequences):
        length += 1
    for row_labels in labels:  # targets labels[1:] inside the prefix must all be unscored
        scored = [k for k in range(1, length) if row_labels[k] != IGNORE_INDEX]
        if scored:
            length = min(length, scored[0])
    return length


# An SFT micro-batch becomes one row only when the shared prefix saves at least this share of
# its tokens: attention over one row of all rows costs (sum of lengths)² instead of the sum of
# squares, which a short system prompt in long rows does not pay back.
MIN_SAVED_SHARE = 0.25


def collate_shared_sft(
    rows: Sequence[Mapping[str, Any]], *, pad_id: int, additive_mask_dtype: torch.dtype | None
) -> SharedPrefix | None:
    """One row for a whole SFT micro-batch when its rows start alike (a shared system prompt
    and chat-template header): the common unscored prefix once, then every row's rest. None
    when sharing does not pay: one row, or a prefix that saves less than `MIN_SAVED_SHARE` of
    the micro-batch's tokens."""
    sequences = [list(r["input_ids"]) for r in rows]
    labels = [list(r["labels"]) for r in rows]
    length = common_unscored_prefix(sequences, labels) if len(rows) > 1 else 0
    saved = (len(rows) - 1) * length
    if length < 2 or saved < MIN_SAVED_SHARE * sum(len(s) for s in sequences):
        return None
    group = PrefixGroup(
        sequences[0][:length],
        [s[length:] for s in sequences],
        [lab[length:] for lab in labels],
        list(range(len(rows))),
    )
    return collate_shared_prefix(
        [group], num_sequences=len(rows), pad_id=pad_id, additive_mask_dtype=additive_mask_dtype
    )
