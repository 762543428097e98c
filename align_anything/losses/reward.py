"""The pairwise (Bradley-Terry) loss of a scalar reward model. Pure: tensors in, tensors out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def reward_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    *,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley-Terry pairwise loss for a scalar reward model.

    loss = mean(−logσ(r+ − r− − margin)) + center_coef · mean((r+ + r−)²)

    The second term (Eisenstein et al. 2023; TRL's `center_rewards_coefficient`) pulls
    rewards towards zero mean, which the pairwise term alone leaves free.

    Args:
        chosen_rewards, rejected_rewards: one score per pair, same shape ([B] or [B, 1]).
        margin: optional per-pair required margin (e.g. from preference strength), same shape.
        center_coef: weight of the centring term; 0 disables it.

    Returns:
        (scalar loss, detached metrics: `accuracy` (fraction with r+ > r−, ties count as
        wrong), `margin` (mean r+ − r−), `reward_mean` and `reward_std` (population std)
        over all 2B rewards).
    """
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(
            f"chosen and rejected rewards must share one shape, got "
            f"{tuple(chosen_rewards.shape)} and {tuple(rejected_rewards.shape)}"
        )
    if margin is not None and margin.shape != chosen_rewards.shape:
        raise ValueError(
            f"margin must have the rewards' shape {tuple(chosen_rewards.shape)}, "
            f"got {tuple(margin.shape)}"
        )
    if center_coef < 0:
        raise ValueError(f"center_coef must be >= 0, got {center_coef}")
    difference = chosen_rewards - rejected_rewards
    shifted = difference if margin is None else difference - margin
    loss = -F.logsigmoid(shifted).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen_rewards + rejected_rewards) ** 2).mean()
    with torch.no_grad():
        all_rewards = torch.cat([chosen_rewards.flatten(), rejected_rewards.flatten()]).float()
        metrics = {
            "accuracy": (difference > 0).float().mean(),
            "margin": difference.float().mean(),
            "reward_mean": all_rewards.mean(),
            "reward_std": all_rewards.std(correction=0),
        }
    return loss, metrics
