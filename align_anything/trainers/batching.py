"""Which rows form each optimizer step and each rank's micro-batches: pure functions of the
seed, the epoch and the step, so the same rows form a step whatever the world size or
micro-batch split, and a resumed run needs only the step number."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch


def step_indices(
    num_rows: int, *, global_batch: int, seed: int, epoch: int, step: int
) -> list[int]:
    """Row indices of one optimizer step's global batch: a seeded permutation per epoch cut
    into consecutive global batches. Depends only on (seed, epoch, step), so the same rows form
    each step whatever the world size or micro-batch split, and resume needs only the step."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(num_rows, generator=generator)
    return order[step * global_batch : (step + 1) * global_batch].tolist()


def row_tokens(row: dict[str, Any]) -> int:
    """Tokens an encoded row puts through the model (every id list it carries: an SFT row's
    `input_ids`, a pair's prompt, chosen and rejected ids)."""
    return sum(len(v) for k, v in row.items() if k.endswith("ids") and isinstance(v, list))


def group_by_length(indices: list[int], lengths: list[int]) -> list[int]:
    """The same rows, longest first (ties keep their order): cut into micro-batches by
    `rank_micro_batches`, each micro-batch then holds rows of similar length, so padding to its
    longest row costs little, and the ranks of one micro-step get neighbouring lengths."""
    return sorted(indices, key=lambda i: -lengths[i])


def rank_micro_batches(
    indices: list[int], *, micro: int, accum: int, world: int, rank: int
) -> list[list[int]]:
    """This rank's micro-batches of a global batch: micro-batch m of rank r takes the slice
    (m·world + r)·micro … +micro."""
    return [
        indices[(m * world + rank) * micro : (m * world + rank + 1) * micro] for m in range(accum)
    ]


def shard_chunks(
    num_items: int, *, chunk: int, rank: int, world: int
) -> Iterator[list[int] | None]:
    """This rank's share of `range(num_items)` (every world-th item) in chunks of `chunk`.

    Every rank yields the same number of chunks, because forward passes under ZeRO-3 are
    collective; a rank whose share has run out yields None, and should run a dummy batch and
    discard it.
    """
    mine = list(range(rank, num_items, world))
    per_rank = math.ceil(num_items / world)
    for start in range(0, per_rank, chunk):
        yield mine[start : start + chunk] or None
