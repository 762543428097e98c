"""Online RL of a flow-matching text-to-image model (DiffusionNFT, Flow-GRPO) in a plain
PyTorch + diffusers loop.

    python benchmarks/image_rl_plain.py                           # DiffusionNFT, 20 steps
    python benchmarks/image_rl_plain.py --algorithm flow_grpo --kl-beta 0.04 --out result.json

The floor of `benchmarks/image_rl.py`: the same work as the framework's `task=diffusion_nft`
and `task=flow_grpo`, written from the papers' maths with diffusers' `SD3Transformer2DModel`,
`AutoencoderKL`, `FlowMatchEulerDiscreteScheduler` and `StableDiffusion3Pipeline.encode_prompt`
called directly, nothing of align_anything's samplers, losses or engine in between. On the
built-in flow-matching model `tiny-t2i-shapes-flow` and the built-in captions `t2i-shapes`:

- a round: G images per prompt, each from its own seeded noise, sampled with the scheduler's
  K noise levels σ_0 = 1 > … > σ_K = 0 (`set_timesteps(K)`), decoded by the VAE (latents /
  `scaling_factor` + `shift_factor`), scored by the shapes world's pixel rule (1.0 when the
  image's dominant colour is the one its caption names); group-relative advantages
  A = (R − mean_g) / (std_g + 1e-4) with the unbiased group std (TRL's convention, the one
  the framework documents; Flow-GRPO's code divides by numpy's N-divisor std), clipped to ±5;
- **DiffusionNFT** (Zheng et al. 2025, arXiv:2509.16117): the round sampled by the old policy
  with the Euler ODE x ← x + v·(σ_{k+1} − σ_k); r = ½ + ½·A/5; each step noises every image
  afresh, x_t = (1 − σ)·x₀ + σ·ε, target v = ε − x₀ (σ at a uniform index of the training
  scheduler's 1000 levels), and trains eq. 8, r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖² with
  v⁺ = (1 − β)·v_old + β·v_θ and v⁻ = (1 + β)·v_old − β·v_θ (squared norms as element means,
  the mean over images); the old policy is a separate copy of the transformer, moved after
  every optimizer step to old ← η·old + (1 − η)·θ;
- **Flow-GRPO** (Liu et al. 2025, arXiv:2505.05470, eq. 8-9 and its sampler): each step
  x_{k+1} = μ + s_k·ε with σ_t = a·√(σ_k / (1 − σ_k)) (at σ_k = 1 the denominator takes σ_1),
  dt = σ_{k+1} − σ_k,
      μ = x·(1 + σ_t²·dt/(2σ_k)) + v·(1 + σ_t²·(1 − σ_k)/(2σ_k))·dt,   s_k = σ_t·√(−dt),
  and log π(x_{k+1} | x_k) the Gaussian density averaged over the latent's elements. The loss
  per image and trained step, −min(ρ·A, clip(ρ, 1 − ε, 1 + ε)·A) + β·‖μ_θ − μ_ref‖²/(2 s_k²)
  (the KL as an element mean, the reference a frozen copy of the base transformer), ρ =
  exp(log π_θ − log π_old), π_old the rollout's log-probs (one step per round: ρ = 1, the
  log-probs detached); the mean over trained steps, then over images. The trained steps'
  log-probs are recomputed in one pass of B·J rows.

Only the transformer trains (torch AdamW, clipping at 1.0); the VAE and text encoders stay
frozen. Standing alone, it picks each round's prompts by a seeded permutation and prints one
JSON line: the settings, the reward per step and the times.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusion_dpo_plain import update  # noqa: E402  (backward, clipping, AdamW at a rate)

from align_anything.families.text_to_image import shapes  # noqa: E402

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
STD_EPS = 1e-4  # added to the group std (GRPO's, TRL's)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", choices=("diffusion_nft", "flow_grpo"),
                        default="diffusion_nft")  # fmt: skip
    parser.add_argument("--model", default=None, help="default: the built-in tiny-t2i-shapes-flow")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per round")
    parser.add_argument("--group", type=int, default=8, help="G images per prompt")
    parser.add_argument("--rollout-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--adv-clip-max", type=float, default=5.0)
    parser.add_argument("--nft-beta", type=float, default=1.0)
    parser.add_argument("--old-decay", type=float, default=0.5)
    parser.add_argument("--noise-level", type=float, default=0.7, help="Flow-GRPO's a")
    parser.add_argument("--clip", type=float, default=1e-4, help="Flow-GRPO's ε")
    parser.add_argument("--kl-beta", type=float, default=0.0, help="Flow-GRPO's KL weight")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- the model


class Pipeline:
    """The diffusers parts: the trained transformer, the frozen VAE and text encoders, the
    sampling noise levels (K steps) and the training scheduler's 1000 levels."""

    def __init__(self, path: str, rollout_steps: int) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        self.pipe = StableDiffusion3Pipeline.from_pretrained(path)
        for module in (self.pipe.vae, self.pipe.text_encoder, self.pipe.text_encoder_2,
                       self.pipe.text_encoder_3, self.pipe.transformer):  # fmt: skip
            module.requires_grad_(False).eval()
        self.transformer = self.pipe.transformer
        self.vae = self.pipe.vae
        config = self.pipe.scheduler.config
        assert not config.use_dynamic_shifting, "the plain loop sets the static schedule only"
        sampling = FlowMatchEulerDiscreteScheduler.from_config(config)
        sampling.set_timesteps(rollout_steps)
        self.sigmas = sampling.sigmas.float()  # [K + 1], the last 0
        self.timesteps = sampling.timesteps.float()  # [K], σ·1000
        self.training = FlowMatchEulerDiscreteScheduler.from_config(config)  # never set_timesteps
        self.latent_shape = (
            self.transformer.config.in_channels,
            self.transformer.config.sample_size,
            self.transformer.config.sample_size,
        )

    @torch.no_grad()
    def encode(self, captions: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """caption -> (prompt embeddings [L, D], pooled [P]), each caption once; T5 sees the
        tokenizer's own length (the built-in model's 8 tokens)."""
        unique = sorted(set(captions))
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            unique, None, None, do_classifier_free_guidance=False,
            max_sequence_length=self.pipe.tokenizer_3.model_max_length,
        )  # fmt: skip
        return {c: (embeds[i], pooled[i]) for i, c in enumerate(unique)}

    @torch.no_grad()
    def images(self, latents: torch.Tensor) -> list:
        """PIL images of clean latents, as diffusers' image processor makes them."""
        from PIL import Image

        config = self.vae.config
        pixels = self.vae.decode(latents / config.scaling_factor + config.shift_factor).sample
        array = (pixels / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        return [Image.fromarray(a) for a in (array * 255).round().astype(np.uint8)]


def velocity(transformer, x, timesteps, embeds, pooled) -> torch.Tensor:
    return transformer(
        hidden_states=x, timestep=timesteps, encoder_hidden_states=embeds,
        pooled_projections=pooled, return_dict=False,
    )[0]  # fmt: skip


# ---------------------------------------------------------------------------- Flow-GRPO's step


def sde_step(x, v, sigma, sigma_next, sigma_1, a) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std [B, 1, 1, 1]) of Flow-GRPO's SDE step from noise level `sigma` [B] to
    `sigma_next` [B] (see the module docstring); `sigma_1` the schedule's second level."""
    shape = (-1, 1, 1, 1)
    sigma, sigma_next = sigma.view(shape), sigma_next.view(shape)
    dt = sigma_next - sigma
    std_t = a * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_1, sigma)))
    mean = (
        x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    return mean, std_t * torch.sqrt(-dt)


def gaussian_log_prob(sample, mean, std) -> torch.Tensor:
    """[B]: log N(sample; mean, std²) averaged over the latent's elements."""
    density = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return density.mean(dim=(1, 2, 3))


@torch.no_grad()
def rollout(pipeline: Pipeline, transformer, initial, step_noise, embeds, pooled, *,
            noise_level: float) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(latents [B, K + 1, C, h, w], log-probs [B, K] or None): the Euler ODE when
    `step_noise` is None, else Flow-GRPO's SDE with `step_noise` [B, K, C, h, w]."""
    x, sigmas, batch = initial, pipeline.sigmas, initial.shape[0]
    latents, logps = [x], []
    for k in range(len(pipeline.timesteps)):
        v = velocity(transformer, x, pipeline.timesteps[k].expand(batch), embeds, pooled)
        if step_noise is None:
            x = x + v * (sigmas[k + 1] - sigmas[k])
        else:
            mean, std = sde_step(x, v, sigmas[k].expand(batch), sigmas[k + 1].expand(batch),
                                 sigmas[1], noise_level)  # fmt: skip
            x = mean + std * step_noise[:, k]
            logps.append(gaussian_log_prob(x, mean, std))
        latents.append(x)
    return torch.stack(latents, dim=1), torch.stack(logps, dim=1) if logps else None


def grpo_step(pipeline: Pipeline, model, reference, optimizer, latents, steps, embeds, pooled,
              advantages, old_logps, *, noise_level: float, clip: float, kl_beta: float,
              max_grad_norm: float, lr: float) -> dict[str, float]:  # fmt: skip
    """One Flow-GRPO optimizer step on B trajectories `latents` [B, K + 1, ...] at trained
    steps `steps` [B, J]: the log-probs of x_{k+1} given x_k recomputed with gradients (one
    pass of B·J rows), the clipped ratio against `old_logps` [B, J] (None: the recomputed
    ones, detached) with `advantages` [B], β × the KL to `reference`; backward, clipping,
    AdamW. Returns the loss, the gradient norm before clipping, the KL, the clip fraction."""
    batch, chosen = steps.shape
    rows = torch.arange(batch).repeat_interleave(chosen)
    flat = steps.reshape(-1)
    before, after = latents[rows, flat], latents[rows, flat + 1]
    embeds, pooled = embeds[rows], pooled[rows]
    sigmas, timesteps = pipeline.sigmas, pipeline.timesteps
    v = velocity(model, before, timesteps[flat], embeds, pooled)
    mean, std = sde_step(before, v, sigmas[flat], sigmas[flat + 1], sigmas[1], noise_level)
    logps = gaussian_log_prob(after, mean, std).view(batch, chosen)
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    a = advantages.view(-1, 1)
    policy = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))
    loss_terms = policy
    kl = torch.zeros_like(policy)
    if kl_beta > 0:
        with torch.no_grad():
            v_ref = velocity(reference, before, timesteps[flat], embeds, pooled)
            mean_ref, _ = sde_step(before, v_ref, sigmas[flat], sigmas[flat + 1], sigmas[1],
                                   noise_level)  # fmt: skip
        kl = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)).view(batch, chosen) / (
            2 * std.view(batch, chosen) ** 2
        )
        loss_terms = policy + kl_beta * kl
    loss = loss_terms.mean(dim=1).mean()
    clipped = ((ratio - 1).abs() > clip).float()
    grad_norm = update(model, optimizer, loss, max_grad_norm=max_grad_norm, lr=lr)
    return {"loss": loss.item(), "grad_norm": grad_norm, "kl": kl.mean().item(),
            "clip_ratio": clipped.mean().item()}  # fmt: skip


