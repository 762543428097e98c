"""The diffusion forward pass (`forward_diffusion.py`) on the tiny random pipelines of every
kind, against the same computation written out by hand with diffusers' own scheduler and
denoiser call: the same denoiser, noise and timesteps give the same per-sample losses. Also the
seeded draws (a sample's noise and noise level depend on its seed alone, so a batch split over
ranks draws what one rank draws) and that gradients reach the denoiser."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from align_anything import losses
from align_anything.families import diffusion
from align_anything.families.diffusion import forward as fd

# One DDPM-style and one flow kind in the fast suite; the other three take the CPU more than
# the ~2 s a fast test may (a first forward pass of each new batch shape builds its kernels).
PIPELINES = [
    "tiny-random-sd",
    "tiny-random-sd3",
    pytest.param("tiny-random-sd-v", marks=pytest.mark.slow),
    pytest.param("tiny-random-sdxl", marks=pytest.mark.slow),
    pytest.param("tiny-random-flux", marks=pytest.mark.slow),
]
CAPTIONS = ["a red circle", "a blue square on green"]


class Setup:
    def __init__(self, name: str) -> None:
        self.info = diffusion.inspect_pipeline(name)
        self.parts = diffusion.load_frozen_parts(self.info, dtype=torch.float32)
        self.denoiser = diffusion.load_denoiser(self.info, dtype=torch.float32)
        torch.manual_seed(0)
        pixels = torch.rand(len(CAPTIONS), 3, 32, 32) * 2 - 1
        self.batch = {"latents": self.parts.encode_images(pixels),
                      **self.parts.encode_prompts(CAPTIONS)}  # fmt: skip
        # SDXL: original 48×40 (h×w), cropped at (8, 0) in the resized image, target 32×32
        self.batch["add_time_ids"] = torch.tensor([[48.0, 40.0, 8.0, 0.0, 32.0, 32.0]] * 2)
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
    """Per-sample losses as diffusers' training scripts write them, from the draw's tensors."""
    latents, embeds = s.batch["latents"], s.batch["prompt_embeds"]
    noise, timesteps = s.draw.noise, s.draw.timesteps
    kind, scheduler = s.info.kind, s.scheduler
    with torch.no_grad():
        if kind in ("sd", "sdxl"):
            noisy = scheduler.add_noise(latents, noise, timesteps)
            kwargs = {}
            if kind == "sdxl":
                kwargs["added_cond_kwargs"] = {
                    "text_embeds": s.batch["pooled_prompt_embeds"],
                    "time_ids": s.batch["add_time_ids"],
                }
            prediction = s.denoiser(noisy, timesteps, encoder_hidden_states=embeds, **kwargs).sample
            target = (
                noise
                if s.info.prediction == "epsilon"
                else scheduler.get_velocity(latents, noise, timesteps)
            )
        else:
            sigmas = s.draw.sigmas.reshape(-1, 1, 1, 1)
            noisy = (1.0 - sigmas) * latents + sigmas * noise
            target = noise - latents
            pooled = s.batch["pooled_prompt_embeds"]
            if kind == "sd3":
                prediction = s.denoiser(
                    hidden_states=noisy, timestep=timesteps, encoder_hidden_states=embeds,
                    pooled_projections=pooled,
                ).sample  # fmt: skip
            else:
                from diffusers import FluxPipeline

                b, c, h, w = noisy.shape
                packed = FluxPipeline._pack_latents(noisy, b, c, h, w)
                image_ids = FluxPipeline._prepare_latent_image_ids(
                    b, h // 2, w // 2, "cpu", torch.float32
                )
                text_ids = torch.zeros(embeds.shape[1], 3)
                out = s.denoiser(
                    hidden_states=packed, timestep=timesteps / 1000,
                    guidance=torch.full((b,), 3.5), pooled_projections=pooled,
                    encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=image_ids,
                ).sample  # fmt: skip
                prediction = FluxPipeline._unpack_latents(out, h * 2, w * 2, 2)
    losses_ = F.mse_loss(prediction.float(), target.float(), reduction="none")
    return losses_.mean(dim=list(range(1, losses_.dim())))


def test_denoising_mse_equals_diffusers_by_hand(setup: Setup) -> None:
    ours = fd.denoising_mse(setup.denoiser, setup.info, setup.scheduler, setup.batch, setup.draw)
    expected = _by_hand(setup)
    torch.testing.assert_close(ours.detach(), expected, rtol=1e-5, atol=1e-6)
    assert expected.min() > 0.01  # a real comparison: random weights are far from the target


def test_draws_follow_the_documented_protocol(setup: Setup) -> None:
    # Each sample: a generator seeded by its seed draws the noise, then the noise level.
    shape = tuple(setup.batch["latents"].shape[1:])
    steps = setup.scheduler.config.num_train_timesteps
    for k, seed in enumerate(setup.seeds):
        generator = torch.Generator().manual_seed(seed)
        assert torch.equal(setup.draw.noise[k], torch.randn(shape, generator=generator))
        if not setup.info.flow:
            expected_t = torch.randint(0, steps, (1,), generator=generator)
            assert setup.draw.timesteps[k] == expected_t
            continue
        # logit-normal (mean 0, std 1): u = sigmoid(N(0, 1)), index ⌊u·N⌋ into the tables
        u = torch.sigmoid(torch.normal(0.0, 1.0, size=(1,), generator=generator))
        index = int(u.item() * steps)
        assert setup.draw.timesteps[k] == setup.scheduler.timesteps[index]
        assert setup.draw.sigmas[k] == setup.scheduler.sigmas[index]
        assert 0 < setup.draw.sigmas[k] < 1


def test_a_sample_does_not_depend_on_its_batch(setup: Setup) -> None:
    # The batch split over two "ranks" (row 0 and row 1) draws and computes what one does.
    shape = setup.batch["latents"].shape[1:]
    first = fd.draw_noise(setup.info, setup.scheduler, shape, setup.seeds[:1])
    second = fd.draw_noise(setup.info, setup.scheduler, shape, setup.seeds[1:])
    assert torch.equal(torch.cat([first.noise, second.noise]), setup.draw.noise)
    assert torch.equal(torch.cat([first.timesteps, second.timesteps]), setup.draw.timesteps)
    halves = [
        {k: v[:1] for k, v in setup.batch.items()},
        {k: v[1:] for k, v in setup.batch.items()},
    ]
    split = torch.cat([
        fd.denoising_mse(setup.denoiser, setup.info, setup.scheduler, half, draw)
        for half, draw in zip(halves, (first, second), strict=True)
    ])  # fmt: skip
    whole = fd.denoising_mse(setup.denoiser, setup.info, setup.scheduler, setup.batch, setup.draw)
    torch.testing.assert_close(split.detach(), whole.detach(), rtol=1e-5, atol=1e-7)


def test_pairs_share_noise_and_timestep(setup: Setup) -> None:
    # Chosen = rejected images: the same draw gives the same MSE, so DPO's logits are 0 and its
    # sigmoid loss is ln 2 at the start, with policy = reference.
    chosen, rejected = fd.paired_denoising_mse(
        setup.denoiser, setup.info, setup.scheduler, setup.batch, setup.batch, setup.draw
    )
    torch.testing.assert_close(chosen, rejected, rtol=1e-5, atol=1e-7)
    out = losses.diffusion_dpo_loss(
        chosen, rejected, chosen.detach(), rejected.detach(), beta=1000.0
    )
    assert out.losses.mean().item() == pytest.approx(0.6931, abs=1e-2)


# One UNet and one transformer kind: the backward pass is the slow part on a CPU.
@pytest.mark.parametrize("name", ["tiny-random-sd", "tiny-random-sd3"])
def test_gradients_reach_the_denoiser(name: str) -> None:
    setup = _setup(name)
    denoiser = setup.denoiser
    denoiser.zero_grad()
    fd.denoising_mse(
        denoiser, setup.info, setup.scheduler, setup.batch, setup.draw
    ).mean().backward()
    grads = [p.grad for p in denoiser.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0
    denoiser.zero_grad()


def test_draw_seed_is_deterministic_and_well_mixed() -> None:
    seeds = {fd.draw_seed(0, step, row) for step in range(4) for row in range(4)}
    assert len(seeds) == 16  # neighbouring steps and rows get different streams
    assert fd.draw_seed(0, 1, 2) == fd.draw_seed(0, 1, 2)
    assert all(0 <= s < 2**63 for s in seeds)


def test_signal_to_noise_matches_alphas() -> None:
    info = diffusion.inspect_pipeline("tiny-random-sd")
    scheduler = diffusion.training_scheduler(info)
    draw = fd.NoiseDraw(torch.zeros(2, 4, 16, 16), torch.tensor([0, 999]), None)
    alpha_bar = scheduler.alphas_cumprod[torch.tensor([0, 999])]
    expected = alpha_bar / (1 - alpha_bar)  # SNR = α_t² / σ_t² with α_t² = ᾱ, σ_t² = 1 − ᾱ
    torch.testing.assert_close(fd.signal_to_noise(info, scheduler, draw), expected)
    with pytest.raises(ValueError, match="DDPM"):
        fd.signal_to_noise(diffusion.inspect_pipeline("tiny-random-sd3"), scheduler, draw)


def test_timestep_scheme_is_checked() -> None:
    with pytest.raises(ValueError, match="uniform, logit_normal, mode"):
        fd.TimestepSampling(scheme="cosmap")


def test_uniform_flow_sampling() -> None:
    info = diffusion.inspect_pipeline("tiny-random-sd3")
    scheduler = diffusion.training_scheduler(info)
    seeds = list(range(200))
    draw = fd.draw_noise(info, scheduler, (4, 2, 2), seeds, sampling=fd.TimestepSampling("uniform"))
    # uniform u: the indices ⌊u·1000⌋ cover the table evenly; SD3's shift 3 table puts more
    # than half its σ above 0.5 (σ_shifted = 3σ / (1 + 2σ) > 0.5 for σ > 0.25)
    assert (draw.sigmas > 0.5).float().mean() > 0.6


def test_a_bf16_denoiser_takes_the_cast_batch() -> None:
    # The cache keeps the encoders' fp32; a bf16 engine gets the batch cast by `batch_to`.
    setup = _setup("tiny-random-sd3")
    info = setup.info
    denoiser = diffusion.load_denoiser(info, dtype=torch.bfloat16)
    batch = fd.batch_to(setup.batch, "cpu", torch.bfloat16)
    assert {v.dtype for v in batch.values()} == {torch.bfloat16}
    mse = fd.denoising_mse(denoiser, info, setup.scheduler, batch, setup.draw)
    assert mse.dtype == torch.float32  # compared in fp32
    whole = fd.denoising_mse(setup.denoiser, info, setup.scheduler, setup.batch, setup.draw)
    torch.testing.assert_close(mse.detach(), whole.detach(), rtol=0.05, atol=0.05)
