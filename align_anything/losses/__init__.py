"""Loss functions, pure: tensors in, tensors out. No config objects, no distributed calls; the
trainers turn config values into the keyword arguments. (Log-probs come from
`align_anything.forward`; SFT's loss is the negative of their mean.)

- `preference`: the DPO family (`dpo_loss` and its named types) and the SFT term;
- `kto`: KTO's loss and its KL reference point;
- `reward`: the reward model's pairwise loss;
- `rl`: online RL — GRPO / DAPO / Dr. GRPO advantages, per-token loss and its split-invariant
  aggregation, RLOO's leave-one-out advantages, KL-in-reward and loss;
- `diffusion`: text-to-image — per-sample denoising MSE, min-SNR-γ weights, Diffusion-DPO
  (sigmoid, hinge, IPO) and Diffusion-KTO on those MSEs.

Every public name is re-exported here, so `from align_anything import losses; losses.X` works.
"""

from align_anything.losses.diffusion import (
    DIFFUSION_DPO_LOSS_TYPES,
    DiffusionDPOOutput,
    denoising_loss,
    diffusion_dpo_loss,
    diffusion_kto_loss,
    min_snr_weights,
    per_sample_mse,
)
from align_anything.losses.kto import KTOLossOutput, kto_kl_reference, kto_loss
from align_anything.losses.preference import (
    BATCH_SORTED_LOSS_TYPES,
    DPO_LOSS_TYPES,
    REFERENCE_FREE_LOSS_TYPES,
    DPOLossOutput,
    aot_loss,
    aot_unpaired_loss,
    apo_down_loss,
    apo_zero_loss,
    bco_pair_loss,
    discopop_loss,
    dpo_loss,
    exo_pair_loss,
    nca_pair_loss,
    needs_reference,
    sft_loss,
    sigmoid_norm_loss,
    sppo_hard_loss,
)
from align_anything.losses.reward import reward_loss
from align_anything.losses.rl import (
    GRPO_LOSS_TYPES,
    SCALE_REWARDS,
    STD_EPS,
    ClipStats,
    group_advantages,
    group_reward_std,
    grpo_per_token_loss,
    loss_items,
    loss_sum,
    nanstd,
    rloo_advantages,
    rloo_per_sequence_loss,
    rloo_reward_with_kl,
    rloo_sequence_kl,
)

__all__ = [
    "BATCH_SORTED_LOSS_TYPES",
    "DIFFUSION_DPO_LOSS_TYPES",
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "REFERENCE_FREE_LOSS_TYPES",
    "SCALE_REWARDS",
    "STD_EPS",
    "ClipStats",
    "DPOLossOutput",
    "DiffusionDPOOutput",
    "KTOLossOutput",
    "aot_loss",
    "aot_unpaired_loss",
    "apo_down_loss",
    "apo_zero_loss",
    "bco_pair_loss",
    "denoising_loss",
    "diffusion_dpo_loss",
    "diffusion_kto_loss",
    "discopop_loss",
    "dpo_loss",
    "exo_pair_loss",
    "group_advantages",
    "group_reward_std",
    "grpo_per_token_loss",
    "kto_kl_reference",
    "kto_loss",
    "loss_items",
    "loss_sum",
    "min_snr_weights",
    "nanstd",
    "nca_pair_loss",
    "needs_reference",
    "per_sample_mse",
    "reward_loss",
    "rloo_advantages",
    "rloo_per_sequence_loss",
    "rloo_reward_with_kl",
    "rloo_sequence_kl",
    "sft_loss",
    "sigmoid_norm_loss",
    "sppo_hard_loss",
]
