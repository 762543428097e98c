"""Online-RL losses: GRPO (with the DAPO and Dr. GRPO variants) and RLOO. Pure torch functions.

Each function matches the TRL 1.16 option named in its docstring (`GRPOTrainer` / `RLOOTrainer`
and their configs), so a TRL recipe carries over by name.

Layout of a generation batch: P prompts × G completions (`group_size`, TRL's
`num_generations`) in ONE flat tensor of N = P·G rows, grouped contiguously: prompt p's
completions are rows p·G … p·G+G−1. Advantages need the whole group (and, for
`scale_rewards="batch"` and RLOO's `normalize_advantages`, the whole generation batch), so the
trainer passes every rank's rewards (gathered) and then keeps its own slice, as TRL does.

Splitting the loss over ranks and micro-batches: the global loss of a generation batch is

    Σ over every micro-batch of every rank of `loss_sum(...)`  /  Σ of `loss_items(...)`

which equals TRL's loss for that batch for every `loss_type` here (each function says why).
A reward of NaN marks an unscorable row (every reward function said None): it is left out of
the means and standard deviations, and its advantage is 0, as in TRL.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

# TRL's `GRPOConfig.loss_type` values implemented here. TRL's `bnpo` (a token mean per
# micro-batch, then a mean over micro-batches) is left out: it depends on how the batch is cut
# into micro-batches, which this package's global-batch arithmetic does not reproduce; `dapo` is
# its split-independent form (one token mean over the whole generation batch).
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo")
# TRL's `GRPOConfig.scale_rewards` values.
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
# TRL adds this to the standard deviation before dividing (grpo_trainer.py, rloo_trainer.py).
STD_EPS = 1e-4


def _check_groups(rewards: Tensor, group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one flat [N] tensor, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} "
            "(N must be prompts × num_generations)"
        )


def nanstd(values: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The Bessel-corrected (unbiased, N−1) standard deviation ignoring NaNs, as TRL's
    `trl.trainer.utils.nanstd`. NaN when fewer than two values are not NaN."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    std = (variance * count / (count - 1)).sqrt()
    if not keepdim:
        std = std.squeeze() if dim is None else std.squeeze(dim)
    return std


def group_reward_std(rewards: Tensor, group_size: int) -> Tensor:
    """[P] each group's reward standard deviation (unbiased, NaN rows left out; 0 for G = 1).
    `(group_reward_std(...) == 0).float().mean()` is TRL's `frac_reward_zero_std` (TRL takes
    it per row with `isclose`; every row of a group shares its group's value)."""
    _check_groups(rewards, group_size)
    grouped = rewards.view(-1, group_size)
    if group_size == 1:
        return torch.zeros(grouped.size(0), dtype=rewards.dtype, device=rewards.device)
    return nanstd(grouped, dim=1)


