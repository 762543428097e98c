"""The forward pass of text-to-image training: where a batch of cached latents and text
embeddings meets the denoiser (the diffusion sibling of `forward`, in the same layer).

A step of denoising training, per sample: draw noise ε and a noise level t (`draw_noise`),
noise the clean latents x₀ to x_t and take the target (`noisy_latents_and_target`), run the
denoiser with the text conditioning (`predict`), and compare (`denoising_mse`, the per-sample
MSE of `losses.per_sample_mse`). Per kind:

- DDPM-style (SD 1.x/2.x, SDXL): t uniform over the scheduler's training timesteps,
  x_t = `scheduler.add_noise(x₀, ε, t)` = α_t·x₀ + σ_t·ε; target ε (epsilon) or
  `scheduler.get_velocity(x₀, ε, t)` = α_t·ε − σ_t·x₀ (v-prediction);
- flow matching (SD3, Flux), as diffusers' SD3 and Flux training scripts do it: u from the
  timestep density (`TimestepSampling`: uniform, logit-normal or mode), the scheduler's
  timestep and σ at index ⌊u·N⌋ (its shifted table), x_t = (1 − σ)·x₀ + σ·ε, target the
  velocity ε − x₀ (no output preconditioning).

Seeding: each sample's noise and noise level come from its own generator, seeded by
`draw_seed(seed, step, row)` (run seed, optimizer step, the row's index in the training set),
the way online RL seeds each completion (`trainers/rollout.py`). A sample's draw then depends
on nothing else (not the batch, the rank, the world size or the micro-batch split), so 2 ranks
compute what 1 rank does and a resumed run draws what the uninterrupted one drew. The draws are
made on the CPU and moved, so they are also the same on every device.

Video kinds work the same on 5-D latents [B, C, F, h, w] (the noise draws take any latent
shape, the formulas broadcast over it): the UNet-3D layout (`unet3d`) as SD, Wan (`wan`) as the
flow kinds, its transformer given the scheduler's timestep (σ·1000) as diffusers' Wan pipeline
gives it.
AudioLDM (`audioldm`) is SD on latents of log-mel spectrograms ([B, C, frames/s, mels/s]), its
UNet given the caption's CLAP embedding [B, P] as `class_labels` (no `encoder_hidden_states`),
as `AudioLDMPipeline` calls it.

A batch (`Mapping[str, Tensor]`, as `data.latents` collates it): `latents` [B, C, h, w] (scaled
VAE latents; a video's [B, C, F, h, w]), `prompt_embeds` [B, L, D], for SDXL, SD3 and Flux `pooled_prompt_embeds` [B, P],
for SDXL `add_time_ids` [B, 6] (original size, crop top-left, target size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from align_anything.families.diffusion.kinds import FLUX_TRAINING_GUIDANCE
from align_anything.families.diffusion.pipeline import PipelineInfo
from align_anything.losses.diffusion import per_sample_mse

TIMESTEP_SCHEMES = ("uniform", "logit_normal", "mode")


@dataclass(frozen=True)
class TimestepSampling:
    """The density of flow-matching noise levels (diffusers' `weighting_scheme` of its SD3 and
    Flux scripts; SD3 paper §3.1): "uniform", "logit_normal" (u = sigmoid(N(mean, std)), the
    SD3 paper's choice) or "mode" (mode_scale). DDPM-style families always draw t uniformly."""

    scheme: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29

    def __post_init__(self) -> None:
        if self.scheme not in TIMESTEP_SCHEMES:
            raise ValueError(
                f"timestep scheme {self.scheme!r}; one of {', '.join(TIMESTEP_SCHEMES)}"
            )


@dataclass(frozen=True)
class NoiseDraw:
    """Each sample's noise [B, C, h, w] (fp32, CPU), timestep [B] (the value the denoiser is
    given: integer DDPM steps, or the flow scheduler's float timesteps σ·N) and, for flow, σ
    [B]."""

    noise: Tensor
    timesteps: Tensor
    sigmas: Tensor | None

    def repeat(self, times: int) -> NoiseDraw:
        """The same draws for `times` copies of the batch (Diffusion-DPO: chosen and rejected
        share noise and timestep)."""
        return NoiseDraw(
            self.noise.repeat(times, *([1] * (self.noise.dim() - 1))),
            self.timesteps.repeat(times),
            None if self.sigmas is None else self.sigmas.repeat(times),
        )


def draw_seed(seed: int, step: int, row: int) -> int:
    """The seed of one sample's draws: a hash of (run seed, optimizer step, row index in the
    training set) through numpy's `SeedSequence` (well-mixed: neighbouring rows and steps get
    unrelated streams)."""
    state = np.random.SeedSequence([int(seed), int(step), int(row)]).generate_state(1, np.uint64)
    return int(state[0]) & (2**63 - 1)


def draw_noise(
    info: PipelineInfo, scheduler: Any, latent_shape: Sequence[int], seeds: Sequence[int], *,
    sampling: TimestepSampling = TimestepSampling(),
) -> NoiseDraw:  # fmt: skip
    """The noise and noise level of each sample, one generator per seed (see the module
    docstring): first the noise (`latent_shape` = [C, h, w]), then the timestep. `scheduler` is
    the training noise scheduler (`FrozenParts.noise_scheduler`, never one a sampler has called
    `set_timesteps` on: the flow tables would then be the sampler's)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    steps = int(scheduler.config.num_train_timesteps)
    noises, timesteps, sigmas = [], [], []
    for seed in seeds:
        generator = torch.Generator("cpu").manual_seed(int(seed))
        noises.append(torch.randn(tuple(latent_shape), generator=generator))
        if not info.flow:
            timesteps.append(torch.randint(0, steps, (1,), generator=generator))
            continue
        u = compute_density_for_timestep_sampling(
            sampling.scheme, 1, logit_mean=sampling.logit_mean, logit_std=sampling.logit_std,
            mode_scale=sampling.mode_scale, generator=generator,
        )  # fmt: skip
        index = (u * steps).long().clamp(0, steps - 1)
        timesteps.append(scheduler.timesteps[index].float())
        sigmas.append(scheduler.sigmas[index].float())
    return NoiseDraw(
        torch.stack(noises), torch.cat(timesteps), torch.cat(sigmas) if info.flow else None
    )


def _expand(values: Tensor, like: Tensor) -> Tensor:
    return values.reshape(-1, *([1] * (like.dim() - 1)))


def noisy_latents_and_target(
    info: PipelineInfo, scheduler: Any, latents: Tensor, draw: NoiseDraw
) -> tuple[Tensor, Tensor]:
    """(x_t, target) in fp32 on the latents' device, for clean latents x₀ and the draws (see
    the module docstring for each kind's formulas)."""
    latents = latents.float()
    noise = draw.noise.to(latents.device)
    if info.flow:
        sigma = _expand(draw.sigmas.to(latents.device), latents)  # type: ignore[union-attr]
        return (1 - sigma) * latents + sigma * noise, noise - latents
    timesteps = draw.timesteps.to(latents.device)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    if info.prediction == "epsilon":
        return noisy, noise
    return noisy, scheduler.get_velocity(latents, noise, timesteps)


def predict(
    denoiser: Any, info: PipelineInfo, noisy: Tensor, timesteps: Tensor,
    batch: Mapping[str, Tensor], *, guidance: float = FLUX_TRAINING_GUIDANCE,
) -> Tensor:  # fmt: skip
    """The denoiser's output for noisy latents `noisy` [B, C, h, w] at `timesteps` [B], in the
    latents' layout (Flux's packed sequence unpacked again). `denoiser` is the module or the
    engine that wraps it (called, never inspected). `guidance`: Flux's guidance embedding,
    where the transformer has one."""
    device, dtype = batch["prompt_embeds"].device, batch["prompt_embeds"].dtype
    noisy = noisy.to(device=device, dtype=dtype)
    timesteps = timesteps.to(device)
    embeds = batch["prompt_embeds"]
    if info.kind in ("sd", "unet3d"):
        return denoiser(noisy, timesteps, encoder_hidden_states=embeds, return_dict=False)[0]
    if info.kind == "audioldm":  # the text as the class embedding, no cross attention
        return denoiser(
            noisy, timesteps, encoder_hidden_states=None, class_labels=embeds, return_dict=False
        )[0]  # fmt: skip
    if info.kind == "wan":
        return denoiser(
            hidden_states=noisy, timestep=timesteps, encoder_hidden_states=embeds,
            return_dict=False,
        )[0]  # fmt: skip
    if info.kind == "sdxl":
        added = {"text_embeds": batch["pooled_prompt_embeds"],
                 "time_ids": batch["add_time_ids"].to(dtype)}  # fmt: skip
        return denoiser(
            noisy, timesteps, encoder_hidden_states=embeds, added_cond_kwargs=added,
            return_dict=False,
        )[0]  # fmt: skip
    if info.kind == "sd3":
        return denoiser(
            hidden_states=noisy, timestep=timesteps, encoder_hidden_states=embeds,
            pooled_projections=batch["pooled_prompt_embeds"], return_dict=False,
        )[0]  # fmt: skip
    return _predict_flux(denoiser, info, noisy, timesteps, batch, guidance=guidance)


def _predict_flux(
    denoiser: Any, info: PipelineInfo, noisy: Tensor, timesteps: Tensor,
    batch: Mapping[str, Tensor], *, guidance: float,
) -> Tensor:  # fmt: skip
    # Flux sees 2x2 latent patches as a sequence, with rotary position ids for the image
    # patches and zeros for the text tokens; diffusers' own helpers pack and unpack.
    from diffusers import FluxPipeline

    b, c, h, w = noisy.shape
    embeds = batch["prompt_embeds"]
    packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
    image_ids = FluxPipeline._prepare_latent_image_ids(
        b, h // 2, w // 2, noisy.device, embeds.dtype
    )
    text_ids = torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=embeds.dtype)
    guidance_values = None
    if info.denoiser_config.get("guidance_embeds"):
        guidance_values = torch.full((b,), float(guidance), device=noisy.device)
    out = denoiser(
        hidden_states=packed, timestep=timesteps / 1000, guidance=guidance_values,
        pooled_projections=batch["pooled_prompt_embeds"], encoder_hidden_states=embeds,
        txt_ids=text_ids, img_ids=image_ids, return_dict=False,
    )[0]  # fmt: skip
    scale = info.vae_scale_factor
    return FluxPipeline._unpack_latents(out, h * scale, w * scale, scale)


