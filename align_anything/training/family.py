"""What differs between the kinds of model a run can train, behind one typed seam: a
`ModelFamily`, a record of the set-up, planning and export steps that depend on the kind of
model. Each family is one room under `families/`, which builds its record:

- language models (`families.language.family.LANGUAGE_MODELS`): the model side is a
  transformers config and a tokenizer or processor; the data are tokenised into the Arrow
  cache; the trained model is the whole transformers model (or a PEFT model); `final/` is a
  transformers folder.
- text-to-image pipelines (`families.text_to_image.family.TEXT_TO_IMAGE`): the model side is
  the pipeline's parts read from `model_index.json` and its frozen VAE and text encoders; the
  data are encoded once into VAE latents and text embeddings; the trained model is the
  denoiser alone; `final/` is a diffusers pipeline folder (a LoRA run's: the adapter
  diffusers' `load_lora_weights` reads).

Each task names its family (`TaskSpec.family`), and `setup.setup` calls the family's steps in
the same order for every run, so the set-up reads top to bottom with no branch on the kind of
model, and the loop never sees one. A model folder of the other kind is one error naming the
tasks that train it (a pipeline given to task=dpo, a causal LM to task=diffusion_dpo).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from align_anything.backend import ds_config as dsc
from align_anything.backend.distributed import DistInfo
from align_anything.backend.engine import Engine
from align_anything.config import RunConfig
from align_anything.training.deepspeed_plan import DeepSpeedPlan
from align_anything.training.memory_plan import Estimator
from align_anything.training.run import Data, Run, Schedule


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
    """The set-up, planning and export steps of one kind of model (see the module docstring).
    Every hook is a plain function. `spec` below is the task's registry entry
    (`training.task.TaskSpec`: its name, record kind, encoding and hooks), passed through as
    the family's steps need it.

    - `load_model_side(cfg, dist, spec)`: what set-up knows of the model before any
      data or trained weights (the language family's `ModelSide`, a pipeline family's
      `PipelineSide`); a folder of another kind is a `ModelError` naming the tasks that train it;
    - `build_data(cfg, dist, model, spec)`: the encoded splits through the family's cache
      (local rank 0 builds, every rank opens; a data error stops every rank with one message)
      and their start-up summary lines;
    - `bucket_width(model)`: the width DeepSpeed's bucket sizes follow (h: h², 0.9·h², 10·h);
    - `build_policy(cfg, model, ds_plan, schedule, spec)`: the trained module (ZeRO-3:
      partitioned as it loads) in its engine, and summary lines;
    - `describe(run)`: the start-up summary's model facts;
    - `save_final(run)`: the exported folders (`final/`, and `final-ema/`, `final-merged/`,
      `final-<name>` of an engine beside the policy) from gathered weights; collective, rank 0
      writes;
    - `estimate_memory(cfg, world_size, devices_per_node, precision)`: the memory planner's
      estimate of the run under every shipped preset (`training.memory_plan`).
    """

    name: str
    load_model_side: Callable[[RunConfig, DistInfo, Any], Any]
    build_data: Callable[[RunConfig, DistInfo, Any, Any], tuple[Data, list[str]]]
    bucket_width: Callable[[Any], int]
    build_policy: Callable[[RunConfig, Any, DeepSpeedPlan, Schedule, Any], tuple[Engine, list[str]]]
    describe: Callable[[Run], ModelFacts]
    save_final: Callable[[Run], None]
    estimate_memory: Estimator


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
