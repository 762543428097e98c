"""The DPO family of preference losses and the SFT term, from sequence log-probs.

`dpo_loss` combines one or more named loss types (`DPO_LOSS_TYPES`) with weights; each type
added after the first six is also a function of its own (`apo_zero_loss`, `bco_pair_loss`, ...)
with the paper it comes from in its docstring. Pure functions: tensors in, tensors out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from align_anything.losses.rules import (
    DPO_LOSS_TYPES,
    NEEDS_TOKEN_COUNTS,
    PER_TOKEN_LOGRATIOS,
    REFERENCE_FREE_LOSS_TYPES,
    REFERENCE_FREE_PREFERENCE,
    combination_problems,
    needs_reference,
    smoothing_problems,
    weight_problems,
)

# --------------------------------------------------------------------------------------------
# DPO family
# --------------------------------------------------------------------------------------------


class DPOLossOutput(NamedTuple):
    """Per-pair results of `dpo_loss`; take `losses.mean()` for the batch loss.

    `losses` is the weighted sum of the types' losses, pair by pair. `chosen_rewards` /
    `rejected_rewards` are detached implicit rewards for logging, those of the first listed
    type other than sft, computed on the same log-probs its loss used: β·(policy − reference)
    for the reference-based types (per-token averages for ipo and sigmoid_norm, whose
    log-ratios are length-normalised), β·(length-normalised policy log-prob) for simpo and
    orpo. `terms` maps each listed type to its unweighted per-pair loss; for aot and
    aot_unpaired entry i belongs to the i-th smallest log-ratio of the batch, not to pair i.
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    terms: dict[str, Tensor]


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
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    chosen_token_counts: Tensor | None = None,
    rejected_token_counts: Tensor | None = None,
    simpo_gamma: float = 0.5,
    orpo_lambda: float = 0.1,
    discopop_tau: float = 0.05,
) -> DPOLossOutput:
    """Preference losses from summed completion log-probs, one loss per (chosen, rejected) pair.

    All log-prob arguments are [B] sums over completion tokens, as `completion_logps` returns.
    `loss_type` is one name or a list; the per-pair loss is Σ wₖ·lossₖ over the listed types with
    `loss_weights` (None: all 1.0), as in MPO (Wang et al. 2024, arXiv:2411.10442:
    `[sigmoid, bco_pair, sft]` with weights `[0.8, 0.2, 1.0]`). With the log-ratios
    r = log π − log π_ref of each completion, h = r_c − r_r and z = β·h:

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
    - apo_zero, apo_down, bco_pair, exo_pair (ε = label_smoothing), nca_pair, sppo_hard,
      aot, aot_unpaired (both sort the batch; ε as in sigmoid), discopop (τ = discopop_tau),
      sigmoid_norm, sft: see the function of the same name + `_loss`.

    simpo, orpo and sft are reference-free: when every listed type is, the ref arguments may
    be None and are ignored. simpo and orpo cannot be listed with a type that needs a
    reference (their rewards and the reference's absence would both be ill-defined); sft
    goes with any type, and alone is no preference loss.

    Raises:
        ValueError: unknown or repeated loss types (the message lists DPO_LOSS_TYPES), a
            combination that is not allowed, weights that do not fit, an input the loss types
            need but was not given, mismatched shapes, or an out-of-range parameter.
    """
    names = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    weights = [1.0] * len(names) if loss_weights is None else [float(w) for w in loss_weights]
    _check_dpo_arguments(
        names, weights, beta, label_smoothing, discopop_tau, policy_chosen_logps,
        policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_token_counts,
        rejected_token_counts,
    )  # fmt: skip
    pairs = _Pairs(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
        chosen_token_counts, rejected_token_counts, beta, label_smoothing, simpo_gamma,
        orpo_lambda, discopop_tau,
    )  # fmt: skip
    terms = {name: _TERMS[name](pairs) for name in names}
    losses: Tensor | None = None
    for name, weight in zip(names, weights, strict=True):
        weighted = weight * terms[name]
        losses = weighted if losses is None else losses + weighted
    assert losses is not None
    chosen_rewards, rejected_rewards = _rewards(next(n for n in names if n != "sft"), pairs)
    return DPOLossOutput(losses, chosen_rewards, rejected_rewards, terms)


