"""Online RL of text-to-image pipelines, the fast parts (tests/test_image_rl_runs.py runs the
tasks end to end):

- the samplers with log-probabilities (`families.diffusion.sde`): each step's mean, standard
  deviation and log-density against the Gaussian written out by hand, for the flow SDE of
  Flow-GRPO and for DDIM with eta; with no noise they are diffusers' own samplers (the
  pipelines' latents for the same seeds); a sampler that cannot give a log-probability is
  refused before any compute;
- the losses (`losses.diffusion_rl`): the Gaussian log-density and KL, the clipped ratio per
  step (ratio exactly 1 and no clip on a round's first step), capped group advantages,
  DiffusionNFT's optimality and loss, against hand-derived numbers.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

from align_anything.families import diffusion
from align_anything.families.diffusion import sde
from align_anything.losses import diffusion_rl as rl

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def density(x: float, mean: float, std: float) -> float:
    """log N(x; mean, std²) of one element, written out."""
    return -((x - mean) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI


# ---------------------------------------------------------------------------- the losses


def test_gaussian_log_prob_is_the_element_mean_of_the_density_by_hand() -> None:
    sample = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    mean = torch.tensor([[0.5, 2.0], [0.25, 0.0]])
    std = torch.tensor([0.5, 2.0])
    got = rl.gaussian_log_prob(sample, mean, std)
    expected = [
        (density(1.0, 0.5, 0.5) + density(2.0, 2.0, 0.5)) / 2,
        (density(0.0, 0.25, 2.0) + density(-1.0, 0.0, 2.0)) / 2,
    ]
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    assert expected[0] == pytest.approx((-0.5 + math.log(2) - LOG_SQRT_2PI - math.log(0.5)
                                         - LOG_SQRT_2PI) / 2, abs=1e-12)  # fmt: skip
    with pytest.raises(ValueError, match="no density"):
        rl.gaussian_log_prob(sample, mean, torch.tensor([0.5, 0.0]))


def test_gaussian_kl_by_hand() -> None:
    mean = torch.tensor([[1.0, 3.0]])
    ref = torch.tensor([[0.0, 3.0]])
    # (1 - 0)² / (2·2²) = 1/8 for the first element, 0 for the second: mean 1/16
    assert rl.gaussian_kl(mean, ref, torch.tensor([2.0])).tolist() == [pytest.approx(0.0625)]
    assert rl.gaussian_kl(mean, mean, 0.3).tolist() == [0.0]


def test_a_rounds_first_step_has_ratio_exactly_one_and_no_clip() -> None:
    torch.manual_seed(0)
    logps = torch.randn(3, 4, requires_grad=True)
    advantages = torch.tensor([1.0, -2.0, 0.5])
    out = rl.step_policy_loss(
        logps, logps.detach(), advantages, epsilon_low=1e-4, epsilon_high=1e-4
    )
    assert torch.equal(out.ratio, torch.ones(3, 4))
    assert out.clip.is_region_clipped.sum().item() == 0
    assert torch.equal(out.loss.detach(), -advantages[:, None].expand(3, 4))
    out.loss.mean().backward()
    # the gradient of -A·exp(logp - sg(logp)) is -A, per element of the mean over 12
    assert torch.allclose(logps.grad, -advantages[:, None].expand(3, 4) / 12)


def test_the_clipped_ratio_and_kl_by_hand() -> None:
    old = torch.zeros(2, 2)
    logps = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), math.log(1.1)]])
    advantages = torch.tensor([1.0, -1.0])
    kl = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    out = rl.step_policy_loss(
        logps, old, advantages, epsilon_low=0.2, epsilon_high=0.2, kl=kl, beta=0.5
    )
    # A = +1: ratio 1.5 -> min(1.5, 1.2) = 1.2, clipped high; ratio 1 -> 1.
    # A = -1: ratio 0.5 -> min(-0.5, -0.8) = -0.8, clipped low; 1.1 -> min(-1.1, -1.1) = -1.1.
    expected = [[-1.2 + 0.05, -1.0 + 0.1], [0.8 + 0.15, 1.1 + 0.2]]
    assert out.loss.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    assert out.clip.is_high_clipped.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert out.clip.is_low_clipped.tolist() == [[0.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match="KL"):
        rl.step_policy_loss(logps, old, advantages, epsilon_low=0.2, epsilon_high=0.2, beta=0.1)


def test_capped_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.25, unbiased std sqrt((0.75² + 3·0.25²)/3) = 0.5; group 2: equal -> 0
    expected = [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0, 0, 0, 0]
    got = rl.capped_group_advantages(rewards, 4, "group", cap=None)
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    capped = rl.capped_group_advantages(rewards, 4, "group", cap=1.0)
    assert capped.tolist() == pytest.approx([1.0, *expected[1:]], abs=1e-6)


def test_nft_optimality_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    r = rl.nft_optimality(rewards, 4, scale_rewards="group", cap=2.0)
    a = 0.75 / 0.5001
    expected = [0.5 + 0.5 * a / 2, *[0.5 - 0.5 * (0.25 / 0.5001) / 2] * 3, 0.5, 0.5, 0.5, 0.5]
    assert r.tolist() == pytest.approx(expected, abs=1e-6)
    assert bool(((r >= 0) & (r <= 1)).all())


def test_nft_loss_by_hand() -> None:
    theta = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5]])
    target = torch.tensor([[0.0, 1.0]])
    loss = rl.nft_loss(theta, old, target, torch.tensor([0.75]), beta=0.5)
    # element 1: v+ = 0.5·0.5 + 0.5·1 = 0.75, v- = 1.5·0.5 - 0.5·1 = 0.25, v = 0
    # element 2: v+ = 0.25, v- = 0.75, v = 1
    positive = (0.75**2 + 0.75**2) / 2
    negative = (0.25**2 + 0.25**2) / 2
    assert loss.tolist() == [pytest.approx(0.75 * positive + 0.25 * negative)]


def test_nft_gradient_at_the_old_policy_is_the_preference_direction() -> None:
    torch.manual_seed(1)
    old = torch.randn(3, 5)
    target = torch.randn(3, 5)
    theta = old.clone().requires_grad_(True)
    r = torch.tensor([0.9, 0.5, 0.2])
    rl.nft_loss(theta, old, target, r, beta=0.7).sum().backward()
    # d/dθ at θ = v_old: 2β(2r - 1)(v_old - v) / D per element
    expected = 2 * 0.7 * (2 * r[:, None] - 1) * (old - target) / 5
    assert torch.allclose(theta.grad, expected, atol=1e-6)
    assert theta.grad[1].abs().max() < 1e-7  # r = ½: no preference, no gradient


# ---------------------------------------------------------------------------- the samplers


def flow_sampler(noise: float = 0.7) -> sde.Sampler:
    sigmas = torch.tensor([1.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    return sde.Sampler("flow_sde", "flow", (sigmas[:-1] * 1000).float(), sigmas, noise)


def test_the_flow_sde_step_by_hand() -> None:
    sampler = flow_sampler()
    x = torch.tensor([[1.0, -0.5]])
    v = torch.tensor([[2.0, 1.0]])
    # step 1: t = 0.5, dt = -0.25, σ_t = 0.7·√(0.5/0.5) = 0.7
    step = sampler.gaussian(torch.tensor([1]), x, v)
    for got, xi, vi in zip(step.mean[0].tolist(), [1.0, -0.5], [2.0, 1.0], strict=True):
        assert got == pytest.approx(xi + (vi + 0.49 / (2 * 0.5) * (xi + 0.5 * vi)) * -0.25)
    assert step.std.tolist() == [pytest.approx(0.7 * math.sqrt(0.25))]
    # step 0 starts at t = 1: the denominator takes 1 - σ_1 = 0.5
    first = sampler.gaussian(torch.tensor([0]), x, v)
    sigma_t = 0.7 * math.sqrt(1 / 0.5)
    assert first.std.tolist() == [pytest.approx(sigma_t * math.sqrt(0.5))]
    assert first.mean[0, 0].item() == pytest.approx(1 + (2 + sigma_t**2 / 2 * 1.0) * -0.5)
    # the last step ends at t = 0: a Gaussian still (std σ_t·√0.25)
    assert sampler.stochastic_steps() == [0, 1, 2]


def test_the_ddim_step_with_eta_by_hand() -> None:
    table = torch.tensor([[0.64, 0.81]], dtype=torch.float64)
    sampler = sde.Sampler("ddim", "epsilon", torch.tensor([500.0]), table, 1.0)
    x, eps = torch.tensor([[1.0]]), torch.tensor([[0.5]])
    step = sampler.gaussian(torch.tensor([0]), x, eps)
    variance = (1 - 0.81) / (1 - 0.64) * (1 - 0.64 / 0.81)
    x0 = (1 - math.sqrt(0.36) * 0.5) / 0.8
    assert step.std.tolist() == [pytest.approx(math.sqrt(variance))]
    assert step.mean.item() == pytest.approx(0.9 * x0 + math.sqrt(1 - 0.81 - variance) * 0.5)
    v_sampler = sde.Sampler("ddim", "v_prediction", torch.tensor([500.0]), table, 0.5)
    v = torch.tensor([[0.5]])
    v_step = v_sampler.gaussian(torch.tensor([0]), x, v)
    x0, eps = 0.8 * 1 - 0.6 * 0.5, 0.8 * 0.5 + 0.6 * 1
    s2 = 0.25 * variance
    assert v_step.mean.item() == pytest.approx(0.9 * x0 + math.sqrt(1 - 0.81 - s2) * eps)


def test_a_sampled_steps_log_prob_is_the_density_of_its_noise() -> None:
    torch.manual_seed(2)
    sampler = flow_sampler()
    x, v, noise = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    following, log_prob = sampler.step(torch.tensor([1, 2]), x, v, noise)
    stds = sampler.stds()[[1, 2]]
    for b in range(2):
        # x' - μ = s·n, so log N(x'; μ, s²) = -n²/2 - log s - ½ log 2π per element
        expected = (-(noise[b] ** 2) / 2).mean() - math.log(stds[b]) - LOG_SQRT_2PI
        assert log_prob[b].item() == pytest.approx(expected.item(), abs=1e-5)
    mean = sampler.gaussian(torch.tensor([1, 2]), x, v).mean
    assert torch.allclose(following, mean + stds.float().reshape(2, 1, 1, 1) * noise)


@functools.cache
def pipeline(name: str) -> tuple:
    info = diffusion.inspect_pipeline(name)
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    denoiser = diffusion.load_denoiser(info, dtype=torch.float32).eval()
    return info, parts, denoiser


@pytest.mark.parametrize("name", ["tiny-random-sd", "tiny-random-sd3"])
@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_without_noise_the_samplers_are_the_pipelines_own(name: str, guidance: float) -> None:
    """DDIM with eta = 0 and the flow SDE with a = 0 give the latents of the kind's diffusers
    pipeline for the same prompts, seeds and guidance (its DDIM / Euler sampler)."""
    info, parts, denoiser = pipeline(name)
    prompts, seeds, steps = ["a red circle", "blue"], [3, 11], 3
    shape = (info.latent_channels, 16, 16)
    sampler = sde.build_sampler(info, steps=steps, noise=0.0, latent_shape=shape,
                                needs_log_probs=False)  # fmt: skip
    conditioning = parts.encode_prompts(prompts)
    unconditional = sde.unconditional_embeddings(parts, len(prompts))

    def output(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return sde.guided_prediction(denoiser, info, x, t, conditioning, unconditional,
                                     guidance_scale=guidance)  # fmt: skip

    initial = sde.draw_normal(seeds, shape)[:, 0]
    ours = sde.sample_trajectory(output, sampler, initial, None)
    assert torch.isnan(ours.log_probs).all()
    pipe = parts.pipeline(denoiser)
    if info.kind == "sd":
        from diffusers import DDIMScheduler

        pipe.scheduler = DDIMScheduler.from_config(info.scheduler_config)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    length = {"max_sequence_length": parts.max_sequence_length} if info.flow else {}
    theirs = pipe(prompt=prompts, generator=generators, height=32, width=32,
                  num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                  **length).images  # fmt: skip
    torch.testing.assert_close(ours.final, theirs.float(), rtol=1e-4, atol=1e-5)


def test_a_noisy_ddim_step_is_diffusers_step_with_that_noise() -> None:
    from diffusers import DDIMScheduler

    info, _, _ = pipeline("tiny-random-sd")
    sampler = sde.build_sampler(info, steps=4, noise=0.8, latent_shape=(4, 16, 16),
                                needs_log_probs=True)  # fmt: skip
    scheduler = DDIMScheduler.from_config(info.scheduler_config)
    scheduler.set_timesteps(4)
    torch.manual_seed(4)
    x, eps, noise = torch.randn(1, 4, 16, 16), torch.randn(1, 4, 16, 16), torch.randn(1, 4, 16, 16)
    for k, t in enumerate(scheduler.timesteps.tolist()):
        ours, _ = sampler.step(torch.tensor([k]), x, eps, noise)
        theirs = scheduler.step(eps, t, x, eta=0.8, variance_noise=noise).prev_sample
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_sampler_without_a_density_is_refused_before_any_compute() -> None:
    info, _, _ = pipeline("tiny-random-sd")
    with pytest.raises(sde.SamplerError, match=r"dance_grpo.eta.*deterministic.*eta") as err:
        sde.build_sampler(info, steps=4, noise=0.0, latent_shape=(4, 16, 16),
                          needs_log_probs=True, what="dance_grpo.eta=0")  # fmt: skip
    assert "epsilon" in str(err.value)


def test_recomputed_step_log_probs_equal_the_rollouts() -> None:
    """The log-probs of chosen steps, recomputed in one denoiser pass over (latent, step) pairs,
    are those the rollout measured step by step (the same weights)."""
    info, parts, denoiser = pipeline("tiny-random-sd3")
    shape = (info.latent_channels, 16, 16)
    sampler = sde.build_sampler(info, steps=3, noise=0.7, latent_shape=shape,
                                needs_log_probs=True)  # fmt: skip
    conditioning = parts.encode_prompts(["a", "b"])

    def output(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        rows = {k: v.repeat_interleave(x.shape[0] // 2, dim=0) for k, v in conditioning.items()}
        return sde.guided_prediction(denoiser, info, x, t, rows, None, guidance_scale=1.0)

    initial = sde.draw_normal([1, 2], shape)[:, 0]
    noise = sde.draw_normal([5, 6], shape, count=3)
    rollout = sde.sample_trajectory(output, sampler, initial, noise)
    steps = torch.tensor([[2, 0], [1, 2]])
    with torch.no_grad():
        again, _ = sde.trained_step_log_probs(output, sampler, rollout.latents, steps)
    expected = torch.stack([rollout.log_probs[0, [2, 0]], rollout.log_probs[1, [1, 2]]])
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- rewards of images


def shape(colour: str, name: str = "circle") -> Any:
    from align_anything.families.text_to_image import shapes

    return shapes.draw_shape(name, colour, side=16, centre=(16.0, 16.0))


def test_shape_colour_is_the_pixel_rule_of_the_colour_check() -> None:
    from align_anything.rewards import shape_colour

    images = [shape("red"), shape("blue", "square"), shape("green"), shape("red")]
    prompts = ["a red circle", "a red square", "a green circle", "a circle"]
    assert shape_colour(prompts=prompts, images=images) == [1.0, 0.0, 1.0, None]


def test_image_rewards_share_the_text_path(tmp_path) -> None:  # noqa: ANN001
    """Images go through `score_completions` as completions do: the keyword `images`, the
    fields, weights, None, and one message naming the function, the row and the image."""
    from align_anything.rewards.functions import RewardError, score_completions

    seen = {}

    def brightness(prompts: list, images: list, level: list, **kwargs) -> list:  # noqa: ANN003
        seen.update(prompts=prompts, images=images, level=level, kwargs=kwargs)
        return [None if lv is None else float(im.getpixel((16, 16))[0] > 100) * lv
                for im, lv in zip(images, level, strict=True)]  # fmt: skip

    def constant(prompts: list, images: list, **kwargs) -> list:  # noqa: ANN003
        return [0.5] * len(images)

    images = [shape("red"), shape("blue"), shape("red")]
    total, per = score_completions(
        [("brightness", brightness), ("constant", constant)], [2.0, 1.0],
        prompts=["a red circle", "a blue circle", "a red circle"], images=images,
        fields={"level": [1.0, 1.0, None]}, row_ids=["line 1", "line 2", "line 3"],
    )  # fmt: skip
    assert seen["images"] == images and seen["kwargs"] == {} and seen["level"] == [1.0, 1.0, None]
    assert all(image.mode == "RGB" for image in seen["images"])
    assert total.tolist() == [2.5, 0.5, 0.5]  # red pixel x2 + 0.5; none; None + 0.5
    assert math.isnan(per["brightness"][2].item())

    def short(prompts: list, images: list, **kwargs) -> list:  # noqa: ANN003
        return [1.0]

    with pytest.raises(RewardError) as err:
        score_completions([("short", short)], [1.0], prompts=["a", "b"], images=images[:2],
                          fields={}, row_ids=["line 7", "line 8"])  # fmt: skip
    message = str(err.value)
    assert "'short' on line 7 (image 32x32)" in message
    assert "returned 1 values for 2 images; return one float (or None) per image" in message
    with pytest.raises(ValueError, match="exactly one"):
        score_completions([("c", constant)], [1.0], prompts=["a"], images=images[:1],
                          completions=["x"], fields={}, row_ids=[0])  # fmt: skip


def test_a_remote_reward_gets_images_as_base64_png() -> None:
    import base64
    import io
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np
    from PIL import Image

    from align_anything.rewards.remote import RemoteReward

    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            decoded = [Image.open(io.BytesIO(base64.b64decode(e))) for e in body["images"]]
            rewards = [float(np.asarray(im)[16, 16, 2]) for im in decoded]  # the blue channel
            data = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        reward = RemoteReward(f"http://127.0.0.1:{server.server_port}/score", timeout_s=10,
                              retries=0, backoff_s=0, max_rows=2)  # fmt: skip
        images = [shape("red"), shape("blue"), shape("cyan")]
        got = reward(prompts=["a", "b", "c"], images=images, tag=[1, 2, 3])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    expected = [float(np.asarray(im)[16, 16, 2]) for im in images]
    assert got == expected and expected[1] > 100 > expected[0]
    assert [len(b["images"]) for b in bodies] == [2, 1]  # max_rows per request
    assert bodies[0]["prompts"] == ["a", "b"] and bodies[1]["tag"] == [3]
    assert "completions" not in bodies[0]
    sent = Image.open(io.BytesIO(base64.b64decode(bodies[0]["images"][1])))
    assert np.array_equal(np.asarray(sent), np.asarray(images[1]))  # lossless


# ---------------------------------------------------------------------------- bad input


@pytest.fixture
def prompts_file(tmp_path):  # noqa: ANN001, ANN201
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": "a red circle", "tag": {i}}}\n' for i in range(4)))
    return path


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["task=dance_grpo", "model.name_or_path=tiny-random-sd", "dance_grpo.eta=0"],
            "dance_grpo.eta=0: the ddim sampler of tiny-random-sd (sd, epsilon) with noise 0 is "
            "deterministic at every one of its 3 steps, so no step has a log-probability to train "
            "on: set eta",
        ),
        (
            ["task=flow_grpo", "model.name_or_path=tiny-random-sd"],
            "task=flow_grpo samples with the flow SDE of flow-matching pipelines (sd3, flux), but "
            "tiny-random-sd is a sd pipeline (epsilon prediction): use task=dance_grpo",
        ),
        (
            ["task=flow_grpo", "model.name_or_path=tiny-random-sd3", "flow_grpo.num_generations=1"],
            "flow_grpo.num_generations",
        ),
        (
            ["task=diffusion_nft", "model.name_or_path=tiny-random-sd3", "reward.model=tests"],
            "reward.model='tests' is a reward model trained by task=rm, "
            "which scores text; task=diffusion_nft scores images",
        ),
    ],
    ids=["eta-0", "flow-on-sd", "one-generation", "text-reward-model"],
)
def test_bad_input_is_one_message_before_any_compute(
    prompts_file,
    tmp_path,
    capsys,
    args: list[str],
    expected: str,  # noqa: ANN001
) -> None:
    from align_anything.train import main

    task = args[0].split("=")[1]
    status = main([*args, f"data.path={prompts_file}", f"data.eval_path={prompts_file}",
                   f"{task}.rollout_steps=3", "deepspeed=z0", "train.precision=fp32",
                   f"output_dir={tmp_path / 'out'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2, err
    # (a library's logging warning of an earlier test may precede it on the captured stream)
    assert f"error: {expected}" in err or "error: 1 problem in the configuration" in err, err
    assert expected in err and err.count("error:") == 1, err
    assert (
        not (tmp_path / "out" / "metrics.jsonl").exists()
        or "loss" not in (tmp_path / "out" / "metrics.jsonl").read_text()
    )
