"""PPO with a critic (Schulman et al. 2017, arXiv:1707.06347, as applied to language models by
Ouyang et al. 2022, InstructGPT) and the critic-free REINFORCE++ (Hu et al. 2025,
arXiv:2501.03262). Pure torch functions.

Layout: every tensor is [B, T] over the completion tokens, left-aligned as
`forward.completion_token_logps` gives them (entry (b, t) is completion token t of row b), with
a `mask` [B, T] that is 1 on the tokens a row has (a prefix of each row: completions are
contiguous) and 0 on padding.

One rollout, in order (the trainer's part in brackets):

1. `per_token_rewards`: the score on the last completion token (optionally clipped), minus the
   k1 KL penalty kl_coef·(log π_old − log π_ref) on every token.
   (REINFORCE++-baseline first subtracts each prompt's mean score: `group_baseline`.)
2. Advantages: `gae` (with the critic's values) or `discounted_returns` (REINFORCE++, no
   critic), then `whiten` over the global batch: [all-reduce `masked_moments`].
3. Losses per token: `ppo_policy_loss` (actor) and `value_loss` (critic), aggregated as
   `losses.rl` aggregates (`loss_sum` / `loss_items`, `loss_type="dapo"`: the token mean over the
   global batch, which no split over ranks or micro-batches changes; OpenRLHF's default
   `token_level_loss=True` is this mean per micro-batch).

Which definitions: OpenRLHF's (`openrlhf/models/utils.py` `compute_reward`,
`experience_maker.py` `get_advantages_and_returns`, `get_cumulative_returns` and the global
advantage normalisation, `models/loss.py` `PolicyLoss`, `ValueLoss`), whose authors wrote the
REINFORCE++ paper. verl (`trainer/ppo/core_algos.py`) agrees on GAE, the clipped policy and
value losses; it differs on REINFORCE++-baseline (no KL in the reward by default, the baseline
subtracted from the summed token rewards); the differences are named where they matter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from align_anything.losses.rl import _clipped_objective, token_advantages

# The advantage estimators of `task=ppo` (`ppo.advantage_estimator`; verl's names).
ADVANTAGE_ESTIMATORS: tuple[str, ...] = (
    "gae",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)
# Added to the variance before its inverse square root when whitening (OpenRLHF clamps the
# variance at this value; TRL and verl add it: the two agree unless the variance is below it).
WHITEN_EPS = 1e-8


def _check_layout(name: str, tensor: Tensor, mask: Tensor) -> None:
    if tensor.dim() != 2 or tensor.shape != mask.shape:
        raise ValueError(
            f"{name} must be [B, T] like the mask {tuple(mask.shape)}, got {tuple(tensor.shape)}"
        )


def last_token_index(mask: Tensor) -> Tensor:
    """[B] the index of each row's last counted token (the highest t with mask 1; 0 for a row
    without any)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return (positions * (mask > 0)).argmax(dim=1)


# --------------------------------------------------------------------------------------------
# Rewards per token
# --------------------------------------------------------------------------------------------


def token_kl(old_logps: Tensor, ref_logps: Tensor, mask: Tensor) -> Tensor:
    """[B, T] the k1 estimate of KL(π_old ‖ π_ref) per token, log π_old − log π_ref (Schulman
    2020; it can be negative, its expectation under π_old is the KL), 0 off the mask. `old_logps`
    are the log-probs of the policy that generated the completion."""
    _check_layout("old_logps", old_logps, mask)
    _check_layout("ref_logps", ref_logps, mask)
    return (old_logps - ref_logps) * mask.to(old_logps.dtype)


