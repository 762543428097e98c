"""Loss functions of the DPO family, KTO and reward models, from sequence log-probs and scores.

Every function here is pure: tensors in, tensors out. No config objects, no distributed calls;
the trainers turn config values into the keyword arguments below. (Log-probs come from
`align_anything.forward`; SFT's loss is the negative of their sum.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# The loss types `dpo_loss` understands; the trainer config validates against this tuple.
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE_LOSS_TYPES: tuple[str, ...] = ("simpo", "orpo")
# Types whose formula uses length-normalised log-probs, so token counts are required.
_NEEDS_TOKEN_COUNTS: tuple[str, ...] = ("ipo", "simpo", "orpo")
_SMOOTHED_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "robust", "simpo")


# --------------------------------------------------------------------------------------------
# DPO family
# --------------------------------------------------------------------------------------------


class DPOLossOutput(NamedTuple):
    """Per-pair results of `dpo_loss`; take `losses.mean()` for the batch loss.

    `chosen_rewards` / `rejected_rewards` are detached implicit rewards for logging:
    β·(policy − reference) for the reference-based types, β·(length-normalised policy
    log-prob) for simpo and orpo, computed on the same log-probs the loss used.
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Mächler 2012)."""
    # Near 0, 1 - exp(x) cancels: use expm1. Far below, exp(x) is tiny: use log1p.
    return torch.where(
        x > -math.log(2.0),
        torch.log(-torch.expm1(x)),
        torch.log1p(-torch.exp(x)),
    )


def _per_token(logps: Tensor, token_counts: Tensor) -> Tensor:
    return logps / token_counts.to(logps.dtype)


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None = None,
    ref_rejected_logps: Tensor | None = None,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_token_counts: Tensor | None = None,
    rejected_token_counts: Tensor | None = None,
    simpo_gamma: float = 0.5,
    orpo_lambda: float = 0.1,
) -> DPOLossOutput:
    """Preference losses from summed completion log-probs, one loss per (chosen, rejected) pair.

    All log-prob arguments are [B] sums over completion tokens, as `completion_logps` returns.
    With the log-ratio difference h = (π_c − ref_c) − (π_r − ref_r) and z = β·h:

    - sigmoid: −(1−ε)·logσ(z) − ε·logσ(−z). ε = label_smoothing ∈ [0, 0.5] is the
      conservative DPO flip probability; ε = 0 is plain DPO (Rafailov et al. 2023).
    - ipo: (h − 1/(2β))² (Azar et al. 2023). As in the IPO paper, h is built from
      log-probs averaged over tokens: each of the four log-probs is divided by its
      sequence's token count (the reference ones by the count of the same completion), so
      token counts are required; pass ones if the log-probs are already averaged.
    - hinge: relu(1 − z) (SLiC, Zhao et al. 2023).
    - robust: ((1−ε)·(−logσ(z)) − ε·(−logσ(−z))) / (1−2ε), ε ∈ [0, 0.5): an unbiased
      estimate of the clean loss under label flips with probability ε (Chowdhury et al. 2024).
    - simpo: −logσ(β·(avg_c − avg_r) − γ), avg = summed log-prob / token count,
      γ = simpo_gamma (Meng et al. 2024). label_smoothing applies as in sigmoid.
    - orpo: −avg_c − λ·logσ(log_odds_c − log_odds_r), log_odds = avg − log(1 − exp(avg)),
      λ = orpo_lambda (Hong et al. 2024). The NLL term is the chosen completion's per-token
      mean, per pair; the original ORPO averages over all chosen tokens of the batch
      instead, which differs only when completion lengths differ. β scales only the logged
      rewards.

    simpo and orpo are reference-free: the ref arguments may be None and are ignored.

    Raises:
        ValueError: unknown loss_type (the message lists DPO_LOSS_TYPES), an input the loss
            type needs but was not given, mismatched shapes, or an out-of-range parameter.
    """
    _check_dpo_arguments(
        loss_type, beta, label_smoothing, policy_chosen_logps, policy_rejected_logps,
        ref_chosen_logps, ref_rejected_logps, chosen_token_counts, rejected_token_counts,
    )  # fmt: skip
    if loss_type in REFERENCE_FREE_LOSS_TYPES:
        assert chosen_token_counts is not None and rejected_token_counts is not None
        return _reference_free_loss(
            loss_type, beta, label_smoothing, simpo_gamma, orpo_lambda,
            _per_token(policy_chosen_logps, chosen_token_counts),
            _per_token(policy_rejected_logps, rejected_token_counts),
        )  # fmt: skip
    assert ref_chosen_logps is not None and ref_rejected_logps is not None
    if loss_type == "ipo":
        assert chosen_token_counts is not None and rejected_token_counts is not None
        policy_chosen_logps = _per_token(policy_chosen_logps, chosen_token_counts)
        ref_chosen_logps = _per_token(ref_chosen_logps, chosen_token_counts)
        policy_rejected_logps = _per_token(policy_rejected_logps, rejected_token_counts)
        ref_rejected_logps = _per_token(ref_rejected_logps, rejected_token_counts)
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratios - rejected_logratios
    z = beta * h
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid_loss(z, label_smoothing)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - z)
    else:  # robust
        eps = label_smoothing
        losses = ((1 - eps) * -F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    return DPOLossOutput(
        losses, (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach()
    )


def _check_dpo_arguments(
    loss_type: str, beta: float, label_smoothing: float, policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor, ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None, chosen_token_counts: Tensor | None,
    rejected_token_counts: Tensor | None,
) -> None:  # fmt: skip
    """`dpo_loss`'s argument checks: each problem is a ValueError naming it."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"unknown DPO loss_type {loss_type!r}; expected one of {', '.join(DPO_LOSS_TYPES)}"
        )
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if label_smoothing and loss_type not in _SMOOTHED_LOSS_TYPES:
        raise ValueError(
            f"label_smoothing={label_smoothing} has no effect with loss_type={loss_type!r}; "
            f"it applies to {', '.join(_SMOOTHED_LOSS_TYPES)}"
        )
    # robust divides by 1 - 2ε, so it excludes ε = 0.5; cDPO at ε = 0.5 is merely uninformative.
    robust = loss_type == "robust"
    below_max = label_smoothing < 0.5 if robust else label_smoothing <= 0.5
    if label_smoothing < 0 or not below_max:
        allowed = "[0, 0.5)" if robust else "[0, 0.5]"
        raise ValueError(
            f"label_smoothing for loss_type={loss_type!r} must be in {allowed}, "
            f"got {label_smoothing}"
        )

    reference_free = loss_type in REFERENCE_FREE_LOSS_TYPES
    named: dict[str, Tensor | None] = {
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
    }
    if not reference_free:
        missing = [
            name
            for name, value in (
                ("ref_chosen_logps", ref_chosen_logps),
                ("ref_rejected_logps", ref_rejected_logps),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"loss_type={loss_type!r} needs reference log-probs; missing {', '.join(missing)} "
                f"(reference-free types: {', '.join(REFERENCE_FREE_LOSS_TYPES)})"
            )
        named["ref_chosen_logps"] = ref_chosen_logps
        named["ref_rejected_logps"] = ref_rejected_logps
    if loss_type in _NEEDS_TOKEN_COUNTS:
        if chosen_token_counts is None or rejected_token_counts is None:
            raise ValueError(
                f"loss_type={loss_type!r} uses length-normalised log-probs; pass "
                "chosen_token_counts and rejected_token_counts (the counts from completion_logps)"
            )
        named["chosen_token_counts"] = chosen_token_counts
        named["rejected_token_counts"] = rejected_token_counts
        if bool((chosen_token_counts <= 0).any() or (rejected_token_counts <= 0).any()):
            raise ValueError("token counts must be positive: a completion has no scored tokens")
    shapes = {name: tuple(t.shape) for name, t in named.items() if t is not None}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"dpo_loss inputs must share one shape, got {shapes}")


