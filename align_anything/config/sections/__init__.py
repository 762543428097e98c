"""The sections of the run configuration, one module per kind of job; `config.run.RunConfig`
holds them. Every section forbids unknown keys (`base._Section`), and every field has a
description: the README's configuration reference is generated from them
(`python -m align_anything docs`).

- `base`: what every section shares;
- `model`: the model, its frozen parts, LoRA;
- `data`: sources, mixtures, formats, lengths;
- `train`: steps, batches, optimizer, schedule, EMA; `speed`, `logging`, `checkpoint`;
- `preference`: the offline text tasks, `sft`, `dpo`, `rm`, `kto`;
- `reward`: what scores a completion in online RL;
- `online`: the rollout backend (vLLM) and the online RL tasks, `grpo`, `rloo`, `ppo`;
- `diffusion`: the text-to-image tasks, `diffusion_sft`, `diffusion_dpo`;
- `image_rl`: online RL of text-to-image pipelines, `flow_grpo`, `dance_grpo`, `diffusion_nft`.
"""

from align_anything.config.sections.base import names_a_missing_folder
from align_anything.config.sections.data import SOURCE_OPTIONAL, DataConfig, DataSource
from align_anything.config.sections.diffusion import (
    DIFFUSION_DPO_LOSS_TYPES,
    TIMESTEP_SAMPLING,
    DiffusionDPOSection,
    DiffusionSFTSection,
)
from align_anything.config.sections.image_rl import (
    DanceGRPOSection,
    DiffusionNFTSection,
    FlowGRPOSection,
)
from align_anything.config.sections.model import LoraSection, ModelConfig
from align_anything.config.sections.online import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_INITS,
    GRPOSection,
    PPOSection,
    RLOOSection,
    RolloutSection,
    VLLMSection,
)
from align_anything.config.sections.preference import (
    DPOSection,
    KTOSection,
    RMSection,
    SFTSection,
)
from align_anything.config.sections.reward import RemoteRewardSection, RewardSection
from align_anything.config.sections.train import (
    CheckpointConfig,
    EMASection,
    LoggingConfig,
    SpeedSection,
    TrainSection,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "CRITIC_INITS", "DIFFUSION_DPO_LOSS_TYPES", "SOURCE_OPTIONAL",
    "TIMESTEP_SAMPLING", "CheckpointConfig", "DPOSection", "DanceGRPOSection", "DataConfig",
    "DataSource", "DiffusionDPOSection", "DiffusionNFTSection", "DiffusionSFTSection",
    "EMASection", "FlowGRPOSection", "GRPOSection", "KTOSection",
    "LoggingConfig", "LoraSection", "ModelConfig", "PPOSection", "RLOOSection", "RMSection",
    "RemoteRewardSection", "RewardSection", "RolloutSection", "SFTSection", "SpeedSection",
    "TrainSection", "VLLMSection", "names_a_missing_folder",
]  # fmt: skip