class _Pairs(NamedTuple):
    """`dpo_loss`'s inputs, as each type's formula reads them."""

    policy_chosen: Tensor
    policy_rejected: Tensor
    ref_chosen: Tensor | None
    ref_rejected: Tensor | None
    chosen_counts: Tensor | None
    rejected_counts: Tensor | None
    beta: float
    label_smoothing: float
    simpo_gamma: float
    orpo_lambda: float
    discopop_tau: float

    def logratios(self, *, per_token: bool = False) -> tuple[Tensor, Tensor]:
        """(r_c, r_r): log π − log π_ref of each completion, summed or averaged over tokens."""
        assert self.ref_chosen is not None and self.ref_rejected is not None
        policy_chosen, policy_rejected = self.policy_chosen, self.policy_rejected
        ref_chosen, ref_rejected = self.ref_chosen, self.ref_rejected
        if per_token:
            policy_chosen, policy_rejected = self.per_token_policy()
            assert self.chosen_counts is not None and self.rejected_counts is not None
            ref_chosen = _per_token(ref_chosen, self.chosen_counts)
            ref_rejected = _per_token(ref_rejected, self.rejected_counts)
        return policy_chosen - ref_chosen, policy_rejected - ref_rejected

    def per_token_policy(self) -> tuple[Tensor, Tensor]:
        """The policy's log-probs averaged over each completion's tokens."""
        assert self.chosen_counts is not None and self.rejected_counts is not None
        return (
            _per_token(self.policy_chosen, self.chosen_counts),
            _per_token(self.policy_rejected, self.rejected_counts),
        )

    def margins(self) -> tuple[Tensor, Tensor]:
        """log π(y_c) − log π(y_r) of the policy and of the reference, per pair."""
        assert self.ref_chosen is not None and self.ref_rejected is not None
        return self.policy_chosen - self.policy_rejected, self.ref_chosen - self.ref_rejected

    def h(self, *, per_token: bool = False) -> Tensor:
        """r_c − r_r, the log-ratio difference of each pair."""
        chosen, rejected = self.logratios(per_token=per_token)
        return chosen - rejected