def _reference_free_loss(
    loss_type: str, beta: float, label_smoothing: float, simpo_gamma: float, orpo_lambda: float,
    avg_chosen: Tensor, avg_rejected: Tensor,
) -> DPOLossOutput:  # fmt: skip
    """simpo and orpo from per-token average log-probs (see `dpo_loss`)."""
    chosen_rewards = (beta * avg_chosen).detach()
    rejected_rewards = (beta * avg_rejected).detach()
    if loss_type == "simpo":
        z = beta * (avg_chosen - avg_rejected) - simpo_gamma
        losses = _smoothed_sigmoid_loss(z, label_smoothing)
    else:
        # log p can round to exactly 0 for a near-certain completion; log(1 - 1) would make
        # the log-odds infinite, so keep avg strictly below 0.
        eps = 1e-6
        log_odds_chosen = avg_chosen - _log1mexp(avg_chosen.clamp(max=-eps))
        log_odds_rejected = avg_rejected - _log1mexp(avg_rejected.clamp(max=-eps))
        losses = -avg_chosen - orpo_lambda * F.logsigmoid(log_odds_chosen - log_odds_rejected)
    return DPOLossOutput(losses, chosen_rewards, rejected_rewards)


def _smoothed_sigmoid_loss(z: Tensor, label_smoothing: float) -> Tensor:
    # The preference label is taken as wrong with probability label_smoothing (cDPO).
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


