"""The task registry: task name -> `TaskSpec` (how set-up builds it). A test keeps it in sync
with configs/task/ and the config schema's task sections.

Adding a task: a module here with its task (the `training.task.Task` protocol), its `build`
and a `SPEC`; its config section in `config/sections/` (listed in `config.run.TASK_SECTIONS`)
and its YAML in `configs/task/`; a line below. The loop (`training/loop.py`) does not change."""

from __future__ import annotations

from align_anything.tasks import dpo, kto, rm, sft
from align_anything.tasks.diffusion import dance_grpo, flow_grpo, nft
from align_anything.tasks.diffusion import dpo as diffusion_dpo
from align_anything.tasks.diffusion import sft as diffusion_sft
from align_anything.tasks.online import grpo, ppo, rloo
from align_anything.training.task import TaskSpec

TASKS: dict[str, TaskSpec] = {
    "sft": sft.SPEC,
    "dpo": dpo.SPEC,
    "rm": rm.SPEC,
    "kto": kto.SPEC,
    "grpo": grpo.SPEC,
    "rloo": rloo.SPEC,
    "ppo": ppo.SPEC,
    "diffusion_sft": diffusion_sft.SPEC,
    "diffusion_dpo": diffusion_dpo.SPEC,
    "flow_grpo": flow_grpo.SPEC,
    "dance_grpo": dance_grpo.SPEC,
    "diffusion_nft": nft.SPEC,
}