# ---------------------------------------------------------------------------- DiffusionNFT's step


def nft_loss(v_theta, v_old, target, r, beta: float) -> torch.Tensor:
    """[B]: r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖² (element means), the paper's eq. 8."""
    positive = (1 - beta) * v_old + beta * v_theta
    negative = (1 + beta) * v_old - beta * v_theta
    r = r.view(-1)
    return r * ((positive - target) ** 2).mean(dim=(1, 2, 3)) + (1 - r) * (
        (negative - target) ** 2
    ).mean(dim=(1, 2, 3))


def nft_step(model, old, optimizer, final, noise, sigma, timesteps, embeds, pooled, r, *,
             beta: float, max_grad_norm: float, lr: float) -> dict[str, float]:  # fmt: skip
    """One DiffusionNFT optimizer step on clean latents `final` [B, C, h, w] noised with
    `noise` at levels `sigma` [B] (the transformer given `timesteps` [B]): v_old from the old
    copy `old`, the loss, backward, clipping, AdamW. Returns the loss and gradient norm."""
    s = sigma.view(-1, 1, 1, 1)
    noisy, target = (1 - s) * final + s * noise, noise - final
    with torch.no_grad():
        v_old = velocity(old, noisy, timesteps, embeds, pooled)
    v_theta = velocity(model, noisy, timesteps, embeds, pooled)
    loss = nft_loss(v_theta, v_old, target, r, beta).mean()
    grad_norm = update(model, optimizer, loss, max_grad_norm=max_grad_norm, lr=lr)
    return {"loss": loss.item(), "grad_norm": grad_norm}