def group_advantages(
    rewards: Tensor, group_size: int, scale_rewards: Literal["group", "batch", "none"]
) -> Tensor:
    """GRPO's group-relative advantages (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, §4.1.2).

    A_i = (r_i − mean of i's group) / (s + 1e-4), with s by TRL 1.16's `scale_rewards`:

    - `"group"`: the group's standard deviation (the GRPO paper);
    - `"batch"`: the whole generation batch's standard deviation (Hu et al. 2025,
      REINFORCE++ / "Understanding R1-Zero" robust scaling);
    - `"none"`: no division, s + 1e-4 is not applied at all (Liu et al. 2025, Dr. GRPO,
      arXiv:2503.20783: the division biases towards easy and hard prompts).

    Standard deviations are unbiased (N−1) and ignore NaN, as TRL's `nanstd`; the 1e-4 is TRL's.
    A group whose rewards are all equal gets advantage 0 (0 / 1e-4), never NaN. A NaN reward
    (an unscorable row) is left out of its group's mean and std and gets advantage 0, as TRL's
    `nan_to_num`. With G = 1 the group std is taken as 0 (TRL's eval case).

    Args:
        rewards: [N] total rewards of the whole generation batch (all ranks), rows grouped
            contiguously by prompt.
        group_size: G, TRL's `num_generations`.
    Returns:
        [N] advantages, same dtype.
    """
    _check_groups(rewards, group_size)
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        std = group_reward_std(rewards, group_size).repeat_interleave(group_size)
        advantages = advantages / (std + STD_EPS)
    elif scale_rewards == "batch":
        std = nanstd(rewards) if rewards.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (std + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def rloo_advantages(
    rewards: Tensor, group_size: int, *, normalize_advantages: bool = False
) -> Tensor:
    """RLOO's leave-one-out advantages (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline
    for free!"; Ahmadian et al. 2024, arXiv:2402.14740), as TRL 1.16's `RLOOTrainer`.

    A_i = r_i − (Σ_{j in i's group, j ≠ i} r_j) / (G' − 1), G' the group's non-NaN rewards.
    With TRL's `normalize_advantages=True` (default False) the advantages are then standardised
    over the whole generation batch: (A − mean A) / (std A + 1e-4), std unbiased. NaN rewards
    are left out of the baselines and the normalisation and get advantage 0; so does a row that
    is its group's only scorable one (0/0), and every row when G = 1.

    Args:
        rewards: [N] rewards of the whole generation batch (all ranks), grouped contiguously;
            with a KL penalty, already `rloo_reward_with_kl`'s.
    """
    _check_groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    grouped = rewards.view(-1, group_size)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scorable - 1)
    advantages = (grouped - baselines).view(-1)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def rloo_sequence_kl(old_logps: Tensor, ref_logps: Tensor, mask: Tensor) -> Tensor:
    """[B] RLOO's per-sequence KL estimate: Σ_t (log π_old − log π_ref) over completion tokens,
    the first-order (k1) estimator TRL 1.16's `RLOOTrainer` uses (it can be negative, unlike
    GRPO's k3), from the log-probs of the policy that generated (`old_logps`), not the policy
    being trained. [B, T] inputs; `mask` is 1 on completion tokens that count."""
    return ((old_logps - ref_logps) * mask).sum(-1)


def rloo_reward_with_kl(rewards: Tensor, kl_per_sequence: Tensor, beta: float) -> Tensor:
    """RLOO's KL penalty in the reward, r − β·KL (TRL 1.16 `RLOOConfig.beta`, default 0.05; 0
    loads no reference). `kl_per_sequence` from `rloo_sequence_kl`, of the whole generation batch;
    apply before `rloo_advantages`. TRL clips rewards (`reward_clip_range`) before this."""
    if rewards.shape != kl_per_sequence.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and kl_per_sequence {tuple(kl_per_sequence.shape)} "
            "must share one shape"
        )
    return rewards - beta * kl_per_sequence


class ClipStats(NamedTuple):
    """Per-token (GRPO, [B, T]) or per-sequence (RLOO, [B]) floats, 1.0 where the clip bites
    — TRL's `clip_ratio/low_mean`, `high_mean`, `region_mean` are their masked means over the
    batch — and `kl` (k3, [B, T]; None when β = 0), logged by TRL as `kl`."""

    kl: Tensor | None
    is_low_clipped: Tensor
    is_high_clipped: Tensor
    is_region_clipped: Tensor