def _robust_loss(z: Tensor, eps: float) -> Tensor:
    return ((1 - eps) * -F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


# Each type's per-pair loss from the prepared inputs: the dispatch of `dpo_loss`.
_TERMS: dict[str, Callable[[_Pairs], Tensor]] = {
    "sigmoid": lambda p: _smoothed_sigmoid_loss(p.beta * p.h(), p.label_smoothing),
    "ipo": lambda p: (p.h(per_token=True) - 1.0 / (2.0 * p.beta)) ** 2,
    "hinge": lambda p: torch.relu(1.0 - p.beta * p.h()),
    "robust": lambda p: _robust_loss(p.beta * p.h(), p.label_smoothing),
    "simpo": lambda p: _simpo_loss(*p.per_token_policy(), p.beta, p.simpo_gamma, p.label_smoothing),
    "orpo": lambda p: _orpo_loss(*p.per_token_policy(), p.orpo_lambda),
    "apo_zero": lambda p: apo_zero_loss(*p.logratios(), beta=p.beta),
    "apo_down": lambda p: apo_down_loss(*p.logratios(), beta=p.beta),
    "bco_pair": lambda p: bco_pair_loss(*p.logratios(), beta=p.beta),
    "exo_pair": lambda p: exo_pair_loss(*p.logratios(), beta=p.beta, epsilon=p.label_smoothing),
    "nca_pair": lambda p: nca_pair_loss(*p.logratios(), beta=p.beta),
    "sppo_hard": lambda p: sppo_hard_loss(*p.logratios(), beta=p.beta),
    "aot": lambda p: aot_loss(*p.margins(), beta=p.beta, label_smoothing=p.label_smoothing),
    "aot_unpaired": lambda p: aot_unpaired_loss(
        *p.logratios(), beta=p.beta, label_smoothing=p.label_smoothing
    ),
    "discopop": lambda p: discopop_loss(*p.logratios(), beta=p.beta, tau=p.discopop_tau),
    "sigmoid_norm": lambda p: sigmoid_norm_loss(*p.logratios(per_token=True), beta=p.beta),
    "sft": lambda p: sft_loss(p.policy_chosen, p.chosen_counts),  # type: ignore[arg-type]
}


def _rewards(name: str, p: _Pairs) -> tuple[Tensor, Tensor]:
    """The implicit rewards `name` defines (see `DPOLossOutput`), detached."""
    if name in REFERENCE_FREE_PREFERENCE:
        chosen, rejected = p.per_token_policy()
    else:
        chosen, rejected = p.logratios(per_token=name in PER_TOKEN_LOGRATIOS)
    return (p.beta * chosen).detach(), (p.beta * rejected).detach()


def _check_dpo_arguments(
    names: tuple[str, ...], weights: list[float], beta: float, label_smoothing: float,
    discopop_tau: float, policy_chosen_logps: Tensor, policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None, ref_rejected_logps: Tensor | None,
    chosen_token_counts: Tensor | None, rejected_token_counts: Tensor | None,
) -> None:  # fmt: skip
    """`dpo_loss`'s argument checks: each problem is a ValueError naming it."""
    shown = repr(names[0]) if len(names) == 1 else repr(list(names))
    unknown = [name for name in names if name not in DPO_LOSS_TYPES]
    if unknown:
        raise ValueError(
            f"unknown DPO loss_type {', '.join(map(repr, unknown))}; expected one of "
            f"{', '.join(DPO_LOSS_TYPES)}, or a list of them"
        )
    problems = [
        *combination_problems(names),
        *weight_problems(names, weights),
        *(f"label_smoothing {p}" for p in smoothing_problems(names, label_smoothing)),
    ]
    if problems:
        raise ValueError(f"loss_type={shown}: " + "; ".join(problems))
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if "discopop" in names and not discopop_tau > 0:
        raise ValueError(f"discopop_tau must be > 0, got {discopop_tau}")

    named: dict[str, Tensor | None] = {
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
    }
    if needs_reference(names):
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
                f"loss_type={shown} needs reference log-probs; missing {', '.join(missing)} "
                f"(reference-free types: {', '.join(REFERENCE_FREE_LOSS_TYPES)})"
            )
        named["ref_chosen_logps"] = ref_chosen_logps
        named["ref_rejected_logps"] = ref_rejected_logps
    if any(name in NEEDS_TOKEN_COUNTS for name in names):
        if chosen_token_counts is None or rejected_token_counts is None:
            raise ValueError(
                f"loss_type={shown} uses length-normalised log-probs; pass "
                "chosen_token_counts and rejected_token_counts (the counts from completion_logps)"
            )
        named["chosen_token_counts"] = chosen_token_counts
        named["rejected_token_counts"] = rejected_token_counts
        if bool((chosen_token_counts <= 0).any() or (rejected_token_counts <= 0).any()):
            raise ValueError("token counts must be positive: a completion has no scored tokens")
    shapes = {name: tuple(t.shape) for name, t in named.items() if t is not None}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"dpo_loss inputs must share one shape, got {shapes}")


def _simpo_loss(
    avg_chosen: Tensor, avg_rejected: Tensor, beta: float, gamma: float, label_smoothing: float
) -> Tensor:
    """simpo from per-token average log-probs (see `dpo_loss`)."""
    return _smoothed_sigmoid_loss(beta * (avg_chosen - avg_rejected) - gamma, label_smoothing)


def _orpo_loss(avg_chosen: Tensor, avg_rejected: Tensor, orpo_lambda: float) -> Tensor:
    """orpo from per-token average log-probs (see `dpo_loss`)."""
    # log p can round to exactly 0 for a near-certain completion; log(1 - 1) would make
    # the log-odds infinite, so keep avg strictly below 0.
    eps = 1e-6
    log_odds_chosen = avg_chosen - _log1mexp(avg_chosen.clamp(max=-eps))
    log_odds_rejected = avg_rejected - _log1mexp(avg_rejected.clamp(max=-eps))
    return -avg_chosen - orpo_lambda * F.logsigmoid(log_odds_chosen - log_odds_rejected)


def _smoothed_sigmoid_loss(z: Tensor, label_smoothing: float) -> Tensor:
    # The preference label is taken as wrong with probability label_smoothing (cDPO).
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


# --------------------------------------------------------------------------------------------
# The types added for TRL parity. Arguments named *_logratios are r = log π − log π_ref of
# each completion, [B] sums over its tokens unless the docstring says otherwise.
# --------------------------------------------------------------------------------------------


