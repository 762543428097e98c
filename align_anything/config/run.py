"""The validated configuration of one run, `RunConfig`: the shared sections, the selected task's
own section, and the checks that need more than one section (room for the prompt beside the
completion, the PPO critic's source, image data for the text-to-image tasks). Which tasks
exist, and which take the online RL sections, is written here once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from align_anything.config.sections import (
    CheckpointConfig,
    DanceGRPOSection,
    DataConfig,
    DiffusionDPOSection,
    DiffusionNFTSection,
    DiffusionSFTSection,
    DPOSection,
    FlowGRPOSection,
    GRPOSection,
    KTOSection,
    LoggingConfig,
    ModelConfig,
    PPOSection,
    RewardSection,
    RLOOSection,
    RMSection,
    RolloutSection,
    SFTSection,
    SpeedSection,
    TrainSection,
)
from align_anything.config.sections.base import _Section, names_a_missing_folder
from align_anything.config.sections.online import _OnlineRL

CONFIG_DIR = Path(__file__).parent.parent / "configs"
TASK_DIR = CONFIG_DIR / "task"


class RunConfig(_Section):
    """The validated configuration of one run. Built only by `load_config`."""

    task: str = Field(
        description="The task: sft, dpo, rm, kto, grpo, rloo, ppo, or for text-to-image pipelines diffusion_sft, diffusion_dpo, flow_grpo, dance_grpo, diffusion_nft (a file in configs/task/)."
    )
    deepspeed: dict[str, Any] = Field(
        description="A shipped preset name (`python -m align_anything presets list`) or a path to a DeepSpeed JSON file; dotted overrides reach inside (`deepspeed.zero_optimization.overlap_comm=false`)."
    )
    deepspeed_source: str
    output_dir: str = Field(
        description="Where metrics, configs, checkpoints and the final model go."
    )
    resume: str | None = Field(
        description="null: start fresh (refused when output_dir already holds a run); auto: the newest complete checkpoint of the run in output_dir (or fresh when the folder is empty); or a checkpoint path.",
    )
    overwrite_output_dir: bool = Field(
        description="Start over in an output_dir that holds an earlier run: its checkpoints, final/ and metrics are removed first (other files stay).",
    )
    model: ModelConfig = Field()
    data: DataConfig = Field()
    train: TrainSection = Field()
    speed: SpeedSection = Field()
    logging: LoggingConfig = Field()
    checkpoint: CheckpointConfig = Field()
    # Dotted keys the user set on the command line; used to detect conflicts with the preset.
    explicit_keys: frozenset[str] = frozenset()
    # What the start-up summary says of the command line (a key given twice: the last is used).
    override_notes: tuple[str, ...] = ()
    # One section per task; only the selected task's section may be present.
    sft: SFTSection | None = None
    dpo: DPOSection | None = None
    rm: RMSection | None = None
    kto: KTOSection | None = None
    grpo: GRPOSection | None = None
    rloo: RLOOSection | None = None
    ppo: PPOSection | None = None
    diffusion_sft: DiffusionSFTSection | None = None
    diffusion_dpo: DiffusionDPOSection | None = None
    flow_grpo: FlowGRPOSection | None = None
    dance_grpo: DanceGRPOSection | None = None
    diffusion_nft: DiffusionNFTSection | None = None
    # Online RL only (set in task/grpo.yaml, rloo.yaml, ppo.yaml and the image RL tasks').
    reward: RewardSection | None = None
    rollout: RolloutSection | None = None

    @field_validator("resume", mode="before")
    @classmethod
    def _no_resume(cls, value: Any) -> Any:
        return (
            None
            if isinstance(value, str) and value.strip().lower() in ("", "none", "null")
            else value
        )

    @model_validator(mode="after")
    def _room_for_prompts(self) -> RunConfig:
        online = self.section() if self.task in ONLINE_TASKS else None
        if (
            isinstance(online, (_OnlineRL, PPOSection))
            and online.max_completion_length >= self.data.max_length
        ):
            completion, limit = online.max_completion_length, self.data.max_length
            raise ValueError(
                f"{self.task}.max_completion_length={completion} leaves no room for the prompt: "
                f"data.max_length={limit} counts the prompt's tokens and the completion's. Raise "
                f"data.max_length above {completion} by the longest prompt's tokens (e.g. "
                f"data.max_length={completion + 128}), or lower {self.task}.max_completion_length "
                f"below {limit}"
            )
        return self

    @model_validator(mode="after")
    def _critic_source(self) -> RunConfig:
        ppo = self.ppo if self.task == "ppo" else None
        if ppo is None or not ppo.trains_critic():
            return self
        if ppo.critic_model is not None and names_a_missing_folder(ppo.critic_model):
            raise ValueError(
                f"ppo.critic_model={ppo.critic_model!r}: no such folder (give a task=rm final/ "
                "folder for critic_init=reward_model, or the policy's for critic_init=policy)"
            )
        no_rm = self.reward is None or self.reward.model is None
        if ppo.critic_model is None and ppo.critic_init == "reward_model" and no_rm:
            raise ValueError(
                "ppo.critic_init=reward_model starts the critic from the reward model, but "
                "reward.model is null: set reward.model (a task=rm final/ folder) or "
                "ppo.critic_model, or use ppo.critic_init=policy (a new value head on the "
                "policy's weights)"
            )
        return self

    @model_validator(mode="after")
    def _image_data(self) -> RunConfig:
        # The text-to-image readers take one source each (no mixtures) and find its shape
        # themselves: captioned images for diffusion_sft, Pick-a-Pic pairs for diffusion_dpo,
        # prompts (with any other columns, for the rewards) for online RL.
        if self.task not in DIFFUSION_TASKS:
            return self
        data = self.data
        problems = [
            f"data.{key} is a list of sources; {self.task} reads one source (a folder, file or "
            "built-in name)"
            for key in ("path", "eval_path")
            if isinstance(getattr(data, key), list)
        ]
        if data.format != "auto":
            reads = {"diffusion_sft": "captioned images", "diffusion_dpo": "Pick-a-Pic pairs"}
            problems.append(
                f"data.format={data.format!r} names a text format; {self.task} reads "
                + reads.get(self.task, "prompts (a caption column and any others)")
                + " (data.columns maps their names): leave data.format=auto"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def section(self) -> BaseModel | dict[str, Any] | None:
        """The task's own section (e.g. `cfg.dpo` for task=dpo)."""
        return getattr(self, self.task)

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as plain data, as saved beside checkpoints."""
        data = self.model_dump(mode="json", exclude={"explicit_keys", "override_notes"})
        return {k: v for k, v in data.items() if v is not None or k in ("resume",)}


# Task name -> the schema of its own config section.
TASK_SECTIONS: dict[str, type[BaseModel]] = {
    "sft": SFTSection, "dpo": DPOSection, "rm": RMSection, "kto": KTOSection,
    "grpo": GRPOSection, "rloo": RLOOSection, "ppo": PPOSection,
    "diffusion_sft": DiffusionSFTSection, "diffusion_dpo": DiffusionDPOSection,
    "flow_grpo": FlowGRPOSection, "dance_grpo": DanceGRPOSection,
    "diffusion_nft": DiffusionNFTSection,
}  # fmt: skip
# Language-model tasks that generate online (the `rollout` section: their generation backend).
ONLINE_TASKS = ("grpo", "rloo", "ppo")
# Online RL of text-to-image pipelines (they sample with the run's own denoiser).
IMAGE_RL_TASKS = ("flow_grpo", "dance_grpo", "diffusion_nft")
# Tasks that score what the model makes and so take the `reward` section.
REWARD_TASKS = ONLINE_TASKS + IMAGE_RL_TASKS
# Tasks that train a text-to-image pipeline's denoiser (their data are images and captions, or
# prompts).
DIFFUSION_TASKS = ("diffusion_sft", "diffusion_dpo", *IMAGE_RL_TASKS)


def available_tasks() -> list[str]:
    """Task names that have a config file in configs/task/."""
    return sorted(p.stem for p in TASK_DIR.glob("*.yaml"))