def _clipped_objective(
    ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """−min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A) and the low / high clip indicators (TRL's)."""
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(
            f"epsilon_low and epsilon_high must be >= 0, got {epsilon_low} and {epsilon_high}"
        )
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(ratio.dtype)
        high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(ratio.dtype)
    return loss, low, high


def token_advantages(logps: Tensor, old_logps: Tensor, advantages: Tensor) -> Tensor:
    """`advantages` shaped to multiply [B, T] per-token terms ([B] → [B, 1]; [B, T] as is),
    after checking that `logps` and `old_logps` share one [B, T] shape with B rows of them."""
    if logps.shape != old_logps.shape or logps.dim() != 2:
        raise ValueError(
            f"logps and old_logps must share one [B, T] shape, got {tuple(logps.shape)} and "
            f"{tuple(old_logps.shape)}"
        )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.size(0) != logps.size(0):
        raise ValueError(f"{advantages.size(0)} advantages for {logps.size(0)} sequences")
    return advantages


def grpo_per_token_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, ClipStats]:
    """GRPO's per-token loss (Shao et al. 2024, arXiv:2402.03300, eq. 3) with DAPO's decoupled
    clip range (Yu et al. 2025, arXiv:2503.14476), as TRL 1.16 `GRPOTrainer` with
    `importance_sampling_level="token"`:

        ρ_t = exp(log π − log π_old)
        ℓ_t = −min(ρ_t·A, clip(ρ_t, 1 − ε_low, 1 + ε_high)·A) + β·KL_t
        KL_t = exp(ref − log π) − (ref − log π) − 1          (k3, Schulman 2020; ≥ 0)

    `epsilon_low` is TRL's `epsilon` (default 0.2), `epsilon_high` TRL's `epsilon_high`
    (default: = epsilon; DAPO recommends 0.28). `beta` is TRL's `beta` (default 0.0: no
    reference). With μ = `num_iterations` = 1, `old_logps` is `logps.detach()` (ρ = 1, the
    gradient is −A·∇log π); for μ > 1 it is the log-probs at generation time.

    Args:
        logps, old_logps: [B, T] per-token log-probs of the completion tokens.
        advantages: [B] one per sequence (or [B, T]).
        ref_logps: [B, T] the reference's log-probs; required when beta > 0.
    Returns:
        (per_token_loss [B, T], unmasked: aggregate with `loss_sum` / `loss_items`;
         ClipStats of [B, T] floats — take their masked means for TRL's metrics).
    """
    advantages = token_advantages(logps, old_logps, advantages)
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    loss, low, high = _clipped_objective(
        torch.exp(logps - old_logps), advantages, epsilon_low, epsilon_high
    )
    kl = None
    if beta > 0:
        if ref_logps is None or ref_logps.shape != logps.shape:
            raise ValueError("beta > 0 needs ref_logps of the logps' [B, T] shape")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    return loss, ClipStats(kl, low, high, torch.maximum(low, high))


def loss_sum(
    per_token: Tensor, mask: Tensor, *, loss_type: str, max_completion_length: int
) -> Tensor:
    """One micro-batch's contribution to the global GRPO loss; divide the sum over every
    micro-batch of every rank by the sum of their `loss_items`. `mask` [B, T] is 1 on the
    completion tokens that count (0 on padding, on tokens after EOS and on masked truncated
    completions). TRL 1.16 `GRPOConfig.loss_type`:

    - `"grpo"` (Shao et al. 2024): Σ_b (Σ_t ℓ·m / max(Σ_t m, 1)); items: sequences. TRL takes
      this per-sequence token mean, averages it over the micro-batch and divides by the
      gradient-accumulation steps, and DDP averages over ranks; with TRL's equal micro-batches
      that is the mean over the generation batch's sequences, which this gives for any split.
    - `"dr_grpo"` (Liu et al. 2025, arXiv:2503.20783): Σ ℓ·m / L, L = `max_completion_length`;
      items: sequences. TRL: Σ ℓ·m / (B·L) per micro-batch, averaged as for grpo, = Σ ℓ·m /
      (N·L) over the batch.
    - `"dapo"` (Yu et al. 2025, TRL's default): Σ ℓ·m; items: tokens. TRL divides each
      micro-batch's Σ ℓ·m by the generation batch's token count over all processes
      (`num_items_in_batch`, gathered) / num_processes × grad_accum / steps_per_generation, and
      DDP averages over the processes: with steps_per_generation = grad_accum (TRL's default)
      that is Σ ℓ·m over the generation batch / its tokens.

    A completion fully masked (mask_truncated_completions) still counts as a sequence for grpo
    and dr_grpo (contributing 0), as in TRL.
    """
    if per_token.shape != mask.shape:
        raise ValueError(
            f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ in shape"
        )
    masked = per_token * mask.to(per_token.dtype)
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1).to(per_token.dtype)).sum()
    if loss_type == "dr_grpo":
        if max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
        return masked.sum() / max_completion_length
    if loss_type == "dapo":
        return masked.sum()
    raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")


def loss_items(mask: Tensor, *, loss_type: str) -> int:
    """What a micro-batch adds to the global loss's denominator (see `loss_sum`): its sequences
    for `grpo` and `dr_grpo`, its counted completion tokens for `dapo`. The trainer sums these
    over every micro-batch of every rank (an all-reduce) and divides by max(total, 1), as TRL
    clamps `num_items_in_batch`."""
    if loss_type in ("grpo", "dr_grpo"):
        return int(mask.size(0))
    if loss_type == "dapo":
        return int(mask.sum().item())
    raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")


