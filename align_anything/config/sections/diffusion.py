"""The sections of the text-to-image tasks (`diffusion_sft`, `diffusion_dpo`): the training noise
levels of flow-matching families, the sample and check images, and each task's loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from align_anything.config.sections.base import _Section

TIMESTEP_SAMPLING = ("uniform", "logit_normal", "mode")  # forward_diffusion.TIMESTEP_SCHEMES
DIFFUSION_DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")  # losses.DIFFUSION_DPO_LOSS_TYPES


class _TrainingNoise(_Section):
    """The noise levels drawn in training (flow-matching families): the pipeline tasks' and
    DiffusionNFT's forward-noised samples."""

    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = Field(
        description="Flow-matching families (SD3, Flux): the density of training noise levels, as diffusers' weighting_scheme: uniform, logit_normal (the SD3 paper's) or mode. SD 1.x/2.x and SDXL draw timesteps uniformly.",
    )
    logit_mean: float = Field(description="logit_normal: the mean of the normal.")
    logit_std: float = Field(gt=0.0, description="logit_normal: the standard deviation.")
    mode_scale: float = Field(description="mode: the scale of the mode density.")


class _Diffusion(_TrainingNoise):
    """What the text-to-image tasks share: the noise levels drawn in training (flow-matching
    families), and the images drawn for people to look at and for the held-out check."""

    flux_guidance: float = Field(
        gt=0.0,
        description="Flux with a guidance embedding (guidance-distilled): the guidance value the transformer is given in training (diffusers' DreamBooth script: 3.5).",
    )
    sample_steps: int = Field(
        ge=1, description="Denoising steps of the folder's own sampler for sample and check images."
    )
    guidance_scale: float = Field(
        ge=0.0,
        description="Classifier-free guidance of sample and check images (1: none).",
    )
    check_samples: int = Field(
        ge=0,
        description="Images for this many held-out captions (each with its seed) before and after training, checked by the dataset's pixel rule where it has one (built-in shapes data: the dominant colour names the caption's): eval/image_check. 0: none.",
    )


class DiffusionSFTSection(_Diffusion):
    eval_draws: int = Field(
        ge=1,
        description="Noise draws (noise and noise level, from the training density) each held-out image is scored at, the same at every evaluation; its eval/loss and eval/mse are their mean. More draws: the same expected loss with less noise, at that many forward passes per held-out image.",
    )
    min_snr_gamma: float | None = Field(
        gt=0.0,
        description="Min-SNR-gamma weighting of the denoising loss (Hang et al. 2023; 5.0 is the paper's), epsilon and v-prediction only; null: the plain MSE.",
    )


class DiffusionDPOSection(_Diffusion):
    beta: float = Field(
        gt=0.0,
        description="Diffusion-DPO's beta on the MSE differences: logits = (ref_w - ref_l) - (theta_w - theta_l), loss -log sigmoid(beta * logits). diffusers' research script's beta_dpo is 2x this (its SD 1.5 2000 is 1000 here); users report loss spikes at its 2,000-5,000.",
    )
    loss_type: Literal["sigmoid", "hinge", "ipo"] = Field(
        description="sigmoid (Wallace et al. 2023), hinge (relu(1 - beta * logits)) or ipo ((logits - 1/(2 beta))^2).",
    )
    sft_weight: float = Field(
        ge=0.0,
        description="Weight of the chosen image's own denoising loss (its MSE) added to each pair's loss, as RPO adds the chosen NLL to text DPO: it keeps the policy from losing the chosen images while the margin grows. At the start the sigmoid loss weighs the chosen MSE by beta/2, so beta/2 matches it. 0: plain Diffusion-DPO.",
    )
