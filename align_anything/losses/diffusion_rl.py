"""Losses of online RL for diffusion models (`flow_grpo`, `dance_grpo`, `diffusion_nft`), pure
functions of tensors.

A sampler whose every denoising step is a Gaussian, x_{k+1} ~ N(μ_θ(x_k, t_k), s_k²·I) with a
known mean and standard deviation (`families.diffusion.sde`), makes a denoising trajectory a
sequence of actions with likelihoods, as a completion's tokens are (Black et al. 2023, DDPO;
Liu et al. 2025, Flow-GRPO, arXiv:2505.05470; Xue et al. 2025, DanceGRPO, arXiv:2505.07818):

- `gaussian_log_prob`: log N(x'; μ, s²) of one step, averaged over the latent's elements (the
  papers' convention; a sum would scale every ratio's exponent by the element count);
- `gaussian_kl`: KL(N(μ, s²) ‖ N(μ_ref, s²)) = (μ − μ_ref)² / (2 s²), averaged the same way:
  the per-step KL to the reference policy of Flow-GRPO's eq. 6 (both steps share s, which
  depends only on the schedule);
- `capped_group_advantages`: GRPO's group-relative advantages (`losses.rl.group_advantages`),
  clipped to ±cap (Flow-GRPO's and DDPO's `adv_clip_max`);
- `step_policy_loss`: the PPO-style clipped ratio per denoising step (GRPO's per-token loss,
  `losses.rl.grpo_per_token_loss`, with steps for tokens), plus β × the Gaussian KL;
- DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117), which needs no likelihood at all:
  `nft_optimality` maps rewards to r ∈ [0, 1] per prompt group, and `nft_loss` is
  r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖² on forward-noised samples, with v⁺ = (1 − β)·v_old + β·v_θ
  and v⁻ = (1 + β)·v_old − β·v_θ (the paper's eq. 6-7, its implicit positive and negative
  policies).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from align_anything.losses.rl import ClipStats, group_advantages, grpo_per_token_loss

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _per_sample_mean(values: Tensor) -> Tensor:
    return values.reshape(values.shape[0], -1).mean(dim=1)


def _as_std(std: Tensor | float, like: Tensor) -> Tensor:
    """A per-sample standard deviation ([B] or a scalar) shaped to broadcast over `like`."""
    std = torch.as_tensor(std, dtype=like.dtype, device=like.device)
    if std.dim() == 0:
        return std
    return std.reshape(-1, *([1] * (like.dim() - 1)))


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor | float) -> Tensor:
    """[B]: the log-density of `sample` under N(`mean`, std²·I), averaged over every element
    but the batch dimension:

        (1/D) Σ_d [ −(x_d − μ_d)² / (2s²) − log s − ½·log 2π ]

    `std` is one value per sample ([B]) or one for all; it must be > 0 (a deterministic step has
    no density: the samplers refuse such a step before any compute). Computed in fp32 at
    least."""
    dtype = torch.promote_types(sample.dtype, torch.float32)
    sample, mean = sample.to(dtype), mean.to(dtype)
    if sample.shape != mean.shape:
        raise ValueError(f"sample {tuple(sample.shape)} and mean {tuple(mean.shape)} differ")
    s = _as_std(std, sample).to(dtype)
    if bool((s <= 0).any()):
        raise ValueError("gaussian_log_prob: a standard deviation <= 0 has no density")
    density = -((sample - mean) ** 2) / (2 * s**2) - torch.log(s) - _LOG_SQRT_2PI
    return _per_sample_mean(density)


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor | float) -> Tensor:
    """[B]: KL(N(`mean`, s²) ‖ N(`ref_mean`, s²)) per element, (μ − μ_ref)² / (2 s²), averaged
    over every element but the batch dimension: the KL of one denoising step of the policy to
    the reference's step from the same latent (both Gaussians share s). ≥ 0; 0 where the means
    agree."""
    dtype = torch.promote_types(mean.dtype, torch.float32)
    mean, ref_mean = mean.to(dtype), ref_mean.to(dtype)
    s = _as_std(std, mean).to(dtype)
    return _per_sample_mean((mean - ref_mean) ** 2 / (2 * s**2))


def capped_group_advantages(
    rewards: Tensor, group_size: int, scale_rewards: Literal["group", "batch", "none"], *,
    cap: float | None,
) -> Tensor:  # fmt: skip
    """[N]: GRPO's group-relative advantages (`losses.rl.group_advantages`: reward minus its
    group's mean, divided by the group's std + 1e-4 with `scale_rewards="group"`; NaN rewards
    left out and given 0), then clipped to [−cap, cap] (None: no clip), as Flow-GRPO and DDPO
    clip theirs (`adv_clip_max`, 5 in both). Rows are grouped contiguously, G per prompt."""
    advantages = group_advantages(rewards, group_size, scale_rewards)
    if cap is None:
        return advantages
    if cap <= 0:
        raise ValueError(f"the advantage cap must be > 0, got {cap}")
    return advantages.clamp(-cap, cap)


class StepLossOutput(NamedTuple):
    """`loss` [B, K] per (image, trained step), unreduced; `clip` the indicators of
    `losses.rl.ClipStats` ([B, K] floats, 1.0 where the clip bites); `kl` [B, K] the Gaussian
    KL per step (None when β = 0); `ratio` [B, K] exp(log π − log π_old)."""

    loss: Tensor
    clip: ClipStats
    kl: Tensor | None
    ratio: Tensor


def step_policy_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, *, epsilon_low: float,
    epsilon_high: float, kl: Tensor | None = None, beta: float = 0.0,
) -> StepLossOutput:  # fmt: skip
    """The clipped policy loss of Flow-GRPO's eq. 6 (and DanceGRPO's, DDPO's) per denoising
    step k of image i:

        ρ_ik = exp(log π_θ(x_{k+1} | x_k) − log π_old(x_{k+1} | x_k))
        ℓ_ik = −min(ρ_ik·A_i, clip(ρ_ik, 1 − ε_low, 1 + ε_high)·A_i) + β·KL_ik

    with `gaussian_log_prob`'s per-element mean log-probs and `gaussian_kl`'s KL. It is GRPO's
    per-token loss (`losses.rl.grpo_per_token_loss`) with steps for tokens, and its KL term
    the Gaussian one instead of k3. When a round serves one optimizer step, `old_logps` is
    `logps.detach()`: ρ = 1 exactly, no clip, and the gradient is −A·∇log π.

    Args:
        logps, old_logps: [B, K] per-step log-probs of the trained steps.
        advantages: [B] one per image.
        kl: [B, K] the Gaussian KL per step; required when beta > 0.
    Returns:
        `StepLossOutput`; aggregate the loss as the mean over an image's trained steps, then
        over images (every image trains the same number of steps).
    """
    loss, clip = grpo_per_token_loss(
        logps, old_logps, advantages, epsilon_low=epsilon_low, epsilon_high=epsilon_high
    )
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    used = None
    if beta > 0:
        if kl is None or kl.shape != logps.shape:
            raise ValueError("beta > 0 needs the per-step KL of the logps' [B, K] shape")
        used = kl
        loss = loss + beta * kl
    return StepLossOutput(loss, clip, used, torch.exp(logps - old_logps).detach())


def nft_optimality(
    rewards: Tensor, group_size: int, *, scale_rewards: Literal["group", "batch", "none"],
    cap: float,
) -> Tensor:  # fmt: skip
    """[N]: DiffusionNFT's optimality probability r ∈ [0, 1] of each sample (the paper's eq. 9,
    r = ½ + ½·clip((r_raw − E[r_raw | c]) / Z_c, −1, 1)), with Z_c = `cap` × the group's std
    (`scale_rewards="group"`; the batch's: "batch"; none: `cap` alone), as its code normalises:
    the group-relative advantage A (`capped_group_advantages`), then r = ½ + ½·A / cap. A
    sample better than its group's mean gets r > ½, the group's best with A ≥ cap gets 1; a
    group of equal rewards gets ½ everywhere (no preference, no gradient)."""
    if cap <= 0:
        raise ValueError(f"the advantage cap must be > 0, got {cap}")
    advantages = capped_group_advantages(rewards, group_size, scale_rewards, cap=cap)
    return 0.5 + 0.5 * advantages / cap


def nft_loss(
    prediction: Tensor, old_prediction: Tensor, target: Tensor, optimality: Tensor, *,
    beta: float,
) -> Tensor:  # fmt: skip
    """[B]: DiffusionNFT's loss of each forward-noised sample (the paper's eq. 8),

        r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖²,   v⁺ = (1 − β)·v_old + β·v_θ,   v⁻ = (1 + β)·v_old − β·v_θ

    with v the target of the forward process at the sample's noise level (the flow velocity
    ε − x₀, or the kind's own target: ε, or v for v-prediction; the paper's argument holds for
    any prediction linear in the noise), v_θ the trained model's `prediction`, v_old the old
    policy's (`old_prediction`, no gradient), r the sample's `optimality` [B]. The squared
    norms are means over the elements. At v_θ = v_old the value is ‖v_old − v‖² whatever r,
    and its gradient 2β·(2r − 1)·(v_old − v)·∇v_θ: samples with r > ½ pull v_θ towards v,
    those with r < ½ push it away, r = ½ does nothing. In fp32 at least."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not (prediction.shape == old_prediction.shape == target.shape):
        raise ValueError(
            f"prediction {tuple(prediction.shape)}, old_prediction "
            f"{tuple(old_prediction.shape)} and target {tuple(target.shape)} must share a shape"
        )
    dtype = torch.promote_types(prediction.dtype, torch.float32)
    theta, old, v = prediction.to(dtype), old_prediction.to(dtype).detach(), target.to(dtype)
    positive = (1 - beta) * old + beta * theta
    negative = (1 + beta) * old - beta * theta
    r = optimality.to(dtype)
    return r * _per_sample_mean((positive - v) ** 2) + (1 - r) * _per_sample_mean(
        (negative - v) ** 2
    )
