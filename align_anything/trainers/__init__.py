"""Trainer registry: task name -> trainer class. A test keeps it in sync with configs/task/."""

from __future__ import annotations

from align_anything.trainers.base import Trainer
from align_anything.trainers.dpo import DPOTrainer
from align_anything.trainers.grpo import GRPOTrainer
from align_anything.trainers.kto import KTOTrainer
from align_anything.trainers.rloo import RLOOTrainer
from align_anything.trainers.rm import RMTrainer
from align_anything.trainers.sft import SFTTrainer

REGISTRY: dict[str, type[Trainer]] = {
    "sft": SFTTrainer,
    "dpo": DPOTrainer,
    "rm": RMTrainer,
    "kto": KTOTrainer,
    "grpo": GRPOTrainer,
    "rloo": RLOOTrainer,
}