def per_token_rewards(
    scores: Tensor,
    mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: float | None = None,
) -> Tensor:
    """[B, T] each token's reward: −kl_coef·k1_t on every completion token, plus the row's
    score (clipped to [−reward_clip, reward_clip] when given) on its last completion token.
    OpenRLHF's `compute_reward` (`reward_clip_range`, `init_kl_coef`; TRL's PPO `kl_coef`).

    Args:
        scores: [B] one score per completion (reward functions, reward model, remote). NaN (no
            reward had an opinion) puts no score on the row: it gets only its KL terms; leave
            such rows out of the loss (their mask 0) if they should not train.
        mask: [B, T] 1 on each row's completion tokens.
        kl: [B, T] `token_kl(old, ref, mask)`; None: no KL term (no reference model).
        kl_coef: β ≥ 0.
        reward_clip: c > 0 or None.
    A row whose mask is all 0 gets all-zero rewards.
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"{tuple(scores.shape)} scores for {mask.shape[0]} rows")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if reward_clip is not None and reward_clip <= 0:
        raise ValueError(f"reward_clip must be > 0 or None, got {reward_clip}")
    dtype = kl.dtype if kl is not None else torch.promote_types(scores.dtype, torch.float32)
    counted = mask > 0
    score = torch.nan_to_num(scores.to(dtype), nan=0.0)
    if reward_clip is not None:
        score = score.clamp(-reward_clip, reward_clip)
    score = score * counted.any(dim=1)  # a row without tokens has nowhere to put its score
    rewards = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    rewards.scatter_(1, last_token_index(mask)[:, None], score[:, None])
    if kl is not None:
        _check_layout("kl", kl, mask)
        rewards = rewards - kl_coef * kl * counted
    return rewards


def group_baseline(scores: Tensor, group_size: int) -> Tensor:
    """[N] REINFORCE++-baseline's scores: each score minus the mean score of its prompt's
    group (G = `group_size` contiguous rows), NaN scores left out of the mean (and left NaN).
    OpenRLHF's `reinforce_baseline` subtracts this before `compute_reward` (so `reward_clip`
    then clips the centred score, and the KL term is added after); verl subtracts the group mean
    of the summed token rewards instead. With G = 1 every score becomes 0."""
    if scores.dim() != 1 or group_size < 1 or scores.numel() % group_size:
        raise ValueError(
            f"{scores.numel()} scores do not split into groups of {group_size} "
            "(N must be prompts × num_generations)"
        )
    grouped = scores.view(-1, group_size)
    return (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over the
    completion tokens, one reversed scan:

        δ_t = r_t + γ·V_{t+1} − V_t           (V past a row's last token = 0: the episode ends)
        A_t = δ_t + γ·λ·A_{t+1}
        R_t = A_t + V_t                        (the critic's regression target)

    `values` [B, T] is V(state before token t) (`forward.completion_token_values`, at
    generation time). Values and rewards off the mask count as 0, so padding adds nothing and
    the advantages and returns are 0 there. As OpenRLHF's `get_advantages_and_returns` and
    verl's `compute_gae_advantage_return` (which whitens inside; here `whiten` is separate).

    Returns:
        (advantages [B, T], returns [B, T]), without gradient; whiten the advantages next.
    """
    _check_layout("rewards", rewards, mask)
    _check_layout("values", values, mask)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    with torch.no_grad():
        weight = mask.to(rewards.dtype)
        values = values.to(rewards.dtype) * weight
        rewards = rewards * weight
        advantages = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        next_value = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            running = delta + gamma * lam * running
            advantages[:, t] = running
            next_value = values[:, t]
        return advantages, advantages + values


def discounted_returns(rewards: Tensor, mask: Tensor, *, gamma: float) -> Tensor:
    """[B, T] REINFORCE++'s returns: G_t = r_t + γ·G_{t+1} over the completion tokens (0 past
    a row's end), the discounted sum of the rewards from token t on. With the score on the last
    token and the KL penalty on every token, G_t = γ^(L−1−t)·score − kl_coef·Σ_{k≥t}
    γ^(k−t)·k1_k. The advantages are these returns whitened over the global batch (`whiten`).
    OpenRLHF's `get_cumulative_returns` (it forces γ = 1 for the baseline variant) and verl's
    REINFORCE++ estimator."""
    _check_layout("rewards", rewards, mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    with torch.no_grad():
        rewards = rewards * mask.to(rewards.dtype)
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[1])):
            running = rewards[:, t] + gamma * running
            returns[:, t] = running
        return returns


def masked_moments(values: Tensor, mask: Tensor) -> Tensor:
    """[3] float64 (count, Σx, Σx²) of `values` over the mask. Sum these over every rank (one
    all-reduce) for the global batch's `whiten` / `explained_variance`; in float64, so the
    variance Σx²/n − mean² keeps its digits for the values these see (advantages, returns)."""
    _check_layout("values", values, mask)
    weight = mask.to(torch.float64)
    x = values.detach().to(torch.float64)
    return torch.stack([weight.sum(), (x * weight).sum(), (x * x * weight).sum()])


def moments_mean_var(moments: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, biased variance) from `masked_moments` (summed over ranks); (0, 0) for no values."""
    count = moments[0].clamp(min=1.0)
    mean = moments[1] / count
    return mean, (moments[2] / count - mean * mean).clamp(min=0.0)


def whiten(
    values: Tensor,
    mask: Tensor,
    *,
    moments: Tensor | None = None,
    shift_mean: bool = True,
    eps: float = WHITEN_EPS,
) -> Tensor:
    """(x − mean) / sqrt(var + eps) over the masked values, 0 off the mask; with
    `shift_mean=False` the mean is added back ((x − mean)/std + mean: the scale changes, not
    the centre; TRL's `masked_whiten(shift_mean=False)`, used for rewards).

    `moments`: the global batch's `masked_moments` (all-reduced); None: this batch's own. The
    variance is the biased (1/n) one, as OpenRLHF's advantage normalisation (TRL's and verl's
    `masked_whiten` use the unbiased one: a factor n/(n−1), negligible at thousands of tokens).
    """
    _check_layout("values", values, mask)
    if moments is None:
        moments = masked_moments(values, mask)
    mean, var = moments_mean_var(moments)
    mean, scale = mean.to(values.dtype), (var + eps).rsqrt().to(values.dtype)
    whitened = (values - mean) * scale
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


def explained_variance(
    values: Tensor, returns: Tensor, mask: Tensor, *, moments: Tensor | None = None
) -> Tensor:
    """1 − Var[R − V] / Var[R] over the masked tokens (0-d float64): 1 when the critic predicts
    the returns exactly, 0 when it does no better than their mean, negative when worse. NaN
    when the returns do not vary. `moments`: the global batch's
    `explained_variance_moments` (all-reduced); None: this batch's own."""
    if moments is None:
        moments = explained_variance_moments(values, returns, mask)
    _, residual_var = moments_mean_var(moments[:3])
    _, returns_var = moments_mean_var(moments[3:])
    if returns_var <= 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    return 1.0 - residual_var / returns_var


