"""Loss functions, pure: tensors in, tensors out. No config objects, no distributed calls; the
trainers turn config values into the keyword arguments. (Log-probs come from
`align_anything.forward`; SFT's loss is the negative of their mean.)

- `preference`: the DPO family (`dpo_loss` and its named types) and the SFT term;
- `kto`: KTO's loss and its KL reference point;
- `reward`: the reward model's pairwise loss;
- `rl`: online RL — GRPO / DAPO / Dr. GRPO advantages, per-token loss and its split-invariant
  aggregation, RLOO's leave-one-out advantages, KL-in-reward and loss;
- `ppo`: PPO with a critic and REINFORCE++ — per-token rewards (score and k1 KL), GAE,
  discounted returns, whitening over the global batch, the clipped policy and value losses,
  explained variance, entropy.

Every public name is re-exported here, so `from align_anything import losses; losses.X` works.
"""

from align_anything.losses.kto import KTOLossOutput, kto_kl_reference, kto_loss
from align_anything.losses.ppo import (
    ADVANTAGE_ESTIMATORS,
    WHITEN_EPS,
    PolicyStats,
    discounted_returns,
    explained_variance,
    explained_variance_moments,
    gae,
    group_baseline,
    last_token_index,
    masked_moments,
    moments_mean_var,
    per_token_rewards,
    ppo_policy_loss,
    token_entropy,
    token_kl,
    value_loss,
    whiten,
)
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
    "ADVANTAGE_ESTIMATORS",
    "BATCH_SORTED_LOSS_TYPES",
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "REFERENCE_FREE_LOSS_TYPES",
    "SCALE_REWARDS",
    "STD_EPS",
    "WHITEN_EPS",
    "ClipStats",
    "DPOLossOutput",
    "KTOLossOutput",
    "PolicyStats",
    "aot_loss",
    "aot_unpaired_loss",
    "apo_down_loss",
    "apo_zero_loss",
    "bco_pair_loss",
    "discopop_loss",
    "discounted_returns",
    "dpo_loss",
    "exo_pair_loss",
    "explained_variance",
    "explained_variance_moments",
    "gae",
    "group_advantages",
    "group_baseline",
    "group_reward_std",
    "grpo_per_token_loss",
    "kto_kl_reference",
    "kto_loss",
    "last_token_index",
    "loss_items",
    "loss_sum",
    "masked_moments",
    "moments_mean_var",
    "nanstd",
    "nca_pair_loss",
    "needs_reference",
    "per_token_rewards",
    "ppo_policy_loss",
    "reward_loss",
    "rloo_advantages",
    "rloo_per_sequence_loss",
    "rloo_reward_with_kl",
    "rloo_sequence_kl",
    "sft_loss",
    "sigmoid_norm_loss",
    "sppo_hard_loss",
    "token_entropy",
    "token_kl",
    "value_loss",
    "whiten",
]
