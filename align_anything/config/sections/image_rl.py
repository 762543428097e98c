"""The sections of online RL for text-to-image pipelines (`flow_grpo`, `dance_grpo`,
`diffusion_nft`): rounds of G images per prompt, the sampler, the images drawn for people and
for the held-out check, and each algorithm's loss. Rewards are the shared `reward` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from align_anything.config.sections.base import _Section
from align_anything.config.sections.diffusion import _TrainingNoise

IMAGE_RL_SCALE_REWARDS = ("group", "batch", "none")  # losses.SCALE_REWARDS


class _ImageRL(_Section):
    """What the three share: each round samples num_generations images per prompt with the
    current weights, scores them with the `reward` section, and trains on them."""

    num_generations: int = Field(
        ge=2,
        description="G: images sampled per prompt (a group; its rewards are compared with each other). The global batch counts images: global_batch / G prompts per round; each rank's micro x grad_accum must be a multiple of G (a group stays on one rank).",
    )
    rollout_steps: int = Field(
        ge=1,
        description="Denoising steps of the rollout sampler (the images the rewards score and the policy trains on).",
    )
    num_iterations: int = Field(
        ge=1,
        description="mu: optimizer steps per round; > 1 reuses the round (the GRPO tasks' ratio then has the log-probs at sampling time as the old policy's).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        description="Advantage = reward - its group's mean, divided by the group's std (group), the whole round's (batch) or nothing (none).",
    )
    adv_clip_max: float = Field(
        gt=0.0,
        description="Advantages are clipped to [-adv_clip_max, adv_clip_max] (Flow-GRPO's and DDPO's adv_clip_max; DiffusionNFT maps [-adv_clip_max, adv_clip_max] onto r in [0, 1]).",
    )
    guidance_scale: float = Field(
        ge=0.0,
        description="Classifier-free guidance, the same in the rollout, in the recomputed log-probs of training, and in the sample and check images (<= 1: none; Flux: its guidance embedding).",
    )
    sample_steps: int = Field(
        ge=1,
        description="Denoising steps of the folder's own sampler for the sample grid and the held-out check images (the Diffusion-DPO task's check, so the two compare).",
    )
    check_samples: int = Field(
        ge=0,
        description="Images for this many held-out captions (each with its seed) before and after training, checked by the dataset's pixel rule where it has one (built-in shapes data): eval/image_check. 0: none.",
    )
    eval_samples: int = Field(
        ge=0,
        description="Held-out prompts drawn at fixed seeds (the folder's own sampler) before and after training and scored by the rewards: eval/reward. 0: none.",
    )

    def round_steps(self) -> tuple[int, int]:
        """(passes over each round, mini-batches a round splits into): mu passes, one batch."""
        return self.num_iterations, 1

    def uses_reference(self) -> bool:
        return False


class _StepGRPO(_ImageRL):
    """GRPO over denoising steps (Flow-GRPO, DanceGRPO): the clipped ratio of each trained
    step's log-probability, and a KL to the reference."""

    train_fraction: float = Field(
        gt=0.0,
        le=1.0,
        description="Share of each trajectory's stochastic sampling steps trained on (a seeded choice per image and round; at least one step): fewer steps, cheaper steps (DanceGRPO's timestep selection, Flow-GRPO's timestep_fraction).",
    )
    beta: float = Field(
        ge=0.0,
        description="Weight of the per-step KL to the reference, (mu - mu_ref)^2 / (2 s^2) averaged over the latent; 0 loads no reference. The reference is the base denoiser (with LoRA: the adapters disabled).",
    )
    epsilon: float = Field(
        ge=0.0,
        lt=1.0,
        description="Clip of the per-step probability ratio: 1 - epsilon (Flow-GRPO and DDPO: 1e-4; a step's log-prob is a mean over latent elements, so ratios stay near 1).",
    )
    epsilon_high: float | None = Field(
        ge=0.0, description="Upper clip: 1 + epsilon_high; null: = epsilon."
    )

    def clip_range(self) -> tuple[float, float]:
        return self.epsilon, self.epsilon if self.epsilon_high is None else self.epsilon_high

    def uses_reference(self) -> bool:
        return self.beta > 0


class FlowGRPOSection(_StepGRPO):
    noise_level: float = Field(
        gt=0.0,
        description="a of the flow SDE's sigma_t = a * sqrt(t / (1 - t)) (Flow-GRPO: 0.7): the rollout's noise; flow-matching pipelines (SD3, Flux).",
    )


class DanceGRPOSection(_StepGRPO):
    eta: float = Field(
        ge=0.0,
        le=1.0,
        description="SD-style UNets (epsilon, v-prediction): DDIM's eta of the rollout sampler (1: DDPM's noise, DDPO's default; 0 is deterministic and has no log-probability, refused).",
    )
    noise_level: float = Field(
        ge=0.0,
        description="Flow-matching pipelines (SD3, Flux): a of the flow SDE, as flow_grpo.noise_level (0: deterministic, refused).",
    )
    shared_noise: bool = Field(
        description="The G images of a prompt start from the same initial noise (DanceGRPO's choice: their rewards then differ by the sampler's noise and the policy alone).",
    )


class DiffusionNFTSection(_ImageRL, _TrainingNoise):
    beta: float = Field(
        gt=0.0,
        description="DiffusionNFT's beta: v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v (its implicit positive and negative policies).",
    )
    old_decay: float = Field(
        ge=0.0,
        lt=1.0,
        description="The old policy (which samples the rounds and gives v_old) is an exponential average of the trained weights: old <- old_decay * old + (1 - old_decay) * trained after every step; 0: the trained weights themselves (no copy).",
    )
    sample_noise: float = Field(
        ge=0.0,
        description="Noise of the rollout sampler (DiffusionNFT needs no likelihood, so any sampler): a of the flow SDE or DDIM's eta; 0: the deterministic ODE sampler.",
    )
