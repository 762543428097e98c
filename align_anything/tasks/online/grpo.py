"""Group relative policy optimisation (GRPO, Shao et al. 2024), with DAPO's decoupled clip and
token-level aggregation and Dr. GRPO's constant normaliser (`grpo.loss_type`), as TRL 1.16's
`GRPOTrainer` (token-level importance sampling).

The round (generation, rewards, no-grad passes) is `rollouts.Rollouts`'; this file gives the
group-relative advantages (`losses.group_advantages`, `grpo.scale_rewards`) and the per-token
clipped loss with the k3 KL term (`losses.grpo_per_token_loss`), aggregated with
`losses.loss_sum` over `losses.loss_items` items: completions for grpo / dr_grpo, completion
tokens for dapo, counted over the whole global batch, so the split over ranks and micro-batches
does not change the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from align_anything.families.language.family import LANGUAGE_MODELS
from align_anything.losses import group_advantages, grpo_per_token_loss, loss_items, loss_sum
from align_anything.tasks.online import common as online
from align_anything.tasks.online import rollouts
from align_anything.training.run import Run
from align_anything.training.task import TaskSpec


@dataclass
class GRPO(online.SequenceAdvantages):
    """GRPO's advantages and loss (the `online.Algorithm` of task=grpo)."""

    rl: Any  # the grpo section
    name: str = "grpo"
    importance_level: str = "token"  # rollout.importance_sampling weighs each token's loss

    def rewards_for_advantages(
        self, rewards: list[float], batches: list[online.RolloutBatch]
    ) -> tuple[list[float], dict[str, float]]:
        return rewards, {}

    def advantages(self, rewards: Tensor) -> Tensor:
        return group_advantages(rewards, self.rl.num_generations, self.rl.scale_rewards)

    def count_items(self, batch: online.RolloutBatch) -> int:
        return loss_items(batch.loss_mask, loss_type=self.rl.loss_type)

    def loss(
        self, task: online.OnlineRL, batch: online.RolloutBatch, *, normalizer: float
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        rl = self.rl
        logps = task.token_logps(task.policy, batch)
        old = batch.old_logps
        low, high = rl.clip_range()
        per_token, stats = grpo_per_token_loss(
            logps, logps.detach() if old is None else old, batch.advantages,
            epsilon_low=low, epsilon_high=high, ref_logps=batch.ref_logps, beta=rl.beta,
        )  # fmt: skip
        if batch.is_weights is not None:  # rollout.importance_sampling: TRL applies it here too
            per_token = per_token * batch.is_weights
        mask = batch.loss_mask
        total = loss_sum(
            per_token, mask, loss_type=rl.loss_type, max_completion_length=rl.max_completion_length
        )
        # Token means (kl, clip ratios) leave as sums over tokens; finalize_metrics divides.
        metrics = {
            "loss": total.detach(),
            "count/tokens": mask.sum().double(),
            "tokens/clip_ratio/low_mean": (stats.is_low_clipped * mask).sum(),
            "tokens/clip_ratio/high_mean": (stats.is_high_clipped * mask).sum(),
            "tokens/clip_ratio/region_mean": (stats.is_region_clipped * mask).sum(),
        }
        if stats.kl is not None:
            metrics["tokens/kl"] = (stats.kl.detach() * mask).sum()
        return {"policy": total / normalizer}, metrics


def build(run: Run) -> tuple[online.OnlineRL, rollouts.Rollouts]:
    return rollouts.build_online(run, GRPO(run.cfg.grpo))


SPEC = TaskSpec(
    name="grpo", record_kind="prompt", family=LANGUAGE_MODELS, encoding=online.encoding,
    build=build, check=online.check_rewards, schedule=online.schedule,
)  # fmt: skip
