"""The video kinds' forward pass against diffusers by hand: the tiny UNet-3D (ModelScope) and
Wan pipelines, the same denoiser, noise and timesteps give the per-sample losses written out
as diffusers' pipelines and training scripts compute them; the latents and prompt embeddings
are what the kind's own pipeline would feed its denoiser; LoRA on the UNet-3D (no diffusers
adapter mixin) switches off and merges exactly; the planner counts frames; and the settings a
video kind cannot take are refused."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from align_anything import losses
from align_anything.families import diffusion
from align_anything.families.diffusion import forward as fd
from align_anything.families.diffusion.adapters import (
    adapters_disabled,
    add_denoiser_adapters,
    merge_adapters,
)

PIPELINES = [
    "tiny-random-t2v-unet3d",
    "tiny-random-wan",
    pytest.param("tiny-random-t2v-unet3d-v", marks=pytest.mark.slow),
]
CAPTIONS = ["a red circle moving left", "a blue square moving up"]


class Setup:
    def __init__(self, name: str) -> None:
        self.info = diffusion.inspect_pipeline(name)
        self.parts = diffusion.load_frozen_parts(self.info, dtype=torch.float32)
        self.denoiser = diffusion.load_denoiser(self.info, dtype=torch.float32)
        frames = 9 if self.info.kind == "wan" else 8
        torch.manual_seed(0)
        self.pixels = torch.rand(len(CAPTIONS), 3, frames, 32, 32) * 2 - 1
        self.batch = {"latents": self.parts.encode_videos(self.pixels),
                      **self.parts.encode_prompts(CAPTIONS)}  # fmt: skip
        self.scheduler = self.parts.noise_scheduler
        self.seeds = [fd.draw_seed(7, 3, row) for row in range(len(CAPTIONS))]
        self.draw = fd.draw_noise(
            self.info, self.scheduler, self.batch["latents"].shape[1:], self.seeds
        )


@functools.cache
def _setup(name: str) -> Setup:
    return Setup(name)


@pytest.fixture(params=PIPELINES)
def setup(request: pytest.FixtureRequest) -> Setup:
    return _setup(request.param)


def _by_hand(s: Setup) -> torch.Tensor:
    latents, embeds = s.batch["latents"], s.batch["prompt_embeds"]
    noise, timesteps = s.draw.noise, s.draw.timesteps
    with torch.no_grad():
        if s.info.kind == "unet3d":
            noisy = s.scheduler.add_noise(latents, noise, timesteps)
            prediction = s.denoiser(noisy, timesteps, encoder_hidden_states=embeds).sample
            target = (noise if s.info.prediction == "epsilon"
                      else s.scheduler.get_velocity(latents, noise, timesteps))  # fmt: skip
        else:  # Wan: flow matching, the transformer given σ·1000 as WanPipeline gives it
            sigmas = s.draw.sigmas.reshape(-1, 1, 1, 1, 1)
            noisy = (1.0 - sigmas) * latents + sigmas * noise
            target = noise - latents
            prediction = s.denoiser(
                hidden_states=noisy, timestep=sigmas.flatten() * 1000,
                encoder_hidden_states=embeds,
            ).sample  # fmt: skip
    per_element = F.mse_loss(prediction.float(), target.float(), reduction="none")
    return per_element.mean(dim=list(range(1, per_element.dim())))


def test_video_losses_equal_diffusers_by_hand(setup: Setup) -> None:
    assert setup.batch["latents"].dim() == 5
    ours = fd.denoising_mse(setup.denoiser, setup.info, setup.scheduler, setup.batch, setup.draw)
    expected = _by_hand(setup)
    torch.testing.assert_close(ours.detach(), expected, rtol=1e-5, atol=1e-6)
    assert expected.min() > 0.01


def test_latents_and_prompts_are_what_the_pipeline_feeds_its_denoiser(setup: Setup) -> None:
    info, parts = setup.info, setup.parts
    pipe = parts.pipeline(setup.denoiser)
    latents = setup.batch["latents"]
    with torch.no_grad():
        if info.kind == "unet3d":
            # per frame through the 2-D VAE, times scaling_factor (the pipeline's decode_latents
            # divides by it and folds the frames the same way)
            b, c, f, h, w = setup.pixels.shape
            flat = setup.pixels.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
            mean = parts.vae.encode(flat).latent_dist.mean * info.scaling_factor
            expected = mean.reshape(b, f, *mean.shape[1:]).permute(0, 2, 1, 3, 4)
            embeds = pipe.encode_prompt(CAPTIONS, "cpu", 1, False)[0]
            assert latents.shape[2] == f
        else:
            # WanPipeline decodes latents / (1 / latents_std) + latents_mean: we encode inversely
            mean = parts.vae.encode(setup.pixels).latent_dist.mean
            std = torch.tensor(parts.vae.config.latents_std).view(1, -1, 1, 1, 1)
            offset = torch.tensor(parts.vae.config.latents_mean).view(1, -1, 1, 1, 1)
            expected = (mean - offset) / std
            embeds = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                        max_sequence_length=parts.max_sequence_length)[0]  # fmt: skip
            assert latents.shape[2] == info.latent_frames(9) == 3
    torch.testing.assert_close(latents, expected)
    torch.testing.assert_close(setup.batch["prompt_embeds"], embeds)


def test_wan_trains_at_its_samplers_flow_shift() -> None:
    info = _setup("tiny-random-wan").info
    assert info.scheduler_config["_class_name"] == "UniPCMultistepScheduler"
    scheduler = diffusion.training_scheduler(info)
    assert type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert scheduler.config.shift == info.scheduler_config["flow_shift"] == 3.0
    # the shifted table: σ' = 3σ / (1 + 2σ)
    sigma = torch.linspace(1.0, 1 / 1000, 1000)[500]
    assert float(scheduler.sigmas[500]) == pytest.approx(float(3 * sigma / (1 + 2 * sigma)), 1e-5)


def test_pairs_share_noise_and_start_at_ln2(setup: Setup) -> None:
    chosen, rejected = fd.paired_denoising_mse(
        setup.denoiser, setup.info, setup.scheduler, setup.batch, setup.batch, setup.draw
    )
    torch.testing.assert_close(chosen, rejected, rtol=1e-5, atol=1e-7)
    out = losses.diffusion_dpo_loss(chosen, rejected, chosen.detach(), rejected.detach(), beta=1e3)
    assert out.losses.mean().item() == pytest.approx(0.6931, abs=1e-2)


@pytest.mark.slow  # a new model's first passes: ~10 s on a busy CPU
def test_unet3d_lora_switches_off_and_merges_exactly() -> None:
    s = _setup("tiny-random-t2v-unet3d")
    info = s.info
    denoiser = diffusion.load_denoiser(info, dtype=torch.float32)
    assert not hasattr(denoiser, "add_adapter")  # no diffusers adapter mixin: PEFT's layers
    add_denoiser_adapters(denoiser, kind=info.kind, r=4, alpha=8, dropout=0.0)
    trainable = [n for n, p in denoiser.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)
    state = {k: v.clone() for k, v in denoiser.state_dict().items()}
    for key, value in state.items():
        if "lora_B" in key:
            value.copy_(torch.randn_like(value, generator=torch.Generator().manual_seed(1)))
    denoiser.load_state_dict(state)
    base = fd.denoising_mse(s.denoiser, info, s.scheduler, s.batch, s.draw).detach()
    with torch.no_grad():
        adapted = fd.denoising_mse(denoiser, info, s.scheduler, s.batch, s.draw)
        with adapters_disabled(denoiser):
            disabled = fd.denoising_mse(denoiser, info, s.scheduler, s.batch, s.draw)
        assert not torch.allclose(adapted, base)
        torch.testing.assert_close(disabled, base)
        merged = merge_adapters(denoiser)
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(fd.denoising_mse(merged, info, s.scheduler, s.batch, s.draw),
                                   adapted, rtol=1e-5, atol=1e-6)  # fmt: skip


def test_the_planner_counts_frames() -> None:
    from align_anything.families.diffusion.memory import denoiser_activations

    info = diffusion.inspect_pipeline("tiny-random-t2v-unet3d")
    common = dict(resolution=32, samples=2, precision="fp32", gradient_checkpointing=False)
    eight, sixteen = (denoiser_activations(info, frames=f, **common) for f in (8, 16))
    assert 1.9 < sixteen / eight < 2.1  # every activation has a frame axis
    wan = diffusion.inspect_pipeline("tiny-random-wan")  # attention called with keywords
    three, six = (denoiser_activations(wan, frames=f, **common) for f in (3, 6))
    assert 1.4 < six / three < 2.1  # the text tokens' share does not grow


def test_settings_a_video_kind_cannot_take_are_refused() -> None:
    from align_anything.config import load_config
    from align_anything.errors import ConfigError
    from align_anything.families.diffusion.family import check_model_settings
    from align_anything.families.text_to_video.media import configure

    wan = diffusion.inspect_pipeline("tiny-random-wan")
    cfg = load_config(["task=diffusion_dpo", "model.name_or_path=tiny-random-wan",
                       "data.num_frames=8"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"4k\+1 frames; e.g. data.num_frames=5 or 9"):
        configure(cfg, wan)
    unet3d = diffusion.inspect_pipeline("tiny-random-t2v-unet3d")
    cfg = load_config(["task=diffusion_sft", "model.name_or_path=tiny-random-t2v-unet3d",
                       "speed.gradient_checkpointing=true"])  # fmt: skip
    with pytest.raises(ConfigError, match="UNet3DConditionModel does not support gradient"):
        check_model_settings(cfg, unet3d)
    cfg = load_config(["task=diffusion_sft", "model.name_or_path=tiny-random-sd",
                       "data.num_frames=8"])  # fmt: skip
    with pytest.raises(ConfigError, match="makes images: leave them null"):
        check_model_settings(cfg, diffusion.inspect_pipeline("tiny-random-sd"))