def rloo_per_sequence_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[Tensor, ClipStats]:
    """RLOO's REINFORCE loss per sequence, as TRL 1.16 `RLOOTrainer` (Ahmadian et al. 2024,
    arXiv:2402.14740), with a PPO-style clipped ratio on whole sequences:

        ρ = exp(Σ_t log π − Σ_t log π_old)       (sequence log-probs, completion tokens only)
        ℓ = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)

    With μ = 1 (ρ = 1) this is the plain REINFORCE loss −A·log π(y|x) in its gradient. TRL's
    `epsilon` (0.2) / `epsilon_high` (= epsilon). The KL to the reference is in the reward
    (`rloo_reward_with_kl`), not here. TRL's loss is the mean over sequences: the global loss
    is Σ of this over every micro-batch of every rank / the number of sequences.

    Args:
        logps, old_logps: [B] completion log-probs (Σ over completion tokens, masked).
        advantages: [B] from `rloo_advantages`.
    Returns:
        (per_sequence_loss [B], ClipStats of [B] floats with kl None).
    """
    if not (logps.shape == old_logps.shape == advantages.shape) or logps.dim() != 1:
        raise ValueError(
            "logps, old_logps and advantages must share one [B] shape, got "
            f"{tuple(logps.shape)}, {tuple(old_logps.shape)}, {tuple(advantages.shape)}"
        )
    loss, low, high = _clipped_objective(
        torch.exp(logps - old_logps), advantages, epsilon_low, epsilon_high
    )
    return loss, ClipStats(None, low, high, torch.maximum(low, high))


def truncated_importance_weights(
    trainer_logps: Tensor, engine_logps: Tensor, mask: Tensor, *, cap: float,
    level: Literal["token", "sequence"],
) -> Tensor:  # fmt: skip
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"), the correction of the mismatch between the
    inference engine that sampled the completions and the trainer that recomputes their
    log-probs, as TRL 1.16's `vllm_importance_sampling_correction` (modes `token_truncate` /
    `sequence_truncate`, `vllm_importance_sampling_clip_max` = `cap`, no lower bound) and verl's
    `rollout_is` with truncation:

        token:     w_t = min(exp(log π_trainer(y_t) − log π_engine(y_t)), C)         [B, T]
        sequence:  w   = min(exp(Σ_t m_t·(log π_trainer − log π_engine)), C)        [B]

    `trainer_logps` are the trainer's log-probs when the round was generated (the old policy of
    the ratio), `engine_logps` the engine's of the same tokens; both [B, T], `mask` 1 on the
    completion tokens that count. Multiply the per-token (GRPO) or per-sequence (RLOO) loss by
    the weights; masked tokens get weight 1 (they contribute nothing either way). Detached.
    """
    if trainer_logps.shape != engine_logps.shape or trainer_logps.shape != mask.shape:
        raise ValueError(
            f"trainer_logps {tuple(trainer_logps.shape)}, engine_logps "
            f"{tuple(engine_logps.shape)} and mask {tuple(mask.shape)} must share one [B, T] shape"
        )
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1 (a weight of 1 is no correction), got {cap}")
    delta = (trainer_logps - engine_logps).detach() * mask
    if level == "token":
        return torch.exp(delta).clamp(max=cap)
    if level == "sequence":
        return torch.exp(delta.sum(-1)).clamp(max=cap)
    raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")


def logp_mismatch(
    trainer_logps: Tensor, engine_logps: Tensor, mask: Tensor
) -> tuple[float, float, float]:
    """(Σ |log π_trainer − log π_engine| over the masked tokens, their count, the largest
    |difference|; 0 without tokens): sums to reduce over micro-batches and ranks, TRL's
    `sampling/sampling_logp_difference/mean|max`."""
    delta = (trainer_logps - engine_logps).abs()[mask.bool()]
    if delta.numel() == 0:
        return 0.0, 0.0, 0.0
    return float(delta.sum()), float(delta.numel()), float(delta.max())
