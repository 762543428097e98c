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

from align_anything.families.language.batches import SharedPrefix
from align_anything.families.language.encode import IGNORE_INDEX
from align_anything.families.language.packing import best_fit_decreasing

# Attention implementations that accept a dense 4D mask as given.
DENSE_MASK_ATTENTION = ("sdpa", "eager")


def supports_shared_prompt(config: Any) -> bool:
    """Whether a model (by its config) can run shared-prompt rows: a text-only model whose
    attention takes a dense 4D mask."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text_config is config and getattr(config, "_attn_implementation", None) in (
        DENSE_MASK_ATTENTION
    )


# Image-text and audio-text architectures whose forward puts each item's features in place of
# its placeholder tokens and then runs the language model on ordinary 1D positions: a prompt's
# media tokens may be computed once for several completions (the shared-prompt rows of online
# RL, and one prefill per prompt in generation). LLaVA; Qwen2-Audio with its placeholders
# expanded in the text, as the family writes them (its forward then scatters the clip's
# features over them; tested: tests/test_alm_online.py). Not Qwen2-VL and its kin: their
# positions come from the images' grid (M-RoPE), which a row holding several sequences would
# have to rebuild.
MEDIA_IN_PLACE = ("llava", "qwen2_audio")


def media_in_place(config: Any) -> bool:
    """Whether an image-text or audio-text model's media enter as features at their placeholder
    tokens with 1D positions (`MEDIA_IN_PLACE`), so its prompts can be computed once and
    reused."""
    return getattr(config, "model_type", None) in MEDIA_IN_PLACE


def supports_shared_media_prompt(config: Any) -> bool:
    """Whether an image-text or audio-text model can run online RL's shared-prompt rows (a
    prompt with its media once, its completions after it): media in place and attention that
    takes a dense 4D mask."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kernel = getattr(text_config, "_attn_implementation", None)
    return media_in_place(config) and kernel in DENSE_MASK_ATTENTION


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
    rows: Sequence[Sequence[int]] | None = None,
) -> SharedPrefix:
    """Batch prefix groups into right-padded rows `prefix + suffix_1 + suffix_2 + …`, one group
    per row, or the groups `rows[r]` one after another in row r (no padding between them).

    A suffix attends to its group's prefix and to itself (causally), never to another suffix
    or another group, and its positions continue from the end of the prefix, so every token
    sees exactly what it sees in its own sequence. Returns `input_ids` and `attention_mask`
    ([R, L]; the 2D mask marks real tokens, for counting only), `position_ids` [R, L],
    `shared_prefix_mask` [R, 1, L, L] (boolean, True = may attend; additive 0 / dtype-min when
    `additive_mask_dtype` is given, for eager attention), the scored tokens flattened:
    `score_positions` (r·L + the position whose logits predict the token), `score_targets`,
    `score_sequences` (the group's sequence id), `sequence_ends` (r·L + the position of each
    sequence's last token, by sequence id; -1 for an id no group has), and `num_sequences`.
    The first token of every suffix is predicted from the last prefix position, which is
    therefore read once per suffix.
    """
    if not groups:
        raise ValueError("cannot collate an empty batch")
    rows = [[g] for g in range(len(groups))] if rows is None else [list(r) for r in rows]
    if sorted(g for row in rows for g in row) != list(range(len(groups))):
        raise ValueError(f"rows {rows} must place each of the {len(groups)} groups once")
    group_lengths = [len(g.prefix) + sum(len(s) for s in g.suffixes) for g in groups]
    width = max(sum(group_lengths[g] for g in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    # Per position: the group's place in its row (-1 padding) and the segment in the group
    # (0 prefix, j + 1 suffix j, -1 padding).
    block = torch.full(shape, -1, dtype=torch.long)
    segment = torch.full(shape, -1, dtype=torch.long)
    ends = torch.full((num_sequences,), -1, dtype=torch.long)
    positions, targets, sequences = [], [], []
    for r, row in enumerate(rows):
        ids: list[int] = []
        for b, g in enumerate(row):
            group = groups[g]
            p, base = len(group.prefix), len(ids)
            if p == 0:
                raise ValueError("a prefix group needs at least one prefix token")
            ids += group.prefix
            block[r, base : len(ids)] = b
            segment[r, base : len(ids)] = 0
            position_ids[r, base : len(ids)] = torch.arange(p)
            for j, (suffix, labels, seq) in enumerate(
                zip(group.suffixes, group.suffix_labels, group.sequence_ids, strict=True)
            ):
                start = len(ids)
                ids += suffix
                block[r, start : len(ids)] = b
                segment[r, start : len(ids)] = j + 1
                position_ids[r, start : len(ids)] = torch.arange(p, p + len(suffix))
                ends[seq] = r * width + len(ids) - 1
                # Suffix token k is predicted by the position before it in its own sequence.
                for k, label in enumerate(labels):
                    if label != IGNORE_INDEX:
                        positions.append(r * width + (base + p - 1 if k == 0 else start + k - 1))
                        targets.append(label)
                        sequences.append(seq)
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, : len(ids)] = 1
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # [L(query), L(key)]
    query_seg, key_seg = segment[:, :, None], segment[:, None, :]
    same_group = block[:, :, None] == block[:, None, :]
    allowed = causal[None] & same_group & ((key_seg == 0) | (key_seg == query_seg))
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
        sequence_ends=ends,
    )  # fmt: skip


