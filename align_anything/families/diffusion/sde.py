"""Samplers whose every denoising step is a Gaussian with a known mean and standard deviation,
and that step's log-probability: what online RL of a diffusion model needs (the policy's action
at step k is the next latent, x_{k+1} ~ N(μ_θ(x_k, t_k), s_k²·I)). Pure functions of tensors
and the scheduler's tables, for any denoiser the kit calls (`forward.predict`).

Two samplers (`Sampler.kind`):

- **"flow_sde"**, flow matching (SD3, Flux; Flow-GRPO, Liu et al. 2025, arXiv:2505.05470,
  eq. 8-9). With x_t = (1 − t)·x₀ + t·ε and the velocity v = ε − x₀, the score of x_t is
  −(x_t + (1 − t)·v)/t, so the reverse-time SDE with diffusion σ_t has the same marginals as
  the ODE dx = v·dt:

      dx = [v + σ_t²/(2t)·(x + (1 − t)·v)]·dt + σ_t·dw,     σ_t = a·√(t / (1 − t))

  Euler-Maruyama from noise level t = σ_k to σ_{k+1} (dt = σ_{k+1} − σ_k < 0) gives the step
  mean x + [v + σ_t²/(2σ_k)·(x + (1 − σ_k)·v)]·dt and std σ_t·√(−dt). At σ_k = 1 (the first
  step) √(t/(1 − t)) is infinite; as Flow-GRPO's sampler does, the denominator then takes the
  second noise level, 1 − σ_1. `a` (`noise_level`, the paper's 0.7) sets the noise; a = 0 is
  diffusers' Euler ODE sampler exactly (`FlowMatchEulerDiscreteScheduler.step`). The noise
  levels are the kind's pipeline's (`FlowMatchEulerDiscreteScheduler.set_timesteps` as
  StableDiffusion3Pipeline / FluxPipeline call it, their shift and dynamic shift included).
- **"ddim"**, the UNet families (SD 1.x/2.x, SDXL; epsilon or v-prediction: DDPO, Black et
  al. 2023, and DanceGRPO, Xue et al. 2025): DDIM (Song et al. 2021, eq. 12) with η > 0. From
  the prediction, x̂₀ = (x − √(1 − ᾱ_t)·ε̂)/√ᾱ_t (v: x̂₀ = √ᾱ_t·x − √(1 − ᾱ_t)·v̂, ε̂ =
  √ᾱ_t·v̂ + √(1 − ᾱ_t)·x), then

      s² = η²·(1 − ᾱ_prev)/(1 − ᾱ_t)·(1 − ᾱ_t/ᾱ_prev),   mean = √ᾱ_prev·x̂₀ + √(1 − ᾱ_prev − s²)·ε̂

  with diffusers' `DDIMScheduler` tables (t_prev = t − N/K; the last step's ᾱ_prev is the
  scheduler's final one), so η = 0 is its deterministic sampler and η > 0 its `step(eta=η)`
  with the given noise. The folder's own scheduler may be another one (PNDM, Euler): its noise
  schedule carries over, as DDPO samples SD 1.5 with DDIM.

`gaussian_log_prob` of `losses.diffusion_rl` is each step's log π: the Gaussian density of the
next latent, averaged over the latent's elements. A step with std 0 (η = 0, a = 0, or DDIM's
last step when `set_alpha_to_one`) has no density: `build_sampler` refuses a sampler with no
such step to train on, before any compute (`SamplerError`).

Classifier-free guidance (`guided_prediction`): the same in the rollout and in the recomputed
log-probs of training, ε̂ = ε̂_u + w·(ε̂_c − ε̂_u) for w > 1 (as diffusers' pipelines: none at
w ≤ 1), the unconditional half on the empty prompt's embeddings (SDXL with
`force_zeros_for_empty_prompt`: zeros); Flux takes w as its guidance embedding instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from align_anything.errors import ConfigError
from align_anything.families.diffusion.forward import predict
from align_anything.families.diffusion.pipeline import PipelineInfo
from align_anything.losses.diffusion_rl import gaussian_log_prob

SAMPLERS = ("flow_sde", "ddim")
# Flow-GRPO's noise level a of σ_t = a·√(t/(1 − t)).
FLOW_GRPO_NOISE_LEVEL = 0.7


class SamplerError(ConfigError):
    """A sampler that cannot give what the task asks of it (a log-probability where every step
    is deterministic, a kind it does not sample)."""


@dataclass(frozen=True)
class StepGaussian:
    """One denoising step's distribution for a batch: the next latent's `mean` [B, ...] and
    standard deviation `std` [B] (one per sample: it depends on the step only)."""

    mean: Tensor
    std: Tensor


@dataclass(frozen=True)
class Sampler:
    """A K-step sampler: `timesteps[k]` is what the denoiser is given at step k (DDPM steps, or
    the flow scheduler's σ·N); `table` holds the noise schedule (flow: σ_0 … σ_K with σ_K = 0;
    ddim: per step (ᾱ_t, ᾱ_prev)); `noise` is a (flow) or η (ddim)."""

    kind: str
    prediction: str  # "flow", "epsilon", "v_prediction"
    timesteps: Tensor  # [K] float32
    table: Tensor  # flow [K + 1]; ddim [K, 2]; float64
    noise: float
    clip_sample: float | None = None  # ddim: clip x̂₀ to ±this (the scheduler's clip_sample)

    @property
    def steps(self) -> int:
        return int(self.timesteps.shape[0])

    def stds(self) -> Tensor:
        """[K] float64: each step's standard deviation (0: a deterministic step)."""
        return self._stds

    @functools.cached_property
    def _stds(self) -> Tensor:
        if self.kind == "flow_sde":
            sigma, following = self.table[:-1], self.table[1:]
            return self._flow_noise(sigma) * torch.sqrt(sigma - following)
        alpha, previous = self.table[:, 0], self.table[:, 1]
        variance = (1 - previous) / (1 - alpha) * (1 - alpha / previous)
        return self.noise * variance.clamp(min=0).sqrt()

    def stochastic_steps(self) -> list[int]:
        """The steps with a density (std > 0): the ones a likelihood-based task trains on."""
        return [k for k, s in enumerate(self.stds().tolist()) if s > 0]

    def _flow_noise(self, sigma: Tensor) -> Tensor:
        """σ_t = a·√(t/(1 − t)) at noise levels `sigma`; at t = 1 the denominator takes the
        second level (the first step's t/(1 − t) is infinite)."""
        second = self.table[1] if self.table.numel() > 1 else self.table[0]
        denominator = torch.where(sigma >= 1, 1 - second, 1 - sigma)
        return self.noise * torch.sqrt(sigma / denominator)

    @functools.cached_property
    def _step_flow_noise(self) -> Tensor:
        """[K]: σ_t of each step (flow)."""
        return self._flow_noise(self.table[:-1])

    def gaussian(self, step: Tensor, sample: Tensor, output: Tensor) -> StepGaussian:
        """The distribution of the next latent from `sample` [B, ...] at steps `step` [B] (one
        per sample: a training batch mixes steps) given the denoiser's guided `output` there.
        Computed in fp32 (fp64 inputs stay fp64)."""
        dtype = torch.promote_types(sample.dtype, torch.float32)
        x, out = sample.to(dtype), output.to(dtype)
        step = step.to(torch.long).cpu()
        std = self.stds()[step].to(dtype=dtype, device=x.device)

        def per_sample(values: Tensor) -> Tensor:
            return values.to(dtype=dtype, device=x.device).reshape(-1, *([1] * (x.dim() - 1)))

        if self.kind == "flow_sde":
            sigma, following = self.table[step], self.table[step + 1]
            dt = per_sample(following - sigma)
            t = per_sample(sigma)
            noise = per_sample(self._step_flow_noise[step])
            mean = x + (out + noise**2 / (2 * t) * (x + (1 - t) * out)) * dt
            return StepGaussian(mean, std)
        alpha, previous = per_sample(self.table[step, 0]), per_sample(self.table[step, 1])
        if self.prediction == "epsilon":
            x0 = (x - (1 - alpha).sqrt() * out) / alpha.sqrt()
            epsilon = out
        else:  # v_prediction
            x0 = alpha.sqrt() * x - (1 - alpha).sqrt() * out
            epsilon = alpha.sqrt() * out + (1 - alpha).sqrt() * x
        if self.clip_sample is not None:
            x0 = x0.clamp(-self.clip_sample, self.clip_sample)
        s = per_sample(std)
        mean = previous.sqrt() * x0 + (1 - previous - s**2).clamp(min=0).sqrt() * epsilon
        return StepGaussian(mean, std)

    def step(
        self, step: Tensor, sample: Tensor, output: Tensor, noise: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """(the next latent mean + std·`noise` (the mean where `noise` is None), its
        log-probability [B]; NaN for a deterministic step)."""
        gaussian = self.gaussian(step, sample, output)
        if noise is None:
            following = gaussian.mean
        else:
            std = gaussian.std.reshape(-1, *([1] * (sample.dim() - 1)))
            following = gaussian.mean + std * noise.to(gaussian.mean)
        return following, step_log_prob(following, gaussian)


def step_log_prob(sample: Tensor, gaussian: StepGaussian) -> Tensor:
    """[B]: `losses.gaussian_log_prob` of `sample` under the step's Gaussian, NaN for a sample
    whose step is deterministic (std 0)."""
    stochastic = gaussian.std > 0
    if bool(stochastic.all()):
        return gaussian_log_prob(sample, gaussian.mean, gaussian.std)
    out = torch.full(
        (sample.shape[0],), float("nan"), dtype=gaussian.mean.dtype, device=sample.device
    )
    if bool(stochastic.any()):
        keep = stochastic.nonzero().flatten()
        out[keep] = gaussian_log_prob(sample[keep], gaussian.mean[keep], gaussian.std[keep])
    return out


def _flow_tables(info: PipelineInfo, steps: int, latent_shape: Sequence[int]) -> tuple[Any, Any]:
    """(timesteps [K], σ [K + 1]) as the kind's pipeline sets its flow scheduler: SD3's
    `set_timesteps(K)` (with `mu` from the image's token count when the scheduler shifts
    dynamically), Flux's `set_timesteps(sigmas=linspace(1, 1/K, K), mu)`."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(info.scheduler_config)
    config = scheduler.config
    height, width = int(latent_shape[-2]), int(latent_shape[-1])
    patch = int(info.denoiser_config.get("patch_size") or 1) if info.kind == "sd3" else 2
    # The shift from the image's token count: used where the scheduler shifts dynamically
    # (Flux's), ignored by `set_timesteps` otherwise (the pipelines pass it the same way).
    mu = calculate_shift(
        (height // patch) * (width // patch), config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
        config.get("max_shift", 1.16 if info.kind == "sd3" else 1.15),
    )  # fmt: skip
    kwargs: dict[str, Any] = {"mu": mu} if config.get("use_dynamic_shifting") else {}
    if info.kind == "flux":
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), **kwargs)
    else:
        scheduler.set_timesteps(steps, **kwargs)
    return scheduler.timesteps.float(), scheduler.sigmas.double()


def _ddim_tables(info: PipelineInfo, steps: int) -> tuple[Tensor, Tensor, float | None]:
    """(timesteps [K], (ᾱ_t, ᾱ_prev) [K, 2], clip) of diffusers' `DDIMScheduler` from the
    folder's noise schedule."""
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config(info.scheduler_config)
    if scheduler.config.thresholding:
        raise SamplerError(
            f"{info.name}: the scheduler's thresholding (dynamic thresholding of pixel-space "
            "models) is not implemented in the DDIM sampler with log-probabilities; set "
            "thresholding=false in its scheduler_config.json"
        )
    scheduler.set_timesteps(steps)
    ratio = scheduler.config.num_train_timesteps // steps
    cumprod = scheduler.alphas_cumprod.double()
    final = float(scheduler.final_alpha_cumprod)
    rows = []
    for t in scheduler.timesteps.tolist():
        previous = t - ratio
        rows.append([float(cumprod[t]), float(cumprod[previous]) if previous >= 0 else final])
    clip = float(scheduler.config.clip_sample_range) if scheduler.config.clip_sample else None
    return scheduler.timesteps.float(), torch.tensor(rows, dtype=torch.float64), clip


def sampler_kind(info: PipelineInfo) -> str:
    """The sampler of a pipeline kind: flow_sde for flow matching, ddim for the UNets."""
    return "flow_sde" if info.flow else "ddim"


def build_sampler(
    info: PipelineInfo, *, steps: int, noise: float, latent_shape: Sequence[int],
    needs_log_probs: bool, what: str = "the sampler",
) -> Sampler:  # fmt: skip
    """The kind's sampler (`sampler_kind`) with `steps` steps and noise `noise` (a for flow, η
    for DDIM), its tables as the kind's pipeline sets them for latents of `latent_shape`.
    `needs_log_probs`: a `SamplerError` (before any compute) when no step has a density:
    η = 0 or a = 0, naming the setting `what` to change."""
    if steps < 1:
        raise SamplerError(f"{what}: {steps} denoising steps; at least 1")
    if noise < 0:
        raise SamplerError(f"{what}: noise {noise} < 0")
    kind = sampler_kind(info)
    if kind == "flow_sde":
        timesteps, table = _flow_tables(info, steps, latent_shape)
        sampler = Sampler(kind, info.prediction, timesteps, table, float(noise))
    else:
        timesteps, table, clip = _ddim_tables(info, steps)
        sampler = Sampler(kind, info.prediction, timesteps, table, float(noise), clip)
    if needs_log_probs and not sampler.stochastic_steps():
        setting = "a (the noise level of sigma_t = a*sqrt(t/(1-t)))" if kind == "flow_sde" else (
            "eta (DDIM's noise; eta = 0 is the deterministic sampler)"
        )  # fmt: skip
        raise SamplerError(
            f"{what}: the {kind} sampler of {info.name} ({info.kind}, {info.prediction}) with "
            f"noise {noise:g} is deterministic at every one of its {steps} steps, so no step "
            f"has a log-probability to train on: set {setting} > 0"
        )
    return sampler


# ---------------------------------------------------------------------------- the denoiser


ModelOutput = Callable[[Tensor, Tensor], Tensor]


def guided_prediction(
    denoiser: Any, info: PipelineInfo, sample: Tensor, timesteps: Tensor,
    conditioning: Mapping[str, Tensor], unconditional: Mapping[str, Tensor] | None, *,
    guidance_scale: float,
) -> Tensor:  # fmt: skip
    """The denoiser's output for `sample` [B, ...] at `timesteps` [B] under classifier-free
    guidance w = `guidance_scale`: one pass on `conditioning` (rows aligned with `sample`) when
    w ≤ 1 or for Flux (w is its guidance embedding), else one pass of 2B rows, the
    unconditional ones on `unconditional` (its rows aligned the same way), mixed as
    ε̂_u + w·(ε̂_c − ε̂_u)."""
    if info.kind == "flux":
        return predict(denoiser, info, sample, timesteps, conditioning, guidance=guidance_scale)
    if guidance_scale <= 1:
        return predict(denoiser, info, sample, timesteps, conditioning)
    if unconditional is None:
        raise ValueError("guidance_scale > 1 needs the unconditional embeddings")
    # What the unconditional half lacks (SDXL's size and crop ids) is the conditional's, as
    # diffusers' pipelines repeat it.
    both = {
        key: torch.cat([unconditional.get(key, value), value])
        for key, value in conditioning.items()
    }
    output = predict(denoiser, info, sample.repeat(2, *([1] * (sample.dim() - 1))),
                     timesteps.repeat(2), both)  # fmt: skip
    uncond, cond = output.chunk(2)
    return uncond + guidance_scale * (cond - uncond)


def unconditional_embeddings(parts: Any, count: int) -> dict[str, Tensor]:
    """The empty prompt's embeddings, `count` rows (the unconditional half of classifier-free
    guidance as the kind's pipeline makes it without a negative prompt: SDXL with
    `force_zeros_for_empty_prompt` uses zeros)."""
    empty = parts.encode_prompts([""])
    if parts.info.kind == "sdxl" and parts.info.components.get("force_zeros_for_empty_prompt",
                                                                 True):  # fmt: skip
        empty = {key: torch.zeros_like(value) for key, value in empty.items()}
    return {key: value.expand(count, *value.shape[1:]) for key, value in empty.items()}


# ---------------------------------------------------------------------------- trajectories


@dataclass(frozen=True)
class Trajectory:
    """Sampled denoising trajectories: `latents` [B, K + 1, C, h, w] (fp32: the initial noise,
    then the latent after each step) and `log_probs` [B, K] (each step's log π, NaN for a
    deterministic step)."""

    latents: Tensor
    log_probs: Tensor

    @property
    def final(self) -> Tensor:
        """[B, C, h, w]: the clean latents the trajectories end in."""
        return self.latents[:, -1]


def draw_normal(seeds: Sequence[int], shape: Sequence[int], count: int = 1) -> Tensor:
    """[B, count, *shape] standard normal draws (fp32, CPU), sample b's from its own generator
    seeded by `seeds[b]`: a sample's draws depend on its seed alone."""
    out = []
    for seed in seeds:
        generator = torch.Generator("cpu").manual_seed(int(seed))
        out.append(torch.randn((count, *shape), generator=generator))
    return torch.stack(out)


@torch.no_grad()
def sample_trajectory(
    model_output: ModelOutput, sampler: Sampler, initial: Tensor, noise: Tensor | None
) -> Trajectory:
    """Run the sampler from `initial` [B, C, h, w] (the starting noise) with the guided
    `model_output(x, timesteps)`, adding `noise[:, k]` [B, K, C, h, w] times each step's std at
    step k (None: the deterministic sampler, every step its mean); every step's latent and
    log-probability. The steps run in fp32; `model_output` is given the latents as they are
    (`forward.predict` casts them to the denoiser's dtype)."""
    x = initial.float()
    batch = x.shape[0]
    latents, log_probs = [x.cpu()], []
    for k in range(sampler.steps):
        step = torch.full((batch,), k, dtype=torch.long)
        timesteps = sampler.timesteps[step].to(x.device)
        output = model_output(x, timesteps)
        step_noise = None if noise is None else noise[:, k].to(x.device)
        x, log_prob = sampler.step(step, x, output, step_noise)
        x = x.float()
        latents.append(x.cpu())
        log_probs.append(log_prob.float().cpu())
    return Trajectory(torch.stack(latents, dim=1), torch.stack(log_probs, dim=1))


def trained_step_log_probs(
    model_output: ModelOutput, sampler: Sampler, latents: Tensor, steps: Tensor
) -> tuple[Tensor, StepGaussian]:
    """([B, J] log π of each trained step, the steps' Gaussians with mean [B·J, ...]) of
    trajectories `latents` [B, K + 1, ...] at steps `steps` [B, J]: the denoiser runs once on
    all B·J (latent, step) pairs (`model_output` takes rows in that order: sample b's J steps
    together), as the rollout's steps ran but with the current weights and gradients."""
    batch, chosen = steps.shape
    rows = torch.arange(batch).repeat_interleave(chosen)
    flat = steps.reshape(-1).cpu()
    before = latents[rows, flat]
    after = latents[rows, flat + 1]
    output = model_output(before, sampler.timesteps[flat].to(before.device))
    gaussian = sampler.gaussian(flat, before, output)
    return step_log_prob(after.to(gaussian.mean), gaussian).reshape(batch, chosen), gaussian