def apo_zero_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float) -> Tensor:
    """APO-zero: 1 − σ(β·r_c) + σ(β·r_r), per pair.

    Anchored Preference Optimization (D'Oosterlinck et al. 2024, "Anchored Preference
    Optimization and Contrastive Revisions", arXiv:2408.06266, eq. 7): each completion is
    anchored to the reference separately, raising the chosen one's likelihood and lowering the
    rejected one's; for chosen answers better than the model's own. The paper's form
    −σ(β·r_c) + σ(β·r_r) is shifted by 1 (as TRL does), so that it lies in [0, 2]; the
    gradients are the same.
    """
    return 1.0 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)


def apo_down_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float) -> Tensor:
    """APO-down: σ(β·r_c) + 1 − σ(β·(r_c − r_r)), per pair.

    D'Oosterlinck et al. 2024 (arXiv:2408.06266, eq. 8), for chosen answers worse than the
    model's own: both likelihoods go down, the rejected one's more. The paper's form
    σ(β·r_c) − σ(β·(r_c − r_r)) is shifted by 1 (as TRL does); the gradients are the same.
    """
    return (
        torch.sigmoid(beta * chosen_logratios)
        + 1.0
        - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
    )


def bco_pair_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float) -> Tensor:
    """Binary classifier loss on a pair: −logσ(β·r_c) − logσ(−β·r_r).

    BCO (Jung et al. 2024, "Binary Classifier Optimization for Large Language Model
    Alignment", arXiv:2404.04656): the implicit reward β·r is the logit of a classifier with
    chosen = 1 and rejected = 0. The paper shifts both rewards by δ, a running mean of the
    rewards over training; TRL 1.16's `bco_pair` keeps no such state (δ = 0), and so does this
    function: a δ would be state across steps, to be all-reduced over ranks and saved in
    checkpoints for an exact resume.
    """
    return -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)


def exo_pair_loss(
    chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float, epsilon: float
) -> Tensor:
    """EXO on a pair: KL(q ‖ p) with q = (σ(z), σ(−z)), z = β·(r_c − r_r), p = (1 − ε, ε).

    Efficient Exact Optimization (Ji et al. 2024, "Towards Efficient Exact Optimization of
    Language Model Alignment", arXiv:2402.00856, EXO-pref with K = 2): the policy's
    distribution over {chosen, rejected} is pulled towards the preference label smoothed by
    ε ∈ (0, 0.5] (the paper suggests 1e-3). Written out:
    σ(z)·(logσ(z) − log(1 − ε)) + σ(−z)·(logσ(−z) − log ε), ≥ 0, 0 where σ(z) = 1 − ε.
    """
    if not 0 < epsilon <= 0.5:
        raise ValueError(f"exo_pair needs epsilon in (0, 0.5], got {epsilon}")
    z = beta * (chosen_logratios - rejected_logratios)
    log_q_chosen, log_q_rejected = F.logsigmoid(z), F.logsigmoid(-z)
    return log_q_chosen.exp() * (log_q_chosen - math.log1p(-epsilon)) + log_q_rejected.exp() * (
        log_q_rejected - math.log(epsilon)
    )


def nca_pair_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float) -> Tensor:
    """NCA on a pair: −logσ(β·r_c) − ½·logσ(−β·r_c) − ½·logσ(−β·r_r).

    Noise Contrastive Alignment (Chen et al. 2024, "Noise Contrastive Alignment of Language
    Models with Explicit Rewards", arXiv:2402.05369), the pairwise form: the chosen
    completion is classified as data against both completions as noise, which bounds how far
    the chosen likelihood can fall (unlike DPO, which only widens the margin).
    """
    chosen, rejected = beta * chosen_logratios, beta * rejected_logratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def sppo_hard_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float) -> Tensor:
    """SPPO with hard labels: (r_c − 1/(2β))² + (r_r + 1/(2β))².

    Self-Play Preference Optimization (Wu et al. 2024, "Self-Play Preference Optimization for
    Language Model Alignment", arXiv:2405.00675, the loss of Algorithm 1 with η = 1/β): each
    log-ratio is regressed on η·(P(y ≻ π) − ½). The paper estimates P with a preference
    model; the hard version sets P = 1 for the chosen and 0 for the rejected completion, so
    the targets are ±1/(2β). The log-ratios are not multiplied by β.
    """
    target = 1.0 / (2.0 * beta)
    return (chosen_logratios - target) ** 2 + (rejected_logratios + target) ** 2