def denoising_mse(
    denoiser: Any, info: PipelineInfo, scheduler: Any, batch: Mapping[str, Tensor],
    draw: NoiseDraw, *, guidance: float = FLUX_TRAINING_GUIDANCE,
) -> Tensor:  # fmt: skip
    """[B]: each sample's MSE between the denoiser's prediction and the target, for the batch's
    clean latents noised by `draw` (fp32)."""
    noisy, target = noisy_latents_and_target(info, scheduler, batch["latents"], draw)
    prediction = predict(denoiser, info, noisy, draw.timesteps, batch, guidance=guidance)
    return per_sample_mse(prediction, target.to(prediction.device))


def batch_to(
    batch: Mapping[str, Tensor], device: torch.device | str, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The batch on `device`, its floating tensors in the denoiser's compute `dtype` (the
    cache keeps the encoders' dtype; a bf16 engine needs bf16 inputs)."""
    return {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        for k, v in batch.items()
    }


def concat_batches(first: Mapping[str, Tensor], second: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """One batch of `first`'s rows then `second`'s (the same keys)."""
    if set(first) != set(second):
        raise ValueError(f"batches with different keys: {sorted(first)} and {sorted(second)}")
    return {k: torch.cat([first[k], second[k]]) for k in first}


def paired_denoising_mse(
    denoiser: Any, info: PipelineInfo, scheduler: Any, chosen: Mapping[str, Tensor],
    rejected: Mapping[str, Tensor], draw: NoiseDraw, *, guidance: float = FLUX_TRAINING_GUIDANCE,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """([B], [B]): the per-sample MSEs of each pair's chosen and rejected image, both noised
    with the pair's one draw (Diffusion-DPO's shared noise and timestep), in one forward pass
    of 2B samples."""
    both = concat_batches(chosen, rejected)
    mse = denoising_mse(denoiser, info, scheduler, both, draw.repeat(2), guidance=guidance)
    return mse.chunk(2)


def signal_to_noise(info: PipelineInfo, scheduler: Any, draw: NoiseDraw) -> Tensor:
    """[B]: each sample's SNR α_t²/σ_t² (diffusers' `compute_snr`), for `min_snr_weights`; the
    flow families have no min-SNR weighting here (`losses.min_snr_weights` says so)."""
    from diffusers.training_utils import compute_snr

    if info.flow:
        raise ValueError("signal_to_noise: min-SNR weighting is for the DDPM-style families")
    return compute_snr(scheduler, draw.timesteps)
