"""What differs between the kinds of model a run can train, behind one typed seam: a
`ModelFamily`, a record of the set-up and export steps that depend on the kind of model.

- language models (`setup.LANGUAGE_MODELS`): the model side is a transformers config and a
  tokenizer or processor; the data are tokenised into the Arrow cache; the trained model is the
  whole transformers model (or a PEFT model); `final/` is a transformers folder.
- text-to-image pipelines (`text_to_image.PIPELINES`): the model side is the pipeline's parts
  read from `model_index.json` and its frozen VAE and text encoders; the data are encoded once
  into VAE latents and text embeddings; the trained model is the denoiser alone; `final/` is a
  diffusers pipeline folder (a LoRA run's: the adapter diffusers' `load_lora_weights` reads).

Each task names its family (`TaskSpec.family`), and `setup.setup` calls the family's steps in
the same order for every run, so the set-up reads top to bottom with no branch on the kind of
model, and the loop never sees one. A model folder of the other kind is one error naming the
tasks that train it (a pipeline given to task=dpo, a causal LM to task=diffusion_dpo).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from align_anything.backend import ds_config as dsc
from align_anything.backend.engine import Engine
from align_anything.config import RunConfig

if TYPE_CHECKING:
    from align_anything.backend.distributed import DistInfo
    from align_anything.plan import DeepSpeedPlan
    from align_anything.training.run import Data, Run, Schedule
    from align_anything.training.task import TaskSpec


@dataclass(frozen=True)
class ModelFacts:
    """The start-up summary's model lines, read off a set-up run: the model's type, parameter
    counts (trained by the engine; frozen, here or outside it), the per-part line (None: not
    shown), the attention kernel's line (None: not shown) and the memory planner's estimate."""

    model_type: str
    trainable: int
    frozen: int
    parts: str | None
    attention: str | None
    memory_plan: str


@dataclass(frozen=True)
class ModelFamily:
    """The set-up and export steps of one kind of model (see the module docstring). Every hook
    is a plain function:

    - `load_model_side(cfg, dist, spec)`: what set-up knows of the model before any
      data or trained weights (`run.ModelSide` or `run.PipelineSide`); a folder of another kind
      is a `ModelError` naming the tasks that train it;
    - `build_data(cfg, dist, model, spec)`: the encoded splits through the family's cache
      (local rank 0 builds, every rank opens; a data error stops every rank with one message)
      and their start-up summary lines;
    - `bucket_width(model)`: the width DeepSpeed's bucket sizes follow (h: h², 0.9·h², 10·h);
    - `build_policy(cfg, model, ds_plan, schedule, spec)`: the trained module (ZeRO-3:
      partitioned as it loads) in its engine, and summary lines;
    - `describe(run)`: the start-up summary's model facts;
    - `save_final(run, state)`: rank 0 writes `final/` (and `final-ema/`, `final-merged/`)
      from the gathered full state dict of the policy.
    """

    name: str
    load_model_side: Callable[[RunConfig, DistInfo, TaskSpec], Any]
    build_data: Callable[[RunConfig, DistInfo, Any, TaskSpec], tuple[Data, list[str]]]
    bucket_width: Callable[[Any], int]
    build_policy: Callable[
        [RunConfig, Any, DeepSpeedPlan, Schedule, TaskSpec], tuple[Engine, list[str]]
    ]
    describe: Callable[[Run], ModelFacts]
    save_final: Callable[[Run, Any], None]


def training_engine(
    module: Any, cfg: RunConfig, ds_plan: DeepSpeedPlan, schedule: Schedule
) -> Engine:
    """The DeepSpeed engine that trains `module` with the run's optimizer settings and schedule
    (every family's policy; PPO's critic has its own optimizer settings)."""
    train = cfg.train
    return Engine(
        module, ds_plan.config,
        adam=dsc.AdamSettings(train.learning_rate, train.adam_betas, train.adam_eps,
                              train.weight_decay),
        schedule=train.lr_scheduler, total_steps=schedule.total_steps,
        warmup_steps=schedule.warmup_steps,
    )  # fmt: skip
