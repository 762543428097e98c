"""Losses of text-to-image diffusion training, pure functions of tensors: the denoising loss
(per-sample MSE against the target, optional min-SNR-γ weights), Diffusion-DPO (sigmoid, hinge,
IPO) and Diffusion-KTO.

Everything works on per-sample MSEs: `per_sample_mse(prediction, target)`, the mean over every
dimension but the batch of (prediction − target)², in fp32. The target is the scheduler's
(`forward_diffusion.noisy_latents_and_target`): ε, v = α_t·ε − σ_t·x₀, or the flow velocity
ε − x₀. In Diffusion-DPO the MSE stands in for a negative log-likelihood: a lower MSE on an
image is a higher implicit likelihood of it (Wallace et al. 2023, eq. 14).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from align_anything.losses.kto import KTOLossOutput, kto_loss

DIFFUSION_DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
MIN_SNR_PREDICTIONS = ("epsilon", "v_prediction")


def _at_least_fp32(tensor: Tensor) -> Tensor:
    # bf16/fp16 differences of near-equal predictions lose most of their digits; fp64 (tests,
    # gradcheck) stays fp64.
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def per_sample_mse(prediction: Tensor, target: Tensor) -> Tensor:
    """[B]: the mean of (prediction − target)² over every dimension but the first, in fp32 at
    least (as diffusers' training scripts compute it, `F.mse_loss(..., reduction="none")` of
    fp32 copies, averaged per sample)."""
    if prediction.shape != target.shape:
        raise ValueError(
            f"prediction {tuple(prediction.shape)} and target {tuple(target.shape)} differ"
        )
    squared = (_at_least_fp32(prediction) - _at_least_fp32(target)).pow(2)
    return squared.reshape(squared.shape[0], -1).mean(dim=1)


def min_snr_weights(snr: Tensor, *, gamma: float, prediction: str) -> Tensor:
    """Min-SNR-γ loss weights (Hang et al. 2023) of samples whose noise level has signal-to-
    noise ratio `snr` = α_t² / σ_t², as weights on the MSE against the model's own target:

    - epsilon prediction: min(SNR, γ) / SNR (the paper's eq. for ε; an x₀-MSE weighted by
      min(SNR, γ) rewritten on the ε-MSE, which is SNR times larger);
    - v-prediction: min(SNR, γ) / (SNR + 1) (the paper's v variant: the v-MSE is (SNR + 1)
      times the x₀-MSE). diffusers' scripts use the same two.

    A sample at SNR 0 (the last step of a zero-terminal-SNR schedule) gets weight 1 with
    epsilon prediction, where min(SNR, γ) / SNR is 0/0 (diffusers' SDXL script does the same).
    Flow matching has no min-SNR weighting here: its timestep density (`logit_normal`, ...)
    plays that part.
    """
    if gamma <= 0:
        raise ValueError(f"min-SNR gamma must be > 0, got {gamma}")
    if prediction not in MIN_SNR_PREDICTIONS:
        raise ValueError(
            f"min-SNR weighting applies to {' and '.join(MIN_SNR_PREDICTIONS)} prediction, not "
            f"{prediction!r}"
        )
    snr = snr.float()
    clipped = torch.clamp(snr, max=gamma)
    if prediction == "v_prediction":
        return clipped / (snr + 1)
    return torch.where(snr > 0, clipped / snr.clamp(min=torch.finfo(snr.dtype).tiny), 1.0)


def denoising_loss(mse: Tensor, *, weights: Tensor | None = None) -> Tensor:
    """[B]: the per-sample denoising loss, `mse` (from `per_sample_mse`) times `weights` (e.g.
    `min_snr_weights`, detached; None: 1). The batch loss is its mean."""
    if weights is None:
        return mse
    if weights.shape != mse.shape:
        raise ValueError(f"weights {tuple(weights.shape)} and mse {tuple(mse.shape)} differ")
    return mse * weights.detach().to(mse.dtype)


class DiffusionDPOOutput(NamedTuple):
    """Per-pair results of `diffusion_dpo_loss`; take `losses.mean()` for the batch loss.

    `logits` = (ref_w − ref_l) − (θ_w − θ_l) (detached); `metrics` maps names to detached
    per-pair values for logging (average them over pairs): `rewards/chosen` β·(ref_w − θ_w),
    `rewards/rejected` β·(ref_l − θ_l), `rewards/margins` (their difference, β·logits),
    `rewards/accuracies` (1 where the chosen image's implicit reward is higher, 0.5 on a tie,
    as diffusers' script counts it, so a run that has not moved reads 0.5), and the four MSEs
    `mse/policy_chosen`, `mse/policy_rejected`, `mse/ref_chosen`, `mse/ref_rejected`."""

    losses: Tensor
    logits: Tensor
    metrics: dict[str, Tensor]


def diffusion_dpo_loss(
    policy_mse_chosen: Tensor, policy_mse_rejected: Tensor, ref_mse_chosen: Tensor,
    ref_mse_rejected: Tensor, *, beta: float, loss_type: str = "sigmoid",
    sft_weight: float = 0.0,
) -> DiffusionDPOOutput:  # fmt: skip
    """Diffusion-DPO (Wallace et al. 2023) on per-sample MSEs of a pair's chosen (w) and
    rejected (l) image, both noised with the same noise at the same timestep, under the policy
    (θ) and the frozen reference:

        logits = (ref_w − ref_l) − (θ_w − θ_l)

    positive when the policy lowered the chosen image's error more than the rejected one's
    (the analogue of DPO's log-ratio difference, MSE standing in for −log-likelihood). Types:

    - "sigmoid": −log σ(β·logits) (the paper's eq. 14 with the weighting folded into β);
    - "hinge": relu(1 − β·logits) (SLiC);
    - "ipo": (logits − 1/(2β))² (Azar et al. 2023: the empirical IPO loss, the squared
      distance of the log-ratio difference from 1/(2τ), τ = β; β does not multiply the
      logits). diffusers' research script writes this formula with `args.beta`, an argument
      it does not define, so its ipo branch raises AttributeError at the first step.

    β: diffusers' research script (`train_diffusion_dpo.py`) uses the same β·logits; the
    paper's own code (SalesforceAIResearch/DiffusionDPO) scales by −½·β_dpo, so its β_dpo is
    2β here (its SDXL 5000 is β = 2500 here, its SD 1.5 2000 is β = 1000).

    `sft_weight` w adds w·θ_w, the chosen image's own denoising loss (as RPO adds the chosen
    completion's NLL to text DPO): it keeps the policy's error on what it is pushed towards
    from rising while the margin grows. At the start the sigmoid loss pulls θ_w down with
    weight β/2, so w = β/2 matches it.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if sft_weight < 0:
        raise ValueError(f"sft_weight must be >= 0, got {sft_weight}")
    if loss_type not in DIFFUSION_DPO_LOSS_TYPES:
        raise ValueError(
            f"unknown Diffusion-DPO loss_type {loss_type!r}; one of "
            f"{', '.join(DIFFUSION_DPO_LOSS_TYPES)}"
        )
    tensors = (policy_mse_chosen, policy_mse_rejected, ref_mse_chosen, ref_mse_rejected)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or policy_mse_chosen.dim() != 1:
        raise ValueError(f"the four MSEs must share one [B] shape, got {sorted(shapes)}")
    ref_w, ref_l = (_at_least_fp32(t.detach()) for t in (ref_mse_chosen, ref_mse_rejected))
    theta_w, theta_l = (_at_least_fp32(t) for t in (policy_mse_chosen, policy_mse_rejected))
    logits = (ref_w - ref_l) - (theta_w - theta_l)
    if loss_type == "sigmoid":
        losses = -torch.nn.functional.logsigmoid(beta * logits)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    if sft_weight:
        losses = losses + sft_weight * theta_w
    detached = logits.detach()
    chosen = beta * (ref_w - theta_w.detach())
    rejected = beta * (ref_l - theta_l.detach())
    accuracy = (detached > 0).float() + 0.5 * (detached == 0).float()
    metrics = {
        "rewards/chosen": chosen, "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected, "rewards/accuracies": accuracy,
        "mse/policy_chosen": theta_w.detach(), "mse/policy_rejected": theta_l.detach(),
        "mse/ref_chosen": ref_w, "mse/ref_rejected": ref_l,
    }  # fmt: skip
    return DiffusionDPOOutput(losses=losses, logits=detached, metrics=metrics)


def diffusion_kto_loss(
    policy_mse: Tensor, ref_mse: Tensor, desirable: Tensor, kl: Tensor, *, beta: float,
    desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
) -> KTOLossOutput:  # fmt: skip
    """Diffusion-KTO (Li et al. 2024): KTO's loss (`losses.kto_loss`) with the diffusion
    implicit log-ratio r = ref_mse − θ_mse in place of log π − log π_ref (per-sample MSEs of
    single images, each with its own noise and timestep): a desirable image's loss is
    λ_D·(1 − σ(β(r − z₀))), an undesirable one's λ_U·(1 − σ(β(z₀ − r))). The reference point
    z₀ = `kl` is the caller's (e.g. `losses.kto_kl_reference` of r over mismatched images, or
    0); it carries no gradient."""
    return kto_loss(
        -_at_least_fp32(policy_mse), -_at_least_fp32(ref_mse.detach()), desirable, kl, beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
    )  # fmt: skip
