"""Train the earlier, UNet-3D built-in text-to-video model and write its folder.

    python scripts/build_builtin_t2v.py --out /tmp/t2v

No longer shipped: `tiny-t2v-shapes` is now Wan's layout (`scripts/build_builtin_t2v_wan.py`);
the figures below are of the UNet-3D folder shipped before it, on 8-frame clips.

Plain PyTorch + diffusers, seeded, CPU, fp32, one thread. The VAE is `tiny-t2i-shapes`' (frames
are the same kind of picture; the UNet-3D layout encodes frame by frame), so only the text
encoder and the `UNet3DConditionModel` train, on freshly drawn moving-shape clips
(`families/text_to_video/motion.py`'s drawing code; every colour x shape x direction, the
held-out ones too: this is pre-training, not the alignment data):
1. the clips are encoded once, frame by frame (the posterior mean, times the VAE's
   `scaling_factor`);
2. the UNet and the text encoder learn the denoising loss on those latents, captioned
   "a <colour> <shape> moving <direction>" where colour and shape are always right but the
   direction word is the clip's own only with probability `--direction-truth` and otherwise
   the opposite one. The model so learns colours, shapes and motion and gets the direction
   systematically wrong, on purpose: the held-out check (`motion.match_rate`) stays well
   under 0.5 for an alignment run (Diffusion-DPO on `t2v-shapes-pref`, whose rejected clips
   are the chosen ones played backwards) to raise.
At the end it samples the 32 held-out captions of `t2v-shapes-eval` (DDIM, `--check-steps`
steps, seeds from the file), prints the check, and writes their first and last frames as a
contact sheet (`tiny-t2v-shapes-samples.png`) beside the folder.

Measured on this machine (AMD EPYC, 2 shared vCPUs, one thread, under `nice -n 19` beside
other jobs, load average ~9): 2,655 s wall, 1,244 s CPU for the defaults (900 steps; 1,200
would have taken over 50 minutes at that load). The held-out check of the shipped weights:
0.22 (7 of 32 clips match their caption), 0.84 in the caption's colour, 0.25 matching the
caption with its direction reversed; `--check-every 300` logged 0.12 / 0.19 at steps 300 / 600.
The shipped `tiny-t2v-shapes-samples.png` is its contact sheet. Those weights ignore the
direction word (the same seed moves the same way under all four words), so the main job has no
direction to reweight (docs/text-to-video.md). `--prediction v_prediction` trains the same
pipeline with a v-prediction scheduler, whose loss weighs the high noise levels, where the
direction is decided, 12-215x more than epsilon's (t = 700..999): at 600 steps its base draws
every held-out caption's colour, but it ignores the direction word too, even with
`--direction-truth 0` (docs/text-to-video.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from align_anything.data.builtin import builtin_path  # noqa: E402
from align_anything.families.text_to_video import motion  # noqa: E402
from align_anything.families.text_to_video import shapes_model as t2v  # noqa: E402

ALL_COMBOS = tuple((c, s, d) for c in motion.COLOURS for s in motion.SHAPES
                   for d in motion.DIRECTIONS)  # fmt: skip
T2I_VAE = (
    REPO_ROOT / "align_anything" / "families" / "text_to_image" / "builtin" / "tiny-t2i-shapes"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)  # the shipped folder is Wan's now
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clips", type=int, default=3072, help="pre-training clips")
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--direction-truth", type=float, default=0.3,
                        help="probability that a pre-training caption's direction is true")  # fmt: skip
    parser.add_argument("--prediction", choices=("epsilon", "v_prediction"), default="epsilon",
                        help="the denoiser's target (the scheduler's prediction_type)")  # fmt: skip
    parser.add_argument("--check-steps", type=int, default=20)
    parser.add_argument("--check-every", type=int, default=300,
                        help="log the held-out check every this many steps (0: at the end only)")  # fmt: skip
    parser.add_argument("--unet-from", type=Path, default=None,
                        help="start the UNet and text encoder from this pipeline folder")  # fmt: skip
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cosine_lr(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def draw_clips(count: int, seed: int) -> tuple[torch.Tensor, list[tuple[str, str, str]]]:
    """`count` clips cycling over every combination: (frames [N, F, 3, H, W] in [-1, 1], combos)."""
    rng = random.Random(seed)
    clips, combos = [], []
    for index in range(count):
        combo = ALL_COMBOS[index % len(ALL_COMBOS)]
        clips.append(motion._clip(rng, combo))
        combos.append(combo)
    pixels = torch.from_numpy(np.stack(clips)).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
    return pixels, combos


@torch.no_grad()
def encode(vae, pixels: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """[N, F, 3, H, W] -> scaled latents [N, C, F, h, w], frame by frame."""
    n, f = pixels.shape[:2]
    flat = pixels.reshape(n * f, *pixels.shape[2:])
    mean = torch.cat([vae.encode(flat[i : i + batch]).latent_dist.mean
                      for i in range(0, len(flat), batch)])  # fmt: skip
    latents = mean.reshape(n, f, *mean.shape[1:]).permute(0, 2, 1, 3, 4)
    return latents * vae.config.scaling_factor


def noisy_captions(combos, truth: float, gen: torch.Generator) -> list[str]:
    keep = (torch.rand(len(combos), generator=gen) < truth).tolist()
    return [motion.caption(c, s, d if k else motion.OPPOSITE[d])
            for (c, s, d), k in zip(combos, keep, strict=True)]  # fmt: skip


def train(parts: dict, latents: torch.Tensor, combos, args: argparse.Namespace) -> None:
    from diffusers import DDPMScheduler

    unet, text_encoder, tokenizer = parts["unet"], parts["text_encoder"], parts["tokenizer"]
    alphas = DDPMScheduler.from_config(parts["scheduler"].config).alphas_cumprod
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + 2)
    unet.train()
    text_encoder.train()
    running = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, args.lr)
        index = torch.randint(0, len(latents), (args.batch,), generator=gen)
        x0 = latents[index]
        texts = noisy_captions([combos[i] for i in index.tolist()], args.direction_truth, gen)
        ids = tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids  # fmt: skip
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, 1000, (len(x0),), generator=gen)
        a = alphas[t].view(-1, 1, 1, 1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        target = noise if args.prediction == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
        loss = F.mse_loss(unet(noisy, t, text_encoder(ids)[0]).sample, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 50 == 0:
            log(f"unet step {step + 1}/{args.steps}  loss {running / 50:.4f}")
            running = 0.0
        if args.check_every and (step + 1) % args.check_every == 0 and step + 1 < args.steps:
            unet.eval()
            text_encoder.eval()
            log(f"unet step {step + 1}: held-out check {json.dumps(held_out_check(parts, args))}")
            unet.train()
            text_encoder.train()
    unet.eval()
    text_encoder.eval()


def held_out_check(parts: dict, args: argparse.Namespace, videos_out: list | None = None) -> dict:
    """The 32 held-out captions of `t2v-shapes-eval` sampled (DDIM, `--check-steps` steps, seeds
    from the file): the share that match (`motion.match_rate`), that show the caption's colour,
    and that match the caption with its direction reversed (the base's systematic error)."""
    pipeline = t2v.pipeline_from(parts)
    pipeline.set_progress_bar_config(disable=True)
    rows = motion.read_parquet(builtin_path("t2v-shapes-eval"))
    captions, seeds = [r["text"] for r in rows], [r["seed"] for r in rows]
    videos = t2v.sample_videos(pipeline, captions, seeds, args.check_steps)
    colours = sum(motion.dominant_colour(v) == motion.caption_words(c)[0]
                  for v, c in zip(videos, captions, strict=True)) / len(videos)  # fmt: skip
    swapped = [t.replace(f"moving {d}", f"moving {motion.OPPOSITE[d]}")
               for t, d in ((t, motion.caption_words(t)[1]) for t in captions)]  # fmt: skip
    if videos_out is not None:
        videos_out.extend(videos)
    return {"match_rate": motion.match_rate(videos, captions), "colour_rate": colours,
            "opposite_direction_rate": motion.match_rate(videos, swapped)}  # fmt: skip


def contact_sheet(videos: list[np.ndarray], columns: int = 8):
    """First and last frame of each clip side by side, 8 clips a row, 4x enlarged."""
    from PIL import Image

    size = videos[0].shape[1]
    cell = 2 * size + 6
    rows = math.ceil(len(videos) / columns)
    sheet = Image.new("RGB", (columns * cell, rows * (size + 4)), (64, 64, 64))
    for i, video in enumerate(videos):
        x, y = (i % columns) * cell, (i // columns) * (size + 4)
        sheet.paste(Image.fromarray(video[0]), (x, y))
        sheet.paste(Image.fromarray(video[-1]), (x + size + 2, y))
    return sheet.resize((sheet.width * 4, sheet.height * 4), Image.Resampling.NEAREST)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, cpu_started = time.time(), time.process_time()
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(T2I_VAE, subfolder="vae").eval()
    vae.requires_grad_(False)
    parts = t2v.build_components(vae, seed=args.seed, prediction_type=args.prediction)
    if args.unet_from is not None:
        from diffusers import UNet3DConditionModel
        from transformers import CLIPTextModel

        parts["unet"] = UNet3DConditionModel.from_pretrained(args.unet_from, subfolder="unet")
        parts["text_encoder"] = CLIPTextModel.from_pretrained(args.unet_from,
                                                              subfolder="text_encoder")  # fmt: skip
    pixels, combos = draw_clips(args.clips, args.seed)
    latents = encode(vae, pixels)
    log(f"{len(pixels)} clips drawn and encoded: latents {tuple(latents.shape)}, "
        f"std {latents.std().item():.3f}")  # fmt: skip
    train(parts, latents, combos, args)
    log(f"denoiser trained ({time.time() - started:.0f} s)")
    for module in ("unet", "text_encoder"):
        parts[module].requires_grad_(False)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    t2v.save_pipeline(parts, args.out)
    train_time, cpu_time = time.time() - started, time.process_time() - cpu_started

    videos: list = []
    check = held_out_check(parts, args, videos)
    contact_sheet(videos).save(args.out.parent / f"{args.out.name}-samples.png")
    report = {**check, "train_seconds": round(train_time), "train_cpu_seconds": round(cpu_time),
              "loadavg": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    log(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
