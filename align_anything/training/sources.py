"""The step source of offline tasks: each optimizer step's micro-batches are seeded batches of
the encoded training rows (`batching`: a pure function of the seed, the epoch and the step, so
the same rows form a step on any number of ranks and after a resume)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from align_anything.backend.ds_config import BatchPlan
from align_anything.config import RunConfig
from align_anything.training.batching import plan_steps, rank_step_rows, to_device
from align_anything.training.run import Data, Run, Schedule
from align_anything.training.task import StepBatches

# A step's rows from their indices: (step, row indices) -> encoded rows.
RowsOfStep = Callable[[int, list[int]], list[dict]]


def row_schedule(cfg: RunConfig, data: Data, batch: BatchPlan) -> Schedule:
    """Epochs of global batches of the training rows (`train.max_steps` > 0 overrides
    `train.epochs`), with `train.warmup_ratio` of them warming up."""
    train = cfg.train
    per_epoch, total, warmup = plan_steps(
        len(data.train), batch, max_steps=train.max_steps, epochs=train.epochs,
        warmup_ratio=train.warmup_ratio,
    )  # fmt: skip
    return Schedule(per_epoch, total, warmup)


class RowBatches:
    """This rank's micro-batches of each step: the step's seeded rows
    (`batching.rank_step_rows`; grouped by length when `lengths` is given), made into batches
    by the task's `collate`, on `device`. `rows_of_step` turns a step's row indices into rows
    (default: the rows themselves; KTO adds the completion each row's prompt is paired with
    for its KL estimate, which depends on the step)."""

    def __init__(
        self, rows: Sequence[dict], batch: BatchPlan, *, rank: int, seed: int,
        steps_per_epoch: int, collate: Callable[[list[dict]], Any], device: Any = "cpu",
        lengths: Sequence[int] | None = None, rows_of_step: RowsOfStep | None = None,
    ) -> None:  # fmt: skip
        self.rows = rows
        self.batch = batch
        self.rank = rank
        self.seed = seed
        self.steps_per_epoch = steps_per_epoch
        self.collate = collate
        self.device = device
        self.lengths = lengths
        self.rows_of_step = rows_of_step or (lambda step, indices: [rows[i] for i in indices])

    def step(self, step: int) -> StepBatches:
        slices = rank_step_rows(
            step, len(self.rows), self.batch, rank=self.rank, seed=self.seed,
            steps_per_epoch=self.steps_per_epoch, lengths=self.lengths,
        )  # fmt: skip
        return StepBatches(
            [to_device(self.collate(self.rows_of_step(step, s)), self.device) for s in slices]
        )

    def save(self, folder: Path, step: int) -> None:
        pass  # a step's rows are a function of the seed and the step: nothing to save


def row_batches(
    run: Run, collate: Callable[[list[dict]], Any], *, rows_of_step: RowsOfStep | None = None
) -> RowBatches:
    """The run's training rows as a step source (`speed.group_by_length`: length-grouped)."""
    return RowBatches(
        run.data.train, run.ds_plan.batch, rank=run.dist.rank, seed=run.cfg.train.seed,
        steps_per_epoch=run.schedule.steps_per_epoch, collate=collate, device=run.policy.device,
        lengths=run.data.lengths if run.cfg.speed.group_by_length else None,
        rows_of_step=rows_of_step,
    )  # fmt: skip
