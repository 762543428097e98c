"""Diffusion-DPO (and plain diffusion fine-tuning) in a plain PyTorch + diffusers loop.

    python benchmarks/diffusion_dpo_plain.py                      # DPO, the tuned recipe
    python benchmarks/diffusion_dpo_plain.py --task sft           # denoising-loss fine-tuning
    python benchmarks/diffusion_dpo_plain.py --beta 500 --steps 60 --out result.json

The prototype of the text-to-image main job and the benchmark's floor: the same work as the
framework's Diffusion-DPO task, with nothing between the loop and the models. On the built-in
model `tiny-t2i-shapes` and the built-in sets:
- set-up: the pipeline loads; the training images are encoded once through the VAE (posterior
  mean x `scaling_factor`) and each caption once through the text encoder;
- before and after training, the held-out check: the 32 captions of `t2i-shapes-eval` sampled
  with their seeds (DDIM, `--sample-steps`, no guidance) and `shapes.colour_match_rate`; and the
  held-out denoising loss: the epsilon MSE on `t2i-shapes-eval`'s true pictures at
  `EVAL_TIMESTEPS` fixed timesteps with seeded noise;
- `--task dpo`: Diffusion-DPO (Wallace et al. 2023) on the first `--pairs` pairs of
  `t2i-shapes-pref`. Chosen and rejected share noise and timestep; per-sample MSEs of the
  policy (θ) and of the frozen base UNet (ref); logits = (ref_w − ref_l) − (θ_w − θ_l), loss
  = −log σ(β·logits), averaged over the batch. (diffusers' research script writes the same loss
  with −0.5·β_dpo in front of (θ_w − θ_l) − (ref_w − ref_l): its β_dpo is 2β here.)
- `--task sft`: the denoising loss on `t2i-shapes` (true captions).
Only the UNet trains (AdamW); the VAE and the text encoder stay frozen. Batches are drawn by a
seeded permutation, epoch after epoch. It prints one JSON line: the settings, the figures before
and after, and the times of set-up, training and evaluation.
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from align_anything.data.builtin import builtin_path  # noqa: E402
from align_anything.families.text_to_image import shapes  # noqa: E402
from align_anything.families.text_to_image import shapes_model as t2i_shapes  # noqa: E402

EVAL_TIMESTEPS = (50, 150, 250, 350, 450, 550, 650, 750, 850, 950)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("dpo", "sft"), default="dpo")
    parser.add_argument("--model", default=str(t2i_shapes.SHIPPED_DIR))
    parser.add_argument("--beta", type=float, default=1000.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch", type=int, default=16, help="pairs (dpo) or pictures (sft)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pairs", type=int, default=512, help="rows of the training set used")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="the framework's default")
    parser.add_argument("--lr-scheduler", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up from 0")
    parser.add_argument("--save", type=Path, default=None, help="save the trained pipeline here")
    parser.add_argument("--sample-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--train-check", action="store_true",
                        help="also sample 2 captions of each training combination (diagnosis)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def pixels(images: list[bytes]) -> torch.Tensor:
    """PNG bytes -> a (N, 3, H, W) batch in [-1, 1]."""
    import numpy as np

    arrays = np.stack([np.asarray(shapes.decode_png(b)) for b in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 127.5 - 1.0


@torch.no_grad()
def encode_images(vae, images: list[bytes], batch: int = 256) -> torch.Tensor:
    x = pixels(images)
    means = [vae.encode(x[i : i + batch]).latent_dist.mean for i in range(0, len(x), batch)]
    return torch.cat(means) * vae.config.scaling_factor


@torch.no_grad()
def encode_texts(pipeline, texts: list[str]) -> torch.Tensor:
    tokens = pipeline.tokenizer(
        texts, padding="max_length", max_length=pipeline.tokenizer.model_max_length,
        truncation=True, return_tensors="pt",
    )  # fmt: skip
    return pipeline.text_encoder(tokens.input_ids)[0]


def per_sample_mse(unet, latents, noise, timesteps, embeds, alphas_cumprod) -> torch.Tensor:
    """The epsilon-prediction MSE of each sample (mean over its latent elements)."""
    a = alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
    prediction = unet(noisy, timesteps, embeds).sample
    return (prediction - noise).pow(2).mean(dim=(1, 2, 3))


@torch.no_grad()
def heldout_denoising_loss(unet, latents, embeds, alphas_cumprod, seed: int = 1234) -> float:
    """Mean epsilon MSE over every held-out picture at every `EVAL_TIMESTEPS` timestep, with
    noise from `seed` (the same numbers before and after training)."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for t in EVAL_TIMESTEPS:
        noise = torch.randn(latents.shape, generator=gen)
        steps = torch.full((len(latents),), t, dtype=torch.long)
        losses.append(per_sample_mse(unet, latents, noise, steps, embeds, alphas_cumprod))
    return torch.cat(losses).mean().item()


