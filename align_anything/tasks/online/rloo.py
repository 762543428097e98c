"""REINFORCE leave-one-out (RLOO; Kool et al. 2019, Ahmadian et al. 2024), as TRL 1.16's
`RLOOTrainer`: each completion's baseline is the mean reward of the other completions of its
prompt; the KL to the reference is a penalty in the reward, r − β·Σ_t (log π_old − log π_ref)
(`losses.rloo_reward_with_kl`, from the log-probs at generation time); the loss is the clipped
sequence-level REINFORCE objective (`losses.rloo_per_sequence_loss`), a mean over the global
batch's completions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from align_anything.backend import distributed as comm
from align_anything.families.language.family import LANGUAGE_MODELS
from align_anything.losses import (
    rloo_advantages,
    rloo_per_sequence_loss,
    rloo_reward_with_kl,
    rloo_sequence_kl,
)
from align_anything.tasks.online import common as online
from align_anything.tasks.online import rollouts
from align_anything.training.run import Run
from align_anything.training.task import TaskSpec


@dataclass
class RLOO(online.SequenceAdvantages):
    """RLOO's advantages and loss (the `online.Algorithm` of task=rloo)."""

    rl: Any  # the rloo section
    global_batch: int
    name: str = "rloo"
    importance_level: str = "sequence"  # its loss and ratio are per completion

    def old_logps_for_reward(self) -> bool:
        """With β > 0 the KL penalty in the reward needs the log-probs at generation time."""
        return self.rl.beta > 0

    def rewards_for_advantages(
        self, rewards: list[float], batches: list[online.RolloutBatch]
    ) -> tuple[list[float], dict[str, float]]:
        """With β > 0, the reward minus β × the completion's KL to the reference; the KL's
        mean over the global batch is logged (TRL's `kl`). Collective then."""
        if self.rl.beta <= 0:
            return rewards, {}
        kl = torch.cat([
            rloo_sequence_kl(b.old_logps, b.ref_logps, b.loss_mask).cpu() for b in batches
        ])  # fmt: skip
        (total,), _ = comm.sum_metrics({"kl": kl.sum().double()}, ["kl"])
        adjusted = rloo_reward_with_kl(torch.tensor(rewards), kl.float(), self.rl.beta)
        return adjusted.tolist(), {"kl": total / self.global_batch}

    def advantages(self, rewards: Tensor) -> Tensor:
        return rloo_advantages(
            rewards, self.rl.num_generations, normalize_advantages=self.rl.normalize_advantages
        )

    def count_items(self, batch: online.RolloutBatch) -> int:
        return int(batch.loss_mask.shape[0])

    def loss(
        self, task: online.OnlineRL, batch: online.RolloutBatch, *, normalizer: float
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        mask = batch.loss_mask
        logps = (task.token_logps(task.policy, batch) * mask).sum(-1)
        old = batch.old_logps
        old = logps.detach() if old is None else (old * mask).sum(-1)
        low, high = self.rl.clip_range()
        losses, stats = rloo_per_sequence_loss(
            logps, old, batch.advantages, epsilon_low=low, epsilon_high=high
        )
        if batch.is_weights is not None:  # rollout.importance_sampling (per sequence)
            losses = losses * batch.is_weights
        total = losses.sum()
        metrics = {
            "loss": total.detach(),
            "clip_ratio/low_mean": stats.is_low_clipped.sum(),
            "clip_ratio/high_mean": stats.is_high_clipped.sum(),
            "clip_ratio/region_mean": stats.is_region_clipped.sum(),
        }
        return {"policy": total / normalizer}, metrics


def build(run: Run) -> tuple[online.OnlineRL, rollouts.Rollouts]:
    return rollouts.build_online(run, RLOO(run.cfg.rloo, run.ds_plan.batch.global_batch))


SPEC = TaskSpec(
    name="rloo", record_kind="prompt", family=LANGUAGE_MODELS, encoding=online.encoding,
    build=build, check=online.check_rewards, schedule=online.schedule,
)  # fmt: skip
