"""The `Run`: a typed record of what set-up made (`setup.setup`), handed to the loop and to the
task builders. Each part is its own small record, made by one set-up step:

- `OutputClaim`: the output folder, its lock, the run id and the checkpoint to resume from;
- the model side: what the model family read of the model before any weights load (the
  language family's `ModelSide`: config, tokenizer or processor, media support, attention
  kernel; a pipeline family's `PipelineSide`: its parts, frozen encoders, resolution);
- `Data`: the encoded splits (memory-mapped Arrow), their reports and fingerprints;
- `Schedule`: steps per epoch, total and warmup steps;
- the DeepSpeed plan (`deepspeed_plan.DeepSpeedPlan`), the trained engines, the weight
  average;
- `RunState`: the one part that changes while the loop runs (step, logged history).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align_anything.backend.distributed import DistInfo
from align_anything.backend.engine import Engine
from align_anything.config import RunConfig
from align_anything.data.formats import DataReport
from align_anything.training.deepspeed_plan import DeepSpeedPlan
from align_anything.training.ema import WeightEMA
from align_anything.training.output_dir import Lock
from align_anything.training.tracking import MetricsLogger


@dataclass(frozen=True)
class OutputClaim:
    """The output folder this run holds: its lock (rank 0), the run id, the complete
    checkpoint it resumes from (None: a fresh run), and the step at which the run it resumes
    had finished (None: it had not)."""

    path: Path
    lock: Lock
    run_id: str
    resume_dir: Path | None
    finished_step: int | None = None


@dataclass
class Data:
    """The run's encoded splits, opened from the data cache: `train` (`EncodedRows`, or SFT's
    packed view of them; for text-to-image rows of the latent cache), `eval`, the held-out
    records (for generation checks; text-to-image: the held-out captions), the per-split
    reports (kept, dropped and why), the fingerprints a resume checks, the training rows'
    lengths (for length grouping), what one training item is called in the summary, and other
    encoded sets the task reads (`extra`, from its `prepare_data` hook)."""

    train: Sequence[Any]
    eval: Sequence[Any]
    eval_records: Sequence[Any]
    reports: list[DataReport]
    fingerprints: dict[str, str]
    lengths: Sequence[int]
    train_unit: str = "rows"
    # Encoded sets a task reads beside its own (PPO's ptx conversations), by name.
    extra: dict[str, Sequence[dict]] = field(default_factory=dict)


@dataclass(frozen=True)
class Schedule:
    """How long the run is: optimizer steps per epoch, in all, and of warmup."""

    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    def state(self, cfg: RunConfig) -> dict[str, Any]:
        """The schedule as trainer_state.json records it (a resume compares it)."""
        return {
            "total_steps": self.total_steps, "learning_rate": cfg.train.learning_rate,
            "lr_scheduler": cfg.train.lr_scheduler, "warmup_steps": self.warmup_steps,
        }  # fmt: skip


@dataclass
class RunState:
    """What the loop changes: the optimizer step reached, every logged line (training steps,
    and evaluations with a `phase`), and at the end the step loop's time and each rank's
    (memory before the model, peak memory)."""

    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float | None = None
    peak_memory: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Run:
    """Everything set-up made, for the loop (`loop.train`) and the task builders.

    `model` is what the task's model family read of the model before any weights
    (`training.family.ModelFamily.load_model_side`). `engines` holds the trained DeepSpeed engines
    by name: "policy" always (the model the run
    trains and exports), and any a task trains beside it (PPO's "critic"). `summary` collects
    the start-up summary's lines from every set-up step and task builder. `logger` exists on
    rank 0 once logging has started (`setup.start_logging`). `cleanup` is the run's exit
    stack: a task's part that holds something (a colocated inference engine) registers its
    release there, undone before the process group is left."""

    cfg: RunConfig
    dist: DistInfo
    output: OutputClaim
    model: Any
    data: Data
    ds_plan: DeepSpeedPlan
    schedule: Schedule
    engines: dict[str, Engine]
    ema: WeightEMA | None
    memory_before_model: int
    summary: list[str] = field(default_factory=list)
    state: RunState = field(default_factory=RunState)
    logger: MetricsLogger | None = None
    cleanup: ExitStack | None = None

    @property
    def policy(self) -> Engine:
        return self.engines["policy"]

    def configs(self) -> dict[str, Any]:
        """The resolved run and DeepSpeed configs, as saved beside every checkpoint and model."""
        return {"run_config.json": self.cfg.to_dict(), "ds_config.json": self.ds_plan.config}
