"""Train the built-in text-to-image model `tiny-t2i-shapes` from scratch and write its folder.

    python scripts/build_builtin_t2i.py                  # -> align_anything/families/text_to_image/builtin/tiny-t2i-shapes
    python scripts/build_builtin_t2i.py --out /tmp/t2i   # anywhere else

Plain PyTorch + diffusers, seeded, CPU, fp32. Three stages on freshly drawn shape pictures
(`families/text_to_image/shapes.py`'s drawing code; every colour x shape combination, the
held-out ones too: this is the model's pre-training, not the alignment data):
1. the VAE learns to reconstruct the pictures (MSE plus a small KL term); its latents' scale
   sets `scaling_factor`, as for Stable Diffusion;
2. the pictures are encoded once (the posterior mean);
3. the UNet and the text encoder learn the denoising loss on those latents, captioned "a <colour>
   <shape>" where the shape word is always right but the colour word is the picture's own only
   with probability `--colour-truth` and otherwise a uniformly random colour (drawn afresh each
   step). The model so learns shapes and images well and colour badly, on purpose: with
   `--colour-truth` q a caption's colour comes out about q + (1 - q)/6 of the time, which
   leaves the held-out colour check (`shapes.colour_match_rate`) well under 0.5 for an
   alignment run (Diffusion-DPO on `t2i-shapes-pref`) to raise.
At the end it samples the 32 held-out captions of `t2i-shapes-eval` (DDIM, `--check-steps`
steps, seeds from the file) and prints the colour check, and writes a grid of those samples
(`samples.png`) beside the folder.

Measured on this machine (AMD EPYC, 2 shared CPU cores, one thread, load average ~10 from other
jobs): 3,324 s wall, 1,003 s CPU for the defaults; the held-out colour check gives 0.406
(13 of 32), the shipped `tiny-t2i-shapes-samples.png` is its grid.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from align_anything.families.text_to_image import shapes  # noqa: E402
from align_anything.families.text_to_image import shapes_model as t2i_shapes  # noqa: E402

ALL_COMBOS = tuple((c, s) for c in shapes.COLOURS for s in shapes.SHAPES)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=t2i_shapes.SHIPPED_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest for models this small on shared cores)")  # fmt: skip
    parser.add_argument("--pictures", type=int, default=6144, help="pre-training pictures")
    parser.add_argument("--vae-steps", type=int, default=1200)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-4)
    parser.add_argument("--unet-steps", type=int, default=3000)
    parser.add_argument("--unet-batch", type=int, default=64)
    parser.add_argument("--unet-lr", type=float, default=1e-3)
    parser.add_argument("--colour-truth", type=float, default=0.35,
                        help="probability that a pre-training caption's colour word is true")  # fmt: skip
    parser.add_argument("--colour-noise", choices=("uniform", "neighbour"), default="neighbour")
    parser.add_argument("--check-steps", type=int, default=20, help="DDIM steps of the check")
    parser.add_argument("--vae-only", action="store_true",
                        help="stop after stage 1 and save the pipeline (for --vae-from)")  # fmt: skip
    parser.add_argument("--vae-from", type=Path, default=None,
                        help="reuse the VAE of this pipeline folder (skips stage 1)")  # fmt: skip
    parser.add_argument("--unet-from", type=Path, default=None,
                        help="start the UNet and text encoder from this pipeline folder")  # fmt: skip
    return parser.parse_args(argv)


def draw_pictures(count: int, seed: int) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    """`count` random pictures cycling over every combination: (images in [-1, 1], combos)."""
    rng = random.Random(seed)
    images, combos = [], []
    for index in range(count):
        colour, shape = ALL_COMBOS[index % len(ALL_COMBOS)]
        picture = shapes.draw_shape(shape, colour, **shapes.random_layout(rng))
        images.append(np.asarray(picture))
        combos.append((colour, shape))
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return pixels, combos


def cosine_lr(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def train_vae(vae, pixels: torch.Tensor, args: argparse.Namespace) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vae.train()
    running = 0.0
    for step in range(args.vae_steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.vae_steps, args.vae_lr)
        batch = pixels[torch.randint(0, len(pixels), (args.vae_batch,), generator=gen)]
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample(generator=gen)).sample
        mse = F.mse_loss(recon, batch)
        kl = posterior.kl().mean() / posterior.mean[0].numel()  # per latent element
        loss = mse + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running += mse.item()
        if (step + 1) % 100 == 0:
            log(
                f"vae step {step + 1}/{args.vae_steps}  mse {running / 100:.5f}  kl {kl.item():.3f}"
            )
            running = 0.0
    vae.eval()


@torch.no_grad()
def encode(vae, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    return torch.cat([vae.encode(pixels[i : i + batch]).latent_dist.mean
                      for i in range(0, len(pixels), batch)])  # fmt: skip


def noisy_captions(
    combos: list[tuple[str, str]], truth: float, noise: str, gen: torch.Generator
) -> list[str]:
    """Captions whose shape is right and whose colour is right with probability `truth`;
    otherwise (`noise`) "uniform": any palette colour, or "neighbour": the next hue round the
    wheel (red pictures called yellow, ..., magenta ones red)."""
    keep = torch.rand(len(combos), generator=gen) < truth
    random_colour = torch.randint(0, len(shapes.COLOURS), (len(combos),), generator=gen)
    texts = []
    for (colour, shape), k, r in zip(combos, keep.tolist(), random_colour.tolist(), strict=True):
        if not k:
            i = shapes.COLOURS.index(colour)
            colour = shapes.COLOURS[r if noise == "uniform" else (i + 1) % len(shapes.COLOURS)]
        texts.append(shapes.caption(colour, shape))
    return texts


def train_denoiser(parts: dict, latents: torch.Tensor, combos, args: argparse.Namespace) -> None:
    unet, text_encoder, tokenizer = parts["unet"], parts["text_encoder"], parts["tokenizer"]
    from diffusers import DDPMScheduler

    noise_scheduler = DDPMScheduler.from_config(parts["scheduler"].config)
    alphas = noise_scheduler.alphas_cumprod
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + 2)
    unet.train()
    text_encoder.train()
    running = 0.0
    for step in range(args.unet_steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.unet_steps, args.unet_lr)
        index = torch.randint(0, len(latents), (args.unet_batch,), generator=gen)
        x0 = latents[index]
        texts = noisy_captions(
            [combos[i] for i in index.tolist()], args.colour_truth, args.colour_noise, gen
        )
        ids = tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids  # fmt: skip
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (len(x0),), generator=gen)
        a = alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        prediction = unet(noisy, t, text_encoder(ids)[0]).sample
        loss = F.mse_loss(prediction, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 100 == 0:
            log(f"unet step {step + 1}/{args.unet_steps}  loss {running / 100:.4f}")
            running = 0.0
    unet.eval()
    text_encoder.eval()


def grid(images: list, columns: int = 8):
    from PIL import Image

    size = images[0].size[0] + 2
    rows = math.ceil(len(images) / columns)
    sheet = Image.new("RGB", (columns * size, rows * size), (64, 64, 64))
    for i, image in enumerate(images):
        sheet.paste(image, ((i % columns) * size, (i // columns) * size))
    return sheet.resize((sheet.width * 4, sheet.height * 4), Image.Resampling.NEAREST)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, cpu_started = time.time(), time.process_time()
    parts = t2i_shapes.build_components(seed=args.seed)
    if args.vae_from is not None:
        from diffusers import AutoencoderKL

        parts["vae"] = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae")
    if args.unet_from is not None:
        from diffusers import UNet2DConditionModel
        from transformers import CLIPTextModel

        parts["unet"] = UNet2DConditionModel.from_pretrained(args.unet_from, subfolder="unet")
        parts["text_encoder"] = CLIPTextModel.from_pretrained(
            args.unet_from, subfolder="text_encoder"
        )
    pixels, combos = draw_pictures(args.pictures, args.seed)
    log(f"{len(pixels)} pictures drawn")
    vae = parts["vae"]
    if args.vae_from is None:
        train_vae(vae, pixels, args)
        log(f"vae trained ({time.time() - started:.0f} s)")
    vae.eval()
    raw = encode(vae, pixels)
    scaling = 1.0 / raw.std().item()
    vae.register_to_config(scaling_factor=scaling)
    latents = raw * scaling
    log(f"latents {tuple(latents.shape)}, scaling_factor {scaling:.4f}")
    if args.vae_only:
        args.out.mkdir(parents=True, exist_ok=True)
        t2i_shapes.save_pipeline(parts, args.out)
        with torch.no_grad():
            recon = vae.decode(raw[:32]).sample
        as_images = ((recon.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
        from PIL import Image

        pictures = [Image.fromarray(a) for a in as_images]
        truth = [
            Image.fromarray(a)
            for a in ((pixels[:32] + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
        ]
        grid(truth + pictures).save(args.out.parent / f"{args.out.name}-recon.png")
        captions = [shapes.caption(*c) for c in combos[:32]]
        log(
            f"reconstruction colour check {shapes.colour_match_rate(pictures, captions):.3f}, "
            f"mse {F.mse_loss(recon, pixels[:32]).item():.5f}"
        )
        return 0
    train_denoiser(parts, latents, combos, args)
    log(f"denoiser trained ({time.time() - started:.0f} s)")
    for module in ("unet", "text_encoder", "vae"):
        parts[module].requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    t2i_shapes.save_pipeline(parts, args.out)
    train_time, cpu_time = time.time() - started, time.process_time() - cpu_started

    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(args.out)
    pipeline.set_progress_bar_config(disable=True)
    rows = shapes.read_parquet(shapes.BUILTIN_DIR / shapes.SHAPE_DATASETS["t2i-shapes-eval"])
    captions, seeds = [r["text"] for r in rows], [r["seed"] for r in rows]
    images = t2i_shapes.sample_images(pipeline, captions, seeds, args.check_steps)
    rate = shapes.colour_match_rate(images, captions)
    grid(images).save(args.out.parent / f"{args.out.name}-samples.png")
    report = {"colour_match_rate": rate, "train_seconds": round(train_time),
              "train_cpu_seconds": round(cpu_time), "loadavg": os.getloadavg(),
              "scaling_factor": scaling, "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    log(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