@torch.no_grad()
def ema_update(old, model, decay: float) -> None:
    """old ← decay·old + (1 − decay)·θ."""
    for o, p in zip(old.parameters(), model.parameters(), strict=True):
        o.mul_(decay).add_(p, alpha=1 - decay)


# ---------------------------------------------------------------------------- shared


def group_advantages(rewards: torch.Tensor, group: int, cap: float) -> torch.Tensor:
    """[N]: (R − group mean) / (unbiased group std + 1e-4), clipped to ±cap."""
    grouped = rewards.view(-1, group)
    std = grouped.std(dim=1, keepdim=True)
    return (
        ((grouped - grouped.mean(dim=1, keepdim=True)) / (std + STD_EPS)).view(-1).clamp(-cap, cap)
    )


def colour_rewards(images: list, captions: list[str]) -> torch.Tensor:
    """1.0 where an image's dominant colour is its caption's (the shapes world's rule)."""
    return torch.tensor(shapes.colour_matches(images, captions), dtype=torch.float32)


def normal(seeds: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """[B, *shape]: sample b's standard normal draws from a generator seeded by seeds[b]."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s))
                        for s in seeds])  # fmt: skip


def training_draws(scheduler, seeds: list[int], shape: tuple[int, ...]):
    """(noise [B, *shape], σ [B], timesteps [B]): per image, from its own generator, the
    noise, then u ~ U[0, 1) and the training scheduler's level at index ⌊u·N⌋."""
    noises, index = [], []
    levels = int(scheduler.config.num_train_timesteps)
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        noises.append(torch.randn(shape, generator=generator))
        u = torch.rand((1,), generator=generator)
        index.append((u * levels).long().clamp(0, levels - 1))
    index = torch.cat(index)
    return torch.stack(noises), scheduler.sigmas[index].float(), scheduler.timesteps[index].float()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from align_anything.data.builtin import builtin_path
    from align_anything.families.text_to_image import shapes_flow_model

    started = time.time()
    pipeline = Pipeline(args.model or str(shapes_flow_model.SHIPPED_DIR), args.rollout_steps)
    captions = [row["text"] for row in shapes.read_parquet(builtin_path("t2i-shapes"))]
    embeddings = pipeline.encode(captions)
    model = pipeline.transformer.train().requires_grad_(True)
    frozen = copy.deepcopy(model).requires_grad_(False).eval()  # NFT: old policy; GRPO: reference
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(args.seed)
    grpo = args.algorithm == "flow_grpo"
    history = []
    setup_s, train_start = time.time() - started, time.time()
    for step in range(args.steps):
        prompts = torch.randperm(len(captions), generator=order)[: args.prompts].tolist()
        chosen = [captions[p] for p in prompts for _ in range(args.group)]
        embeds = torch.stack([embeddings[c][0] for c in chosen])
        pooled = torch.stack([embeddings[c][1] for c in chosen])
        seeds = [args.seed * 1_000_003 + step * 10_007 + i for i in range(len(chosen))]
        initial = normal(seeds, pipeline.latent_shape)
        noise = None
        if grpo:
            noise = normal([s + 1 for s in seeds], (args.rollout_steps, *pipeline.latent_shape))
        latents, _ = rollout(pipeline, model if grpo else frozen, initial, noise, embeds, pooled,
                             noise_level=args.noise_level)  # fmt: skip
        rewards = colour_rewards(pipeline.images(latents[:, -1]), chosen)
        advantages = group_advantages(rewards, args.group, args.adv_clip_max)
        if grpo:
            steps = torch.arange(args.rollout_steps).expand(len(chosen), -1)
            figures = grpo_step(
                pipeline, model, frozen, optimizer, latents, steps, embeds, pooled, advantages,
                None, noise_level=args.noise_level, clip=args.clip, kl_beta=args.kl_beta,
                max_grad_norm=args.max_grad_norm, lr=args.lr,
            )  # fmt: skip
        else:
            draws = training_draws(pipeline.training, [s + 2 for s in seeds],
                                   pipeline.latent_shape)  # fmt: skip
            r = 0.5 + 0.5 * advantages / args.adv_clip_max
            figures = nft_step(
                model, frozen, optimizer, latents[:, -1], *draws, embeds, pooled, r,
                beta=args.nft_beta, max_grad_norm=args.max_grad_norm, lr=args.lr,
            )  # fmt: skip
            ema_update(frozen, model, args.old_decay)
        history.append({"step": step + 1, "reward": rewards.mean().item(), **figures})
        print(json.dumps(history[-1]), flush=True)
    train_s = time.time() - train_start
    result = {
        "algorithm": args.algorithm, "steps": args.steps, "images_per_step": len(chosen),
        "lr": args.lr, "threads": torch.get_num_threads(), "setup_s": round(setup_s, 1),
        "train_s": round(train_s, 1), "s_per_step": round(train_s / max(1, args.steps), 3),
        "reward_first": history[0]["reward"], "reward_last": history[-1]["reward"],
        "loadavg": os.getloadavg()[0], "history": history,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "history"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
