"""The KTO loss (unpaired thumbs-up / thumbs-down rows) and its KL reference point. Pure."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


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