# --------------------------------------------------------------------------------------------
# Reward model
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# KTO
# --------------------------------------------------------------------------------------------


class KTOLossOutput(NamedTuple):
    """Per-row results of `kto_loss`: `losses` (already weighted by the row's desirable or
    undesirable weight) and the detached implicit rewards β·(π − ref) for logging."""

    losses: Tensor
    rewards: Tensor


def kto_kl_reference(logratio_sum: Tensor, count: Tensor | float) -> Tensor:
    """KTO's reference point z₀ = max(0, logratio_sum / count), detached: the estimate of
    KL(π ‖ π_ref) from `count` mismatched (prompt, completion) pairs whose policy − reference
    completion log-probs sum to `logratio_sum` (the sum over the whole global batch: every
    rank's, every micro-batch's). Clamped at 0 as in the KTO paper (a KL is never negative;
    the estimate can be) and TRL."""
    count = torch.as_tensor(count, dtype=logratio_sum.dtype, device=logratio_sum.device)
    if bool(count <= 0):
        raise ValueError("the KL estimate needs at least one mismatched pair (count > 0)")
    return (logratio_sum.detach() / count).clamp(min=0)


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl: Tensor,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KTOLossOutput:
    """The KTO loss of each row (Ethayarajh et al. 2024, eq. 7), from summed completion log-probs.

    With the implied reward r = log π(y|x) − log π_ref(y|x) and the reference point z₀ = `kl`
    (`kto_kl_reference`, no gradient flows through it):

    - desirable row:   λ_D · (1 − σ(β·(r − z₀)))
    - undesirable row: λ_U · (1 − σ(β·(z₀ − r)))

    (the undesirable value σ(β·(z₀ − r)) enters with the same sign as the desirable one: both
    losses are 1 − value). λ_D = `desirable_weight`, λ_U = `undesirable_weight`; the batch loss
    is the mean of these weighted losses over rows, as in TRL's `KTOTrainer`.

    Args:
        policy_logps, ref_logps: [B] completion log-probs (sums over completion tokens).
        desirable: [B] bool, True for a desirable (thumbs-up) completion.
        kl: 0-d tensor, the reference point z₀.

    Raises:
        ValueError: β ≤ 0, a negative weight, shapes that differ, a non-bool `desirable`, or a
            `kl` that is not a scalar.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"desirable_weight and undesirable_weight must be >= 0, got {desirable_weight} "
            f"and {undesirable_weight}"
        )
    shapes = {tuple(t.shape) for t in (policy_logps, ref_logps, desirable)}
    if len(shapes) != 1 or policy_logps.dim() != 1:
        raise ValueError(
            "policy_logps, ref_logps and desirable must share one [B] shape, got "
            f"{tuple(policy_logps.shape)}, {tuple(ref_logps.shape)}, {tuple(desirable.shape)}"
        )
    if desirable.dtype != torch.bool:
        raise ValueError(f"desirable must be a bool tensor, got dtype {desirable.dtype}")
    if kl.dim() != 0:
        raise ValueError(f"kl must be a scalar (0-d) tensor, got shape {tuple(kl.shape)}")
    logratios = policy_logps - ref_logps
    z = beta * (logratios - kl.detach())
    # 1 − σ(β(z₀ − r)) = 1 − σ(−z) = σ(z).
    losses = torch.where(
        desirable, desirable_weight * (1 - torch.sigmoid(z)), undesirable_weight * torch.sigmoid(z)
    )
    return KTOLossOutput(losses, (beta * logratios).detach())
