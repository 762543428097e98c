"""SFT packing: encoded rows placed into sequences of up to `data.max_length` tokens.

Bins are assigned once over the whole training set by best-fit decreasing (`best_fit_decreasing`)
and stored as row indices only (`PackedBins`: two flat integer arrays), never as new rows: the
rows stay where the data pipeline keeps them (a list today, an Arrow table tomorrow), and
`PackedRows` reads a bin's rows when its batch is collated. The batching layer then treats each
packed sequence as one item: a step's global batch counts packed sequences, as TRL's
`packing=True` does.

`collate_packed` concatenates a bin's rows into one sequence whose position ids restart at every
row, and passes no 2D attention mask. transformers' masking utilities (5.24:
`masking_utils.find_packed_sequence_indices`, used when `attention_mask` is None and no cache is
given) read the restarts and build a block-diagonal causal mask for sdpa and eager attention
(dense) and flex_attention (a BlockMask); FlashAttention-2's varlen path finds the same
boundaries from the position ids (`_is_packed_sequence`), which it recognises only in a batch of
one row, so for flash-attention a micro-batch's packed sequences are flattened into one row
(padding-free). The forward must pass `use_cache=False`: with a cache, transformers skips the
packed-sequence detection and every token would attend across rows.

Loss equality with the unpacked rows: each row's first label is set to `IGNORE_INDEX`. On the
plain path it is never a target (nothing predicts a row's first token); packed, the previous row's
last position would predict it. So a packed micro-batch scores exactly the targets of its rows.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from align_anything.families.language.batches import Packed
from align_anything.families.language.encode import IGNORE_INDEX

# Attention kernels packing runs on, and how: every one through restarting position ids with
# no 2D mask (transformers builds the block mask), flash-attention on one flattened row.
PACKING_KERNELS = ("sdpa", "eager", "flex_attention", "flash_attention_2")
FLATTENED_KERNELS = ("flash_attention_2",)


class PackedBins:
    """Packed sequences as row indices: bin b holds rows `order[offsets[b]:offsets[b + 1]]`
    (two flat int64 arrays: a million rows cost 16 MB, not a million Python lists), and
    `lengths[b]` tokens."""

    def __init__(self, order: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        self.order, self.offsets, self.lengths = order, offsets, lengths

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, b: int) -> list[int]:
        return self.order[self.offsets[b] : self.offsets[b + 1]].tolist()

    def as_lists(self) -> list[list[int]]:
        return [self[b] for b in range(len(self))]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> PackedBins:
    """Assign rows to bins of at most `capacity` tokens by best-fit decreasing: rows longest
    first (ties: lower index first), each into the open bin it fills most tightly (the least
    room left that still fits; of bins with equal room, the one that came to have that room
    first), or a new bin when none fits. Deterministic; bins are numbered in the order they
    were opened, rows within a bin in the order they were placed. The tie rules are TRL 1.16's
    (`trl.data_utils._pack_bfd`), so both pack the same rows into the same sequences.

    Bins with equal room left wait in one queue per room (at most `capacity` distinct rooms,
    kept in a sorted list), so a row costs O(log capacity): a million rows take seconds.
    Hand-written because the one library implementation, TRL's, works only inside its
    dataset preparation and writes new packed rows (we keep row indices)."""
    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and (sizes.min() < 1 or sizes.max() > capacity):
        bad = int(np.flatnonzero((sizes < 1) | (sizes > capacity))[0])
        raise ValueError(
            f"row {bad} has {int(sizes[bad])} tokens; packing needs 1 to {capacity} per row"
        )
    # Stable sort on the negated lengths: longest first, equal lengths in index order.
    by_length = np.argsort(-sizes, kind="stable")
    bins: list[list[int]] = []
    room_of: list[int] = []
    with_room: dict[int, deque[int]] = {}  # room left -> bins with that room, oldest first
    rooms: list[int] = []  # sorted distinct rooms that have a bin
    for row in by_length.tolist():
        size = int(sizes[row])
        k = bisect.bisect_left(rooms, size)
        if k == len(rooms):
            b = len(bins)
            bins.append([])
            room_of.append(capacity)
        else:
            room = rooms[k]
            b = with_room[room].popleft()
            if not with_room[room]:
                del with_room[room], rooms[k]
        bins[b].append(row)
        room_of[b] -= size
        left = room_of[b]
        if left > 0:
            if left not in with_room:
                with_room[left] = deque()
                bisect.insort(rooms, left)
            with_room[left].append(b)
    order = np.fromiter((r for content in bins for r in content), dtype=np.int64, count=sizes.size)
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(content) for content in bins], out=offsets[1:])
    return PackedBins(order, offsets, capacity - np.asarray(room_of, dtype=np.int64))


class PackedSequence(NamedTuple):
    """One packed sequence as the collate step sees it: the rows it concatenates."""

    rows: list[Mapping[str, Any]]


class PackedRows(Sequence):
    """The training set seen as packed sequences: item b is bin b's rows, read from `rows`
    (any indexable of encoded rows) when asked for."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], bins: PackedBins) -> None:
        self.rows, self.bins = rows, bins

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, b: int) -> PackedSequence:  # type: ignore[override]
        return PackedSequence([self.rows[i] for i in self.bins[b]])


def fill_share(bins: PackedBins, capacity: int) -> float:
    """Real tokens per token of `len(bins) × capacity` (the packed sequences at full length:
    what a padded micro-batch computes at most; flash-attention's flattened rows compute no
    padding at all)."""
    return float(bins.lengths.sum()) / max(len(bins) * capacity, 1)


def collate_packed(sequences: Sequence[PackedSequence], *, pad_id: int, flatten: bool) -> Packed:
    """Batch packed sequences: `input_ids`, `labels`, `position_ids` [B, L] (one right-padded
    row per packed sequence) or [1, N] with `flatten` (every row of the micro-batch in one row,
    no padding: flash-attention's varlen layout), and `attention_mask` marking real tokens, for
    counting only: the model must get `position_ids` and no mask (see the module docstring).
    Position ids restart at 0 at every row and in the padding; each row's first label is
    `IGNORE_INDEX`."""
    if not sequences:
        raise ValueError("cannot collate an empty batch")
    if not isinstance(pad_id, int):
        raise ValueError(f"pad_id must be an int, got {pad_id!r}")
    groups = (
        [[row for seq in sequences for row in seq.rows]] if flatten else [s.rows for s in sequences]
    )
    width = max(sum(len(r["input_ids"]) for r in rows) for rows in groups)
    shape = (len(groups), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for g, rows in enumerate(groups):
        start = 0
        for row in rows:
            n = len(row["input_ids"])
            input_ids[g, start : start + n] = torch.tensor(row["input_ids"], dtype=torch.long)
            labels[g, start + 1 : start + n] = torch.tensor(row["labels"][1:], dtype=torch.long)
            position_ids[g, start : start + n] = torch.arange(n)
            start += n
        attention_mask[g, :start] = 1
        # Padding as a run of its own: its queries see only padding, never a real row.
        position_ids[g, start:] = torch.arange(width - start)
    return Packed(input_ids, labels, position_ids, attention_mask)
