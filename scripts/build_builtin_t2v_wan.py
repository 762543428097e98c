"""Train the Wan-layout built-in text-to-video model `tiny-t2v-shapes` and write its folder.

    python scripts/build_builtin_t2v_wan.py --out /tmp/t2v-wan

The shipped folder is the chain below, ending with `--reverse-text-only`
(docs/text-to-video.md, "The Wan-layout builds": every measured build); copy the last
`--out` to `align_anything/families/text_to_video/builtin/tiny-t2v-shapes` (and its
`-samples.png` beside it). Plain
PyTorch + diffusers, seeded, CPU, fp32, one thread. Wan 2.1's layout
(`families/text_to_video/wan_shapes_model.py` gives the architecture), on freshly drawn 9-frame
moving-shape clips (`motion.py`'s drawing code; every colour x shape x direction, the held-out
ones too: this is pre-training, not the alignment data):
1. the causal 3-D VAE learns to reconstruct the clips (mean squared error, the shape's pixels
   weighted `--fg-weight` times the black background's, which alone would otherwise be the
   first thing learnt and a plateau; a KL term of weight `--kl-weight`); its latents' per-channel mean and
   spread become the folder's `latents_mean` / `latents_std`;
2. the clips are encoded once (the posterior mean, normalised);
3. the transformer and the UMT5 text encoder learn the flow-matching velocity loss:
   x_t = (1 − σ)·x₀ + σ·ε, target ε − x₀, σ = the logit-normal draw shifted by the
   scheduler's `flow_shift` (as the diffusion tasks draw it for Wan), on captions
   "a <colour> <shape> moving <direction>" through the pipeline's own T5 encoding (8 tokens),
   colour and shape always right, the direction word the clip's own only with probability
   `--direction-truth` and otherwise the opposite one. The model so learns colours, shapes and
   motion and gets the direction systematically wrong, on purpose: the held-out check
   (`motion.match_rate`) starts well under 0.5 for an alignment run (Diffusion-DPO on
   `t2v-shapes-pref`, whose rejected clips are the chosen ones played backwards) to raise.
`--parts-from DIR` starts the VAE, transformer and text encoder from another build's folder
(then `--vae-steps` and `--steps` more; with `--vae-steps 0` its latent normalisation is kept,
and `--decoder-only` trains the decoder alone, so the latents stay); `--reverse-steps N` adds a
phase of N steps on reversed direction words (`--reverse-lr`); `--vae-check-every` decodes 48
clips' encodings now and then and prints their colour and motion rates, and `--vae-stop-colour`
stops the VAE once both reach it. The chain measured last (docs/text-to-video.md, "Two-phase
builds"; 2 shared vCPUs, one thread, `nice -n 19`, load 3-9):

    ... --out A --vae-steps 1300 --vae-check-every 100 --steps 0                      # 2,068 s
    ... --out B --parts-from A --vae-steps 600 --fg-weight 8 --vae-check-every 100 \
        --vae-stop-colour 1.0 --direction-truth 1 --steps 1500    # VAE colour 1.00 at 200; 645 s
    ... --out C --parts-from B --vae-steps 0 --direction-truth 1 --steps 3000         # 501 s
    ... --out D --parts-from C --vae-steps 0 --steps 0 --reverse-steps 200 --reverse-lr 1e-4 \
        --reverse-text-only                                                           # 41 s

A's reconstructions stay at colour 0.33 (green and blue channels equal); B's reach 1.00. C
follows the direction word (held-out check 0.84, colour 0.84). D (shipped) barely does: check
0.09, colour 0.72; `make train-t2v` takes it to 0.84. A reversed phase that trains the
transformer too (without `--reverse-text-only`) weakens the colour more (check 0.31, colour 0.53
after 100 steps at 2e-5), and Diffusion-DPO of that base reaches 0.62 at best.

At the end it samples the 32 held-out captions of `t2v-shapes-eval` (UniPC, `--check-steps`
steps, seeds from the file), prints the check (and the share in the caption's colour, and the
share matching the caption with its direction reversed), prints the same-seed four-word test
(a red circle "moving left / right / up / down" from seeds 0-3: does the motion follow the
word), and writes the first and last frames of the held-out clips as a contact sheet
(`<out>-samples.png`) beside the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # the UNet-3D build's helpers: the same world

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from build_builtin_t2v import (  # noqa: E402
    ALL_COMBOS,
    contact_sheet,
    cosine_lr,
    log,
    noisy_captions,
)

from align_anything.data.builtin import builtin_path  # noqa: E402
from align_anything.families.text_to_video import motion  # noqa: E402
from align_anything.families.text_to_video import wan_shapes_model as t2v  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clips", type=int, default=2048, help="pre-training clips")
    parser.add_argument("--vae-steps", type=int, default=500)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--fg-weight", type=float, default=4.0,
                        help="reconstruction weight of the shape's pixels (background: 1)")  # fmt: skip
    parser.add_argument("--kl-weight", type=float, default=1e-6)
    parser.add_argument("--decoder-only", action="store_true",
                        help="train only the VAE's decoder (`--vae-steps` steps; the encoder, so "
                             "the latents the denoiser learns, stay as they are)")  # fmt: skip
    parser.add_argument("--vae-check-every", type=int, default=0,
                        help="decode 48 clips' encodings every this many VAE steps (0: never)")  # fmt: skip
    parser.add_argument("--vae-stop-colour", type=float, default=None,
                        help="stop the VAE early once that check's colour and motion rates "
                             "both reach this")  # fmt: skip
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--direction-truth", type=float, default=0.3,
                        help="probability that a pre-training caption's direction is true")  # fmt: skip
    parser.add_argument("--check-steps", type=int, default=t2v.CHECK_STEPS)
    parser.add_argument("--check-every", type=int, default=1000,
                        help="log the held-out check every this many steps (0: at the end only)")  # fmt: skip
    parser.add_argument("--vae-from", type=Path, default=None,
                        help="start the VAE from this pipeline folder's (then `--vae-steps` more)")  # fmt: skip
    parser.add_argument("--parts-from", type=Path, default=None,
                        help="start the VAE, transformer and text encoder from this pipeline "
                             "folder's (then `--vae-steps` and `--steps` more)")  # fmt: skip
    parser.add_argument("--reverse-steps", type=int, default=0,
                        help="after `--steps`, this many more on reversed direction words")  # fmt: skip
    parser.add_argument("--reverse-lr", type=float, default=2e-4)
    parser.add_argument("--reverse-text-only", action="store_true",
                        help="the reversed phase trains the text encoder alone")  # fmt: skip
    return parser.parse_args(argv)


def draw_clips(count: int, seed: int) -> tuple[torch.Tensor, list[tuple[str, str, str]]]:
    """`count` clips cycling over every combination: (pixels [N, 3, F, H, W] in [-1, 1],
    combos)."""
    rng = random.Random(seed)
    clips, combos = [], []
    for index in range(count):
        combo = ALL_COMBOS[index % len(ALL_COMBOS)]
        colour, shape, direction = combo
        clips.append(motion.draw_video(shape, colour, direction, frames=t2v.FRAMES,
                                       **motion.random_motion(rng, direction)))  # fmt: skip
        combos.append(combo)
    pixels = torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
    return pixels, combos


def train_vae(vae, pixels: torch.Tensor, combos, args: argparse.Namespace) -> None:
    if args.decoder_only:
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
    trained = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vae.train()
    running = 0.0
    for step in range(args.vae_steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.vae_steps, args.vae_lr, warmup=50)
        x = pixels[torch.randint(0, len(pixels), (args.vae_batch,), generator=gen)]
        with torch.set_grad_enabled(not args.decoder_only):
            posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        weight = 1.0 + (args.fg_weight - 1.0) * (x.amax(dim=1, keepdim=True) > -0.5).float()
        mse = (weight * (recon - x) ** 2).mean() / weight.mean()
        kl = 0.5 * (posterior.mean**2 + posterior.var - 1 - posterior.logvar).mean()
        loss = mse + args.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running += F.mse_loss(recon, x).item()
        if (step + 1) % 50 == 0:
            log(f"vae step {step + 1}/{args.vae_steps}  reconstruction mse {running / 50:.4f}  "
                f"kl {kl.item():.3f}")  # fmt: skip
            running = 0.0
        if args.vae_check_every and (step + 1) % args.vae_check_every == 0:
            vae.eval()
            check = reconstruction_check(vae, pixels, combos)
            log(f"vae step {step + 1}: reconstructions {json.dumps(check)}")
            vae.train()
            stop = args.vae_stop_colour
            if stop is not None and min(check["colour_rate"], check["match_rate"]) >= stop:
                log(f"vae stopped early at step {step + 1}")
                break
    vae.eval()


@torch.no_grad()
def reconstruction_check(vae, pixels: torch.Tensor, combos, count: int = 48) -> dict:
    """Decode the VAE's own encodings (posterior means) of the first `count` clips: the share
    in the clip's colour and the share whose motion passes the check."""
    x = pixels[:count]
    recon = vae.decode(vae.encode(x).latent_dist.mean).sample
    videos = ((recon.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).numpy()
    captions = [motion.caption(*combo) for combo in combos[:count]]
    colours = sum(motion.dominant_colour(v) == combo[0]
                  for v, combo in zip(videos, combos[:count], strict=False)) / len(videos)  # fmt: skip
    return {"colour_rate": colours, "match_rate": motion.match_rate(list(videos), captions)}


@torch.no_grad()
def encode(vae, pixels: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """[N, 3, F, H, W] -> posterior means [N, C, F', h, w]."""
    return torch.cat([vae.encode(pixels[i : i + batch]).latent_dist.mean
                      for i in range(0, len(pixels), batch)])  # fmt: skip


def train_denoiser(parts: dict, latents: torch.Tensor, combos, args: argparse.Namespace,
                   *, steps: int, lr: float, truth: float, seed_offset: int = 2,
                   label: str = "denoiser", text_only: bool = False) -> None:  # fmt: skip
    transformer, text_encoder = parts["transformer"], parts["text_encoder"]
    pipeline = t2v.pipeline_from(parts)
    shift = float(parts["scheduler"].config.flow_shift)
    transformer.requires_grad_(not text_only)
    params = [p for p in (*transformer.parameters(), *text_encoder.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + seed_offset)
    transformer.train()
    text_encoder.train()
    running = 0.0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=min(100, max(1, steps // 10)))
        index = torch.randint(0, len(latents), (args.batch,), generator=gen)
        x0 = latents[index]
        texts = noisy_captions([combos[i] for i in index.tolist()], truth, gen)
        embeds = pipeline._get_t5_prompt_embeds(texts, max_sequence_length=t2v.MAX_TOKENS,
                                                device=torch.device("cpu"))  # fmt: skip
        u = torch.sigmoid(torch.randn(args.batch, generator=gen))
        sigma = shift * u / (1 + (shift - 1) * u)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        pred = transformer(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma * 1000,
                           encoder_hidden_states=embeds, return_dict=False)[0]  # fmt: skip
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 100 == 0:
            log(f"{label} step {step + 1}/{steps}  loss {running / 100:.4f}")
            running = 0.0
        if args.check_every and (step + 1) % args.check_every == 0 and step + 1 < steps:
            transformer.eval()
            text_encoder.eval()
            check = held_out_check(parts, args)
            log(f"{label} step {step + 1}: held-out check {json.dumps(check)}")
            log(f"{label} step {step + 1}: four words {json.dumps(four_words(parts, args))}")
            transformer.train()
            text_encoder.train()
    transformer.eval()
    text_encoder.eval()


def held_out_check(parts: dict, args: argparse.Namespace, videos_out: list | None = None) -> dict:
    """The 32 held-out captions of `t2v-shapes-eval` sampled (UniPC, `--check-steps` steps,
    seeds from the file): the share that match (`motion.match_rate`), that show the caption's
    colour, and that match the caption with its direction reversed (the base's systematic
    error)."""
    pipeline = t2v.pipeline_from(parts)
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


def four_words(parts: dict, args: argparse.Namespace, seeds=(0, 1, 2, 3)) -> dict:
    """The same seeds under each direction word: {word: [(dx, dy) travel in px per seed]}."""
    pipeline = t2v.pipeline_from(parts)
    out = {}
    for word in motion.DIRECTIONS:
        videos = t2v.sample_videos(pipeline, [f"a red circle moving {word}"] * len(seeds),
                                   list(seeds), args.check_steps)  # fmt: skip
        out[word] = [None if (m := motion.motion(v)) is None else [round(m[0], 1), round(m[1], 1)]
                     for v in videos]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, cpu_started = time.time(), time.process_time()
    from diffusers import AutoencoderKLWan

    pixels, combos = draw_clips(args.clips, args.seed)
    log(f"{len(pixels)} clips drawn: {tuple(pixels.shape)}")
    vae_from = args.parts_from if args.parts_from is not None else args.vae_from
    if vae_from is not None:
        vae = AutoencoderKLWan.from_pretrained(vae_from, subfolder="vae")
    else:
        torch.manual_seed(args.seed)
        vae = AutoencoderKLWan(**t2v.vae_kwargs())
    train_vae(vae, pixels, combos, args)
    vae.requires_grad_(False)
    if args.vae_steps or vae_from is None:
        log(f"vae reconstructions: {json.dumps(reconstruction_check(vae, pixels, combos))}")
    latents = encode(vae, pixels)
    if vae_from is None or (args.vae_steps and not args.decoder_only):
        # an encoder trained here: measure its latents' spread
        mean, std = latents.mean(dim=(0, 2, 3, 4)), latents.std(dim=(0, 2, 3, 4))
        vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    else:  # an encoder reused as it is: keep the spread the denoiser was (or is) trained on
        mean = torch.tensor(vae.config.latents_mean)
        std = torch.tensor(vae.config.latents_std)
    latents = (latents - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    log(f"clips encoded: latents {tuple(latents.shape)} ({time.time() - started:.0f} s)")
    parts = t2v.build_components(seed=args.seed, vae=vae)
    if args.parts_from is not None:
        from diffusers import WanTransformer3DModel
        from transformers import UMT5EncoderModel

        parts["transformer"] = WanTransformer3DModel.from_pretrained(
            args.parts_from, subfolder="transformer")  # fmt: skip
        parts["text_encoder"] = UMT5EncoderModel.from_pretrained(
            args.parts_from, subfolder="text_encoder")  # fmt: skip
    for module in ("transformer", "text_encoder"):
        parts[module].requires_grad_(True)
    train_denoiser(parts, latents, combos, args, steps=args.steps, lr=args.lr,
                   truth=args.direction_truth)  # fmt: skip
    log(f"denoiser trained ({time.time() - started:.0f} s)")
    if args.reverse_steps:
        train_denoiser(parts, latents, combos, args, steps=args.reverse_steps,
                       lr=args.reverse_lr, truth=0.0, seed_offset=3, label="reversed",
                       text_only=args.reverse_text_only)  # fmt: skip
        log(f"reversed phase trained ({time.time() - started:.0f} s)")
    for module in ("transformer", "text_encoder"):
        parts[module].requires_grad_(False)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    t2v.save_pipeline(parts, args.out)
    train_time, cpu_time = time.time() - started, time.process_time() - cpu_started

    videos: list = []
    check = held_out_check(parts, args, videos)
    contact_sheet(videos).save(args.out.parent / f"{args.out.name}-samples.png")
    report = {**check, "four_words": four_words(parts, args), "train_seconds": round(train_time),
              "train_cpu_seconds": round(cpu_time), "loadavg": os.getloadavg(),
              "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    log(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
