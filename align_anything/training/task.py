"""What a task is, for the one loop (`loop.train`): the `Task` protocol (what differs per task:
collate, item count, loss, metrics, evaluation extras), the `StepSource` protocol (where each
step's micro-batches come from), and `TaskSpec`, the registry's entry that says how set-up
builds a task.

A task is an object with its parts as fields (the policy engine, a reference model, a reward
model, a generation backend, ...), given to it by its `build`; it subclasses `Task` only for
the defaults of the hooks it does not need. The loop calls only what this protocol names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from align_anything.backend.ds_config import BatchPlan
from align_anything.backend.engine import Engine
from align_anything.config import RunConfig
from align_anything.training.deepspeed_plan import DeepSpeedPlan
from align_anything.training.family import ModelFamily
from align_anything.training.run import Data, Run, Schedule


@dataclass
class LossOutput:
    """One micro-batch's loss and metrics.

    `losses`: engine name -> the loss to backpropagate through that engine ("policy" for the
    trained model; PPO adds "critic"), each the micro-batch's summed per-item loss divided by
    the normaliser the loop passed. An engine without an entry gets no update this step.
    `metrics`: metric name -> its sum over the micro-batch's items (the loop sums over ranks
    and divides by the global item count)."""

    losses: dict[str, Tensor]
    metrics: dict[str, Tensor]


class Task(Protocol):
    """What the loop needs from a task. A task class subclasses it (`class SFT(Task)`) and so
    writes only what it changes: the optional hooks below have defaults that do nothing; the
    required ones (`collate`, `count_items`, `count_tokens`, `loss`, and the `name` and
    `metric_keys` fields) have none. It holds no state of its own."""

    name: str
    # Metric names every rank reports in evaluation (so ranks pack the same keys).
    metric_keys: tuple[str, ...]
    # What `samples_per_second` counts ("tokens": not logged, tokens_per_second says it).
    count_unit: str = "samples"
    # Whether the held-out rows get the training loss (False: online RL, whose rows are prompts).
    eval_loss: bool = True
    # Why the task's held-out evaluation is switched off by the config (None: it is not): the
    # closing summary says so instead of guessing that the held-out rows were dropped.
    eval_off: str | None = None

    def collate(self, rows: list[dict]) -> Any:
        """A batch (a dataclass of tensors) from encoded rows."""
        ...

    def count_items(self, batch: Any) -> int:
        """Items the loss averages over (tokens for SFT, pairs for DPO/RM, ...)."""
        ...

    def count_tokens(self, batch: Any) -> int:
        """Real tokens the batch puts through the model (for tokens/s)."""
        ...

    def loss(self, batch: Any, *, normalizer: float, training: bool) -> LossOutput:
        """The micro-batch's loss(es) and metric sums; see `LossOutput`. The normaliser is
        global items in the step / (world × grad_accum), so that after DeepSpeed's averaging
        over ranks and accumulation steps the gradient is that of the mean over every item of
        the global batch, however it is split."""
        ...

    def before_losses(self, batches: Sequence[Any], real: Sequence[bool]) -> None:
        """Work on this rank's micro-batches of a step (or of an evaluation) before any of
        their losses: a statistic of the whole global batch (KTO's KL reference point).
        `real[i]` is False for a rank's dummy evaluation batch. Collective where it reduces.
        Default: nothing."""
        return None

    def finalize_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Derive logged figures from averaged metrics (perplexity from loss, ...). Default:
        the metrics as they are."""
        return metrics

    def after_step(self, step: int) -> None:
        """The task's own work after optimizer step `step` (1-based), before any evaluation or
        checkpoint of that step: the pipeline tasks' samples every `logging.samples_every`
        steps. Collective where it gathers. Default: nothing."""
        return None

    def evaluate_extra(self, label: str) -> dict[str, float]:
        """The task's own held-out figures (generation checks), before and after training.
        Collective. Default: none."""
        return {}

    def summary(self) -> dict[str, Any]:
        """The task's own entries in summary.json. Default: none."""
        return {}


@dataclass
class StepBatches:
    """One optimizer step's input on this rank: its micro-batches (on the device), and what
    producing them measured: global figures to log with the step (online RL's round: rewards,
    lengths, generation speed), the seconds it took (left out of training tokens/s), and rows
    of a completions table to show."""

    batches: list[Any]
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    table: list[dict[str, Any]] = field(default_factory=list)


class StepSource(Protocol):
    """Where each step's micro-batches come from: seeded batches of encoded rows
    (`sources.RowBatches`), or online RL's generation rounds (`tasks.rollouts.Rollouts`)."""

    def step(self, step: int) -> StepBatches:
        """This rank's micro-batches of optimizer step `step` (0-based). Collective."""
        ...

    def save(self, folder: Path, step: int) -> None:
        """Write into checkpoint `folder` (being written, on every rank) what a run resumed
        after `step` steps needs to produce the same next steps beyond the engines, the RNG and
        the step (seeded rows need nothing; an online round served over several steps saves
        itself when the checkpoint falls inside it). Collective."""
        ...


@dataclass(frozen=True)
class TaskSpec:
    """A registry entry: how set-up prepares and builds one task. Every hook is a plain
    function; the optional ones are None where a task needs nothing.

    - `record_kind`: the data format it consumes ("conversation", "preference", "unpaired",
      "prompt"; text-to-image: "captioned" images or image "pairs").
    - `family`: the kind of model it trains (`training.family.ModelFamily`: the language
      family's `LANGUAGE_MODELS`, the text-to-image tasks' `TEXT_TO_IMAGE`).
    - `encoding(cfg)`: how its records are tokenised (the language family's `Encoding`,
      cached); None for the pipeline tasks, whose images and captions go through the
      pipeline's own encoders into the latent cache.
    - `build(run)`: the task and its step source, given the set-up run (reference models,
      reward models, generation backends are made here, as the task's fields).
    - `reward_head`: the trained model is a scalar-head reward model (task=rm).
    - `check(cfg, model)`: checks that need the model's config and tokenizer, before any data.
    - `prepare_data(cfg, model, data)`: work on the opened splits that the cache does not hold
      (RM's pad token, KTO's held-out KL pairs, SFT packing); returns start-up summary lines.
    - `schedule(cfg, data, batch)`: steps per epoch, total and warmup steps (default: epochs
      of global batches of rows, `sources.row_schedule`).
    - `engines(cfg, model, ds_plan, schedule)`: the engines the task trains beside the policy
      (PPO's critic), by name, and their start-up summary lines; built after the policy and
      before a resumed run's checkpoint is loaded, so a resume restores them too.
    """

    name: str
    record_kind: str
    family: ModelFamily
    encoding: Callable[[RunConfig], Any] | None
    build: Callable[[Run], tuple[Task, StepSource]]
    reward_head: bool = False
    check: Callable[[RunConfig, Any], None] | None = None
    prepare_data: Callable[[RunConfig, Any, Data], list[str]] | None = None
    schedule: Callable[[RunConfig, Data, BatchPlan], Schedule] | None = None
    engines: (
        Callable[[RunConfig, Any, DeepSpeedPlan, Schedule], tuple[dict[str, Engine], list[str]]]
        | None
    ) = None