def explained_variance_moments(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """[6] float64: `masked_moments` of R − V, then of R; sum over ranks for `explained_variance`."""
    return torch.cat([masked_moments(returns - values, mask), masked_moments(returns, mask)])


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


class PolicyStats(NamedTuple):
    """Per-token floats [B, T]; their masked means over the global batch are the logged figures.

    - `approx_kl`: ½·(log π − log π_old)², the estimate of KL(π_old ‖ π) TRL's PPO logs
      (`policy/approxkl_avg`); how far the update has moved the policy from the rollout's.
    - `clipped`: 1 where the clipped surrogate is the one taken (the ratio left
      [1 − ε_low, 1 + ε_high] in the direction the advantage pushes): the clip fraction
      (TRL's `policy/clipfrac_avg`, OpenRLHF's `clip_ratio`).
    - `dual_clipped`: 1 where dual-clip's bound −c·A replaced the loss (A < 0 only).
    """

    approx_kl: Tensor
    clipped: Tensor
    dual_clipped: Tensor


def ppo_policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, PolicyStats]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, eq. 7):

        ρ_t = exp(log π − log π_old)
        ℓ_t = −min(ρ_t·A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A_t)
        dual clip (Ye et al. 2020, arXiv:1912.09729), c > 1, where A_t < 0:
        ℓ_t = min(ℓ_t, −c·A_t)          (bounds the loss of a very large ratio on a bad token)

    As OpenRLHF's `PolicyLoss` (`eps_clip`, `dual_clip`) and verl's `compute_policy_loss`
    (`clip_ratio_c`). Aggregate the unmasked [B, T] result with
    `loss_sum(..., loss_type="dapo")` / `loss_items` (the token mean over the global batch).

    Args:
        logps: [B, T] log-probs of the completion tokens under the policy being trained.
        old_logps: [B, T] the same under the rollout's policy (without gradient).
        advantages: [B, T] whitened advantages (or [B], one per sequence).
    """
    advantages = token_advantages(logps, old_logps, advantages)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    log_ratio = logps - old_logps
    loss, low, high = _clipped_objective(
        torch.exp(log_ratio), advantages, epsilon_low, epsilon_high
    )
    dual = torch.zeros_like(loss)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        with torch.no_grad():
            dual = ((advantages < 0) & (loss > bound)).to(loss.dtype)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    with torch.no_grad():
        approx_kl = 0.5 * log_ratio.detach() ** 2
    return loss, PolicyStats(approx_kl, torch.maximum(low, high), dual)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, *, value_clip: float | None
) -> tuple[Tensor, Tensor]:
    """The critic's clipped regression loss per token (PPO2's value clipping, as TRL's PPO
    `cliprange_value`, OpenRLHF's `value_clip` and verl's `cliprange_value`):

        V_clip = clip(V, V_old − ε_v, V_old + ε_v)
        ℓ_t = ½·max((V − R)², (V_clip − R)²)          (ε_v None: ½·(V − R)²)

    Args:
        values: [B, T] the critic's values now (with gradient).
        old_values: [B, T] its values at the rollout (without gradient).
        returns: [B, T] the GAE returns (without gradient).
        value_clip: ε_v > 0, or None for no clipping.
    Returns:
        (per_token_loss [B, T] unmasked: aggregate as the policy loss; clipped [B, T] floats,
        1 where the clipped error is the larger: the value clip fraction, TRL's
        `val/clipfrac_avg`).
    """
    if not values.shape == old_values.shape == returns.shape or values.dim() != 2:
        raise ValueError(
            "values, old_values and returns must share one [B, T] shape, got "
            f"{tuple(values.shape)}, {tuple(old_values.shape)}, {tuple(returns.shape)}"
        )
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped).detach()
    if value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 or None, got {value_clip}")
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped = (clipped_values - returns) ** 2
    with torch.no_grad():
        is_clipped = (clipped > unclipped).to(values.dtype)
    return 0.5 * torch.maximum(unclipped, clipped), is_clipped


def token_entropy(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy of the next-token distribution at each position, H = logsumexp(z) − Σ p·z, in
    fp32 (at least): [..., V] logits → [...]. Computed `chunk_size` positions at a time, so the
    fp32 softmax never exists for the whole batch. For logging, call it under `torch.no_grad()`
    (with gradient every chunk's softmax is kept for the backward pass)."""
    if logits.dim() < 1 or chunk_size < 1:
        raise ValueError(f"expected [..., V] logits and chunk_size >= 1, got {tuple(logits.shape)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size].to(dtype)
        log_p = torch.log_softmax(chunk, dim=-1)
        parts.append(-(log_p.exp() * log_p).sum(-1))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=dtype)
    return out.view(logits.shape[:-1])