def collate_shared_prompt(
    rows: Sequence[Mapping[str, Any]], *, pad_id: int, additive_mask_dtype: torch.dtype | None,
    completions: tuple[str, str] = ("chosen_ids", "rejected_ids"), pack: bool = False,
) -> SharedPrefix:  # fmt: skip
    """Batch rows with one prompt and two completions into B rows `prompt + first + second`
    (see `collate_shared_prefix`); row i's first completion is sequence i, its second B + i,
    the layout of the plain path. `completions` names the two: a DPO pair's chosen and rejected
    (`encode_preference` rows), or a KTO row's completion and the completion its prompt is
    paired with for the KL estimate. With `pack`, short groups share a row: best-fit
    decreasing into rows as long as the longest group, so the batch is never wider and has
    fewer padded positions (the same numbers: groups never see each other)."""
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
    packed_rows = None
    if pack:
        lengths = [len(g.prefix) + sum(map(len, g.suffixes)) for g in groups]
        packed_rows = best_fit_decreasing(lengths, max(lengths)).as_lists()
    return collate_shared_prefix(
        groups, num_sequences=2 * batch, pad_id=pad_id, additive_mask_dtype=additive_mask_dtype,
        rows=packed_rows,
    )  # fmt: skip


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


def collate_packed_sft(
    rows: Sequence[Mapping[str, Any]], *, pad_id: int, additive_mask_dtype: torch.dtype | None
) -> SharedPrefix | None:
    """An SFT micro-batch's rows placed best-fit decreasing into fewer rows, none wider than
    its longest (see `collate_shared_prefix`: the mask keeps them apart, positions restart per
    sequence), so a long row no longer pads every short one to its width, and attention costs
    no more per row. None when no two rows fit in one."""
    lengths = [len(r["input_ids"]) for r in rows]
    placed = best_fit_decreasing(lengths, max(lengths)).as_lists()
    if len(placed) == len(rows):
        return None
    # Each sequence is its own group: its first token (never a target) as the prefix.
    groups = [
        PrefixGroup(
            list(r["input_ids"][:1]), [list(r["input_ids"][1:])], [list(r["labels"][1:])], [i]
        )
        for i, r in enumerate(rows)
    ]
    return collate_shared_prefix(
        groups, num_sequences=len(rows), pad_id=pad_id, additive_mask_dtype=additive_mask_dtype,
        rows=placed,
    )  # fmt: skip