def colour_check(pipeline, rows: list[dict], steps: int) -> float:
    captions, seeds = [r["text"] for r in rows], [r["seed"] for r in rows]
    images = t2i_shapes.sample_images(pipeline, captions, seeds, steps)
    return shapes.colour_match_rate(images, captions)


def dpo_loss(theta_w, theta_l, ref_w, ref_l, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, logits) of Diffusion-DPO on per-sample MSEs."""
    logits = (ref_w - ref_l) - (theta_w - theta_l)
    return -F.logsigmoid(beta * logits).mean(), logits


def dpo_step(
    unet, reference, optimizer, latents_w, latents_l, embeds, noise, t, alphas, *, beta: float,
    max_grad_norm: float, lr: float,
) -> dict[str, float]:  # fmt: skip
    """One Diffusion-DPO optimizer step on B pairs: chosen `latents_w` and rejected `latents_l`
    [B, C, h, w] with their captions' `embeds`, one `noise` [B, C, h, w] and timestep `t` [B]
    per pair shared by both images; the loss, backward, clipping and AdamW's update at `lr`.
    Returns the step's loss, gradient norm (before clipping) and accuracy."""
    both = torch.cat([latents_w, latents_l])
    noise2, t2, embeds2 = torch.cat([noise, noise]), torch.cat([t, t]), embeds.repeat(2, 1, 1)
    theta = per_sample_mse(unet, both, noise2, t2, embeds2, alphas)
    with torch.no_grad():
        ref = per_sample_mse(reference, both, noise2, t2, embeds2, alphas)
    theta_w, theta_l = theta.chunk(2)
    ref_w, ref_l = ref.chunk(2)
    loss, logits = dpo_loss(theta_w, theta_l, ref_w, ref_l, beta)
    grad_norm = update(unet, optimizer, loss, max_grad_norm=max_grad_norm, lr=lr)
    return {
        "loss": loss.item(), "grad_norm": grad_norm,
        "accuracy": (logits > 0).float().mean().item(),
    }  # fmt: skip


