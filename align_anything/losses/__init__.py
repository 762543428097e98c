"""Loss functions, pure: tensors in, tensors out. No config objects, no distributed calls; the
tasks turn config values into the keyword arguments. (Log-probs come from
`align_anything.families.language.forward`; SFT's loss is the negative of their mean.)

- `rules`: the DPO loss types by name and the rules for combining them (no torch: the run
  config reads them too);
- `preference`: the DPO family (`dpo_loss` and its named types) and the SFT term;
- `kto`: KTO's loss and its KL reference point;
- `reward`: the reward model's pairwise loss;
- `rl`: online RL — GRPO / DAPO / Dr. GRPO advantages, per-token loss and its split-invariant
  aggregation, RLOO's leave-one-out advantages, KL-in-reward and loss;
- `ppo`: PPO with a critic and REINFORCE++ — per-token rewards (score and k1 KL), GAE,
  discounted returns, whitening over the global batch, the clipped policy and value losses,
  explained variance, entropy.
- `diffusion`: text-to-image — per-sample denoising MSE, min-SNR-γ weights, Diffusion-DPO
  (sigmoid, hinge, IPO) and Diffusion-KTO on those MSEs.
- `diffusion_rl`: online RL of text-to-image — a denoising step's Gaussian log-density and KL,
  the clipped ratio per step (Flow-GRPO, DanceGRPO), capped group advantages, DiffusionNFT's
  optimality and loss.

Every public name is re-exported here, so `from align_anything import losses; losses.X` works.
The re-exports load their module on first use (PEP 562), so that importing `losses.rules`
does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "DIFFUSION_DPO_LOSS_TYPES": "diffusion",
    "DiffusionDPOOutput": "diffusion",
    "denoising_loss": "diffusion",
    "diffusion_dpo_loss": "diffusion",
    "diffusion_kto_loss": "diffusion",
    "min_snr_weights": "diffusion",
    "per_sample_mse": "diffusion",
    "StepLossOutput": "diffusion_rl",
    "capped_group_advantages": "diffusion_rl",
    "gaussian_kl": "diffusion_rl",
    "gaussian_log_prob": "diffusion_rl",
    "nft_loss": "diffusion_rl",
    "nft_optimality": "diffusion_rl",
    "step_policy_loss": "diffusion_rl",
    "KTOLossOutput": "kto",
    "kto_kl_reference": "kto",
    "kto_loss": "kto",
    "DPOLossOutput": "preference",
    "aot_loss": "preference",
    "aot_unpaired_loss": "preference",
    "apo_down_loss": "preference",
    "apo_zero_loss": "preference",
    "bco_pair_loss": "preference",
    "discopop_loss": "preference",
    "dpo_loss": "preference",
    "exo_pair_loss": "preference",
    "nca_pair_loss": "preference",
    "sft_loss": "preference",
    "sigmoid_norm_loss": "preference",
    "sppo_hard_loss": "preference",
    "reward_loss": "reward",
    "ClipStats": "rl",
    "GRPO_LOSS_TYPES": "rl",
    "SCALE_REWARDS": "rl",
    "STD_EPS": "rl",
    "group_advantages": "rl",
    "group_reward_std": "rl",
    "grpo_per_token_loss": "rl",
    "loss_items": "rl",
    "loss_sum": "rl",
    "nanstd": "rl",
    "rloo_advantages": "rl",
    "rloo_per_sequence_loss": "rl",
    "rloo_reward_with_kl": "rl",
    "rloo_sequence_kl": "rl",
    "logp_mismatch": "rl",
    "truncated_importance_weights": "rl",
    "ADVANTAGE_ESTIMATORS": "ppo",
    "WHITEN_EPS": "ppo",
    "PolicyStats": "ppo",
    "discounted_returns": "ppo",
    "explained_variance": "ppo",
    "explained_variance_moments": "ppo",
    "gae": "ppo",
    "group_baseline": "ppo",
    "last_token_index": "ppo",
    "masked_moments": "ppo",
    "moments_mean_var": "ppo",
    "per_token_rewards": "ppo",
    "ppo_policy_loss": "ppo",
    "token_entropy": "ppo",
    "token_kl": "ppo",
    "value_loss": "ppo",
    "whiten": "ppo",
    "BATCH_SORTED_LOSS_TYPES": "rules",
    "DPO_LOSS_TYPES": "rules",
    "REFERENCE_FREE_LOSS_TYPES": "rules",
    "needs_reference": "rules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return __all__
