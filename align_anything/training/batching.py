"""Which rows form each optimizer step and each rank's micro-batches: pure functions of the
seed, the epoch and the step, so the same rows form a step whatever the world size or
micro-batch split, and a resumed run needs only the step number."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


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


def plan_steps(
    num_rows: int, batch: Any, *, max_steps: int, epochs: int, warmup_ratio: float
) -> tuple[int, int, int]:
    """(steps per epoch, total steps, warmup steps) of a run over `num_rows` rows in global
    batches of `batch.global_batch` (`max_steps` > 0 overrides `epochs`)."""
    from align_anything.errors import ConfigError

    per_epoch = num_rows // batch.global_batch
    if per_epoch == 0:
        raise ConfigError(
            f"the training set has {num_rows} usable rows, fewer than one global batch "
            f"({batch.describe()}): lower train.per_device_batch_size or "
            "train.gradient_accumulation_steps, or add data"
        )
    total = max_steps if max_steps > 0 else per_epoch * epochs
    return per_epoch, total, math.ceil(warmup_ratio * total)


def rank_step_rows(
    step: int, num_rows: int, batch: Any, *, rank: int, seed: int, steps_per_epoch: int,
    lengths: list[int] | None = None,
) -> list[list[int]]:  # fmt: skip
    """This rank's micro-batches (row indices) of optimizer step `step`. With `lengths` and
    gradient accumulation, the step's rows go into micro-batches longest first (the same rows,
    less padding); without accumulation each rank pads only within its one micro-batch, and
    sorting would only hand rank 0 all the longest rows."""
    epoch, in_epoch = divmod(step, steps_per_epoch)
    indices = step_indices(
        num_rows, global_batch=batch.global_batch, seed=seed, epoch=epoch, step=in_epoch
    )
    if lengths is not None and batch.grad_accum > 1:
        indices = group_by_length(indices, lengths)
    return rank_micro_batches(
        indices, micro=batch.micro_batch, accum=batch.grad_accum, world=batch.world_size,
        rank=rank,
    )  # fmt: skip


def to_device(value: T, device: torch.device | str) -> T:
    """`value` with every tensor inside it (dataclass fields, dicts, lists, tuples) on
    `device`; anything else as it is."""
    if isinstance(value, Tensor):
        return value.to(device)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)  # type: ignore[return-value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)  # type: ignore[return-value]
    return value
