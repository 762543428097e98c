"""The run configuration: Hydra composition, DeepSpeed preset loading, and one validation pass.

Flow: CLI overrides -> Hydra compose (train.yaml + task/<task>.yaml) -> value overrides applied
here -> preset JSON loaded (duplicate keys rejected) with `deepspeed.*` overrides -> pydantic
`RunConfig` (extra="forbid"). Every problem found on the way is collected and reported in one
`ConfigError`, with the full key path, the value given and what is allowed.

- `loading`: composition, presets, overrides, `load_config`;
- `run`: `RunConfig` and its cross-section checks, the task names;
- `problems`: a pydantic error as key paths, values given and "did you mean";
- `sections/`: the sections, one module per kind of job.

Importers take the names below from `align_anything.config`.
"""

from align_anything.config.loading import (
    AUTO_PRESET,
    PRESET_DIR,
    available_presets,
    load_config,
    load_preset,
    merge_nested,
    preset_path,
)
from align_anything.config.run import (
    CONFIG_DIR,
    DIFFUSION_TASKS,
    IMAGE_RL_TASKS,
    ONLINE_TASKS,
    REWARD_TASKS,
    TASK_DIR,
    TASK_SECTIONS,
    RunConfig,
    available_tasks,
)
from align_anything.config.sections import (
    CheckpointConfig,
    DataConfig,
    DataSource,
    DiffusionDPOSection,
    DiffusionSFTSection,
    DPOSection,
    EMASection,
    GRPOSection,
    KTOSection,
    LoggingConfig,
    LoraSection,
    ModelConfig,
    PPOSection,
    RemoteRewardSection,
    RewardSection,
    RLOOSection,
    RMSection,
    RolloutSection,
    SFTSection,
    SpeedSection,
    TrainSection,
    VLLMSection,
    names_a_missing_folder,
)

__all__ = [
    "AUTO_PRESET", "CONFIG_DIR", "DIFFUSION_TASKS", "IMAGE_RL_TASKS", "ONLINE_TASKS",
    "PRESET_DIR", "REWARD_TASKS", "TASK_DIR",
    "TASK_SECTIONS", "CheckpointConfig", "DPOSection", "DataConfig", "DataSource",
    "DiffusionDPOSection", "DiffusionSFTSection", "EMASection", "GRPOSection", "KTOSection",
    "LoggingConfig", "LoraSection", "ModelConfig", "PPOSection", "RLOOSection", "RMSection",
    "RemoteRewardSection", "RewardSection", "RolloutSection", "RunConfig", "SFTSection",
    "SpeedSection", "TrainSection", "VLLMSection", "available_presets", "available_tasks",
    "load_config", "load_preset", "merge_nested", "names_a_missing_folder", "preset_path",
]  # fmt: skip
