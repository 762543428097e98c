"""REINFORCE leave-one-out (RLOO; Kool et al. 2019, Ahmadian et al. 2024), as TRL 1.16's
`RLOOTrainer`: each completion's baseline is the mean reward of the other completions of its
prompt; the KL to the reference is a penalty in the reward, r − β·Σ_t (log π_old − log π_ref)
(`losses.rloo_reward_with_kl`, from the log-probs at generation time); the loss is the clipped
sequence-level REINFORCE objective (`losses.rloo_per_sequence_loss`), a mean over the global
batch's completions.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from align_anything.backend import distributed as comm
from align_anything.losses import (
    rloo_advantages,
    rloo_per_sequence_loss,
    rloo_reward_with_kl,
    rloo_sequence_kl,
)
from align_anything.trainers.online import OnlineTrainer


class RLOOTrainer(OnlineTrainer):
    task: ClassVar[str] = "rloo"
    needs_old_logps_for_reward: ClassVar[bool] = True

    def _reward_for_advantages(
        self, total: list[float], micro_batches: list[dict[str, Any]]
    ) -> list[float]:
        if self.reference is None:
            self._kl = None
            return total
        kl = torch.cat([
            rloo_sequence_kl(b["old_logps"], b["ref_logps"], b["loss_mask"]).cpu()
            for b in micro_batches
        ])  # fmt: skip
        # The KL's mean over the global batch is logged (TRL's `kl`).
        (self._kl,), _ = comm.sum_metrics({"kl": kl.sum().double()}, ["kl"])
        self._kl /= self.batch_plan.global_batch
        return rloo_reward_with_kl(torch.tensor(total), kl.float(), self.rl.beta).tolist()

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return rloo_advantages(
            rewards, self.rl.num_generations, normalize_advantages=self.rl.normalize_advantages
        )

    def _round_metrics(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = super()._round_metrics(*args, **kwargs)
        if getattr(self, "_kl", None) is not None:
            metrics["kl"] = float(self._kl)
        return metrics

    def count_items(self, batch: dict[str, Any]) -> int:
        return int(batch["loss_mask"].shape[0])

    def compute_loss(
        self, batch: dict[str, Any], *, normalizer: float, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["loss_mask"]
        logps = (self._token_logps(self.engine, batch) * mask).sum(-1)
        old = batch.get("old_logps")
        old = logps.detach() if old is None else (old * mask).sum(-1)
        low, high = self.rl.clip_range()
        losses, stats = rloo_per_sequence_loss(
            logps, old, batch["advantages"], epsilon_low=low, epsilon_high=high
        )
        total = losses.sum()
        metrics = {
            "loss": total.detach(),
            "clip_ratio/low_mean": stats.is_low_clipped.sum(),
            "clip_ratio/high_mean": stats.is_high_clipped.sum(),
            "clip_ratio/region_mean": stats.is_region_clipped.sum(),
        }
        return total / normalizer, metrics