def update(unet, optimizer, loss, *, max_grad_norm: float, lr: float) -> float:
    """Backward, clipping and AdamW's update at `lr`; the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(unet.parameters(), max_grad_norm).item()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return grad_norm


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over `--warmup-steps`, then constant or cosine to 0 (the framework's
    schedules)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_scheduler == "cosine":
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        return 0.5 * args.lr * (1 + math.cos(math.pi * progress))
    return args.lr


def evaluate(pipeline, eval_rows, eval_latents, eval_embeds, alphas, steps, train_check) -> dict:
    started = time.time()
    pipeline.unet.eval()
    out = {
        "colour_match": colour_check(pipeline, eval_rows, steps),
        "heldout_denoising_loss": heldout_denoising_loss(
            pipeline.unet, eval_latents, eval_embeds, alphas
        ),
    }
    if train_check:
        rows = [{"text": shapes.caption(c, s), "seed": 1000 + i}
                for i, (c, s) in enumerate(shapes.TRAIN_COMBOS * 2)]  # fmt: skip
        out["train_combos_colour_match"] = colour_check(pipeline, rows, steps)
    out["seconds"] = round(time.time() - started, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    load_start = os.getloadavg()
    from diffusers import DDPMScheduler, DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(args.model)
    pipeline.set_progress_bar_config(disable=True)
    for module in (pipeline.unet, pipeline.vae, pipeline.text_encoder):
        module.requires_grad_(False).eval()
    alphas = DDPMScheduler.from_config(pipeline.scheduler.config).alphas_cumprod

    eval_rows = shapes.read_parquet(builtin_path("t2i-shapes-eval"))
    eval_latents = encode_images(pipeline.vae, [r["image"] for r in eval_rows])
    eval_embeds = encode_texts(pipeline, [r["text"] for r in eval_rows])
    if args.task == "dpo":
        rows = shapes.read_parquet(builtin_path("t2i-shapes-pref"))[: args.pairs]
        chosen = [r["jpg_0"] if r["label_0"] == 1.0 else r["jpg_1"] for r in rows]
        rejected = [r["jpg_1"] if r["label_0"] == 1.0 else r["jpg_0"] for r in rows]
        latents_w = encode_images(pipeline.vae, chosen)
        latents_l = encode_images(pipeline.vae, rejected)
        embeds = encode_texts(pipeline, [r["caption"] for r in rows])
    else:
        rows = shapes.read_parquet(builtin_path("t2i-shapes"))[: args.pairs]
        latents_w = encode_images(pipeline.vae, [r["image"] for r in rows])
        embeds = encode_texts(pipeline, [r["text"] for r in rows])
    setup_s = time.time() - t0

    before = evaluate(
        pipeline, eval_rows, eval_latents, eval_embeds, alphas, args.sample_steps, args.train_check
    )
    print(json.dumps({"before": before}), flush=True)

    reference = copy.deepcopy(pipeline.unet) if args.task == "dpo" else None
    unet = pipeline.unet
    unet.requires_grad_(True).train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    order: list[int] = []
    num_t = len(alphas)
    history = []
    train_start, train_cpu_start = time.time(), time.process_time()
    for step in range(args.steps):
        if len(order) < args.batch:
            order += torch.randperm(len(rows), generator=gen).tolist()
        index, order = torch.tensor(order[: args.batch]), order[args.batch :]
        t = torch.randint(0, num_t, (len(index),), generator=gen)
        noise = torch.randn((len(index), *latents_w.shape[1:]), generator=gen)
        if args.task == "dpo":
            figures = dpo_step(
                unet, reference, optimizer, latents_w[index], latents_l[index], embeds[index],
                noise, t, alphas, beta=args.beta, max_grad_norm=args.max_grad_norm,
                lr=learning_rate(step, args),
            )  # fmt: skip
        else:
            loss = per_sample_mse(unet, latents_w[index], noise, t, embeds[index], alphas).mean()
            norm = update(
                unet, optimizer, loss, max_grad_norm=args.max_grad_norm,
                lr=learning_rate(step, args),
            )  # fmt: skip
            figures = {"loss": loss.item(), "grad_norm": norm}
        history.append({"step": step + 1, **figures})
        if (step + 1) % args.log_every == 0:
            recent = history[-args.log_every :]
            mean = {k: sum(h[k] for h in recent) / len(recent) for k in recent[0] if k != "step"}
            print(f"step {step + 1}: " + "  ".join(f"{k} {v:.4f}" for k, v in mean.items()),
                  f"({time.time() - train_start:.0f} s)", flush=True)  # fmt: skip
    train_s, train_cpu_s = time.time() - train_start, time.process_time() - train_cpu_start

    after = evaluate(
        pipeline, eval_rows, eval_latents, eval_embeds, alphas, args.sample_steps, args.train_check
    )
    result = {
        "task": args.task, "beta": args.beta, "lr": args.lr, "batch": args.batch,
        "steps": args.steps, "rows": len(rows), "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm, "lr_scheduler": args.lr_scheduler,
        "warmup_steps": args.warmup_steps,
        "sample_steps": args.sample_steps, "threads": torch.get_num_threads(),
        "before": before, "after": after,
        "setup_s": round(setup_s, 1), "train_s": round(train_s, 1),
        "s_per_step": round(train_s / max(1, args.steps), 3),
        "train_cpu_s": round(train_cpu_s, 1),
        "total_s": round(time.time() - t0, 1),
        "loadavg_start": load_start[0], "loadavg_end": os.getloadavg()[0],
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    if args.save:
        pipeline.save_pretrained(args.save, safe_serialization=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