def aot_loss(
    policy_margins: Tensor, reference_margins: Tensor, *, beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:  # fmt: skip
    """AOT, paired: the sigmoid (cDPO) loss on sorted margins.

    Alignment via Optimal Transport (Melnyk et al. 2024, "Distributional Preference Alignment
    of LLMs via Optimal Transport", arXiv:2406.05882): the distribution of the policy's margins
    m = log π(y_c) − log π(y_r) over the batch should dominate the reference's, quantile by
    quantile; in one dimension the optimal transport pairs the i-th smallest of each, so both
    are sorted and δᵢ = sort(m_π)ᵢ − sort(m_ref)ᵢ enters −(1−ε)·logσ(β·δᵢ) − ε·logσ(−β·δᵢ).

    The batch is the sample of the distributions: entry i of the result belongs to the i-th
    quantile, not to pair i, and the loss of a batch is not the sum of its halves' losses.
    """
    delta = torch.sort(policy_margins, dim=0).values - torch.sort(reference_margins, dim=0).values
    return _smoothed_sigmoid_loss(beta * delta, label_smoothing)


def aot_unpaired_loss(
    chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:  # fmt: skip
    """AOT, unpaired: the sigmoid (cDPO) loss on δᵢ = sort(r_c)ᵢ − sort(r_r)ᵢ.

    Melnyk et al. 2024 (arXiv:2406.05882), the unpaired setting: the distribution of the
    chosen completions' log-ratios should dominate the rejected ones', whichever pair each came
    from, so the two are sorted separately. As in `aot_loss`, entry i is the i-th quantile.
    """
    delta = (
        torch.sort(chosen_logratios, dim=0).values - torch.sort(rejected_logratios, dim=0).values
    )
    return _smoothed_sigmoid_loss(beta * delta, label_smoothing)


def discopop_loss(
    chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float, tau: float = 0.05
) -> Tensor:
    """DiscoPOP, the log-ratio modulated loss: (1 − m)·(−logσ(z)) + m·exp(−z), m = σ(z/τ).

    Lu et al. 2024 ("Discovering Preference Optimization Algorithms with and for Large
    Language Models", arXiv:2406.08414, eq. 5), z = β·(r_c − r_r): a blend of the logistic
    (DPO) and the exponential loss, weighted by a sigmoid of the margin with temperature τ
    (the paper's 0.05). It is not convex: at z = 0 its slope is (1 − ln 2)/(4τ) − 3/4, positive
    for τ < 0.41, so from policy = reference it first narrows the margin. m·exp(−z) is
    computed as exp(logσ(z/τ) − z), finite where exp(−z) alone overflows.
    """
    z = beta * (chosen_logratios - rejected_logratios)
    modulation = torch.sigmoid(z / tau)
    return (1 - modulation) * -F.logsigmoid(z) + torch.exp(F.logsigmoid(z / tau) - z)


def sigmoid_norm_loss(
    chosen_logratios: Tensor, rejected_logratios: Tensor, *, beta: float
) -> Tensor:
    """Length-normalised DPO: −logσ(β·(r̄_c − r̄_r)), r̄ = r / the completion's token count.

    The DPO variant Tülu 3 trains with (Lambert et al. 2024, "Tülu 3: Pushing Frontiers in
    Open Language Model Post-Training", arXiv:2411.15124): the sigmoid loss on per-token
    log-ratios, so that long completions do not dominate the margin. Takes the per-token
    log-ratios r̄ (`dpo_loss` divides each log-prob by its completion's token count).
    """
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))


def sft_loss(policy_chosen_logps: Tensor, chosen_token_counts: Tensor) -> Tensor:
    """The NLL of each chosen completion, averaged over its tokens: −log π(y_c) / |y_c|.

    The term RPO adds to DPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization",
    arXiv:2404.19733; `dpo.rpo_alpha`) and MPO's generation loss (Wang et al. 2024,
    arXiv:2411.10442). Per pair: a batch's loss is the mean over pairs of per-pair token
    means. TRL 1.16's `sft` averages over all chosen tokens of the batch instead, which
    differs when chosen completions differ in length.
    """
    return -policy_chosen_logps / chosen_token_counts.to(policy_chosen_logps.dtype)
