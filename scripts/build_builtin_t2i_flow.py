"""Train the built-in flow-matching text-to-image model `tiny-t2i-shapes-flow` and write its folder.

    python scripts/build_builtin_t2i_flow.py                  # -> its place in the package
    python scripts/build_builtin_t2i_flow.py --out /tmp/flow  # anywhere else

Plain PyTorch + diffusers, seeded, CPU, fp32: the SD3-style sibling of `tiny-t2i-shapes`
(`families/text_to_image/shapes_flow_model.py` gives the architecture), in the same world and
with the same known colour confusion, trained as `scripts/build_builtin_t2i.py` trains the
first one but with the rectified-flow loss:
1. the VAE is `tiny-t2i-shapes`'s (`--vae-from`), unchanged: it was trained to reconstruct the
   pictures only, so its latent space suits any denoiser; here its latents get SD3's
   normalisation, `shift_factor` their mean and `scaling_factor` one over their spread;
2. the same pre-training pictures as the first script's (`--pictures`, `--seed`: every colour x
   shape combination, the held-out ones too) are encoded once (the posterior mean);
3. the transformer and the three text encoders learn the velocity loss: x_t = (1 − σ)·x₀ + σ·ε,
   target ε − x₀, σ from the logit-normal density (SD3's; diffusers'
   `compute_density_for_timestep_sampling`) on the flow scheduler's table, as the diffusion
   tasks' flow-matching forward pass draws it (`families/diffusion/forward.py`). The text goes
   through the pipeline's own `encode_prompt` (T5 at 8 tokens), so training sees what sampling
   feeds the transformer. Captions are "a <colour> <shape>", the shape always right, the colour
   the picture's own only with probability `--colour-truth` and otherwise the next hue round the
   wheel (`--colour-noise`, both as the first script), and empty with probability
   `--uncond-prob`, so the unconditional prediction that classifier-free guidance needs is
   learnt too. The model so draws shapes well and colour badly, on purpose: asked for colour c
   it draws c about `--colour-truth` of the time and the previous hue otherwise.
At the end it samples the 32 held-out captions of `t2i-shapes-eval` (Euler, `--check-steps`
steps, no guidance, seeds from the file), prints the held-out colour check
(`shapes.colour_match_rate`) and writes a grid of those samples beside the folder
(`<out>-samples.png`).

Measured on this machine (AMD EPYC, 2 shared CPU cores, one thread, load average 3 to 10 from
other jobs): 2,639 s wall and 1,272 s CPU for the training (the script's own report), 44 min wall
and 21 min CPU for the whole command with the defaults; the held-out colour check gives 0.281
(9 of 32; every image shows a coloured shape, and each wrong one is the caption colour's
previous hue), the shipped `tiny-t2i-shapes-flow-samples.png` is its grid. Sampled at 192 other
seeds of the held-out captions, the check is 0.385 (`tiny-t2i-shapes`: 0.438), near the
captions' own 0.35: the 32-image check is a small sample. The folder holds 7.0 MB of
safetensors (the transformer 5.2 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # the first model's script: the same pictures

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from build_builtin_t2i import (  # noqa: E402
    cosine_lr,
    draw_pictures,
    encode,
    grid,
    log,
    noisy_captions,
)

from align_anything.families.text_to_image import shapes, shapes_model  # noqa: E402
from align_anything.families.text_to_image import shapes_flow_model as flow_model  # noqa: E402

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=flow_model.SHIPPED_DIR)
    parser.add_argument("--vae-from", type=Path, default=shapes_model.SHIPPED_DIR,
                        help="the pipeline folder whose VAE is reused")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest for models this small on shared cores)")  # fmt: skip
    parser.add_argument("--pictures", type=int, default=6144, help="pre-training pictures")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--colour-truth", type=float, default=0.35,
                        help="probability that a pre-training caption's colour word is true")  # fmt: skip
    parser.add_argument("--colour-noise", choices=("uniform", "neighbour"), default="neighbour")
    parser.add_argument("--uncond-prob", type=float, default=0.1,
                        help="probability that a caption is empty (classifier-free guidance)")  # fmt: skip
    parser.add_argument("--check-steps", type=int, default=flow_model.CHECK_STEPS,
                        help="Euler steps of the check")  # fmt: skip
    return parser.parse_args(argv)


def normalise_latents(vae, raw: torch.Tensor) -> torch.Tensor:
    """SD3's latent normalisation from the encoded pictures: `shift_factor` is their mean,
    `scaling_factor` one over their standard deviation after the shift; both are written into
    the VAE's config (the pipeline decodes with them) and the scaled latents returned."""
    shift = raw.mean().item()
    scaling = 1.0 / (raw - shift).std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scaling)
    return (raw - shift) * scaling


def train_flow(parts: dict, latents: torch.Tensor, combos, args: argparse.Namespace) -> None:
    """The rectified-flow (velocity) loss on the transformer and the text encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    pipeline = flow_model.pipeline_from(parts)
    transformer = parts["transformer"]
    table = FlowMatchEulerDiscreteScheduler.from_config(parts["scheduler"].config)
    steps_in_table = int(table.config.num_train_timesteps)
    modules = [transformer, *(parts[p] for p in TEXT_ENCODERS)]
    params = [p for module in modules for p in module.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + 2)
    for module in modules:
        module.train()
    running = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, args.lr)
        index = torch.randint(0, len(latents), (args.batch,), generator=gen)
        x0 = latents[index]
        texts = noisy_captions(
            [combos[i] for i in index.tolist()], args.colour_truth, args.colour_noise, gen
        )
        empty = (torch.rand(len(texts), generator=gen) < args.uncond_prob).tolist()
        texts = ["" if e else text for text, e in zip(texts, empty, strict=True)]
        embeds, _, pooled, _ = pipeline.encode_prompt(
            texts, None, None, device="cpu", do_classifier_free_guidance=False,
            max_sequence_length=flow_model.MAX_TOKENS,
        )  # fmt: skip
        noise = torch.randn(x0.shape, generator=gen)
        u = compute_density_for_timestep_sampling(
            "logit_normal", len(x0), logit_mean=0.0, logit_std=1.0, generator=gen
        )
        at = (u * steps_in_table).long().clamp(0, steps_in_table - 1)
        sigma = table.sigmas[at].float().view(-1, 1, 1, 1)
        noisy = (1 - sigma) * x0 + sigma * noise
        velocity = transformer(
            hidden_states=noisy, timestep=table.timesteps[at].float(),
            encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False,
        )[0]  # fmt: skip
        loss = F.mse_loss(velocity, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 100 == 0:
            log(f"flow step {step + 1}/{args.steps}  loss {running / 100:.4f}")
            running = 0.0
    for module in modules:
        module.eval()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, cpu_started = time.time(), time.process_time()
    from diffusers import AutoencoderKL

    # The trained weights in a VAE built from the config here: the folder's own config would
    # carry its path (`_name_or_path`) into the written one.
    vae = AutoencoderKL(**flow_model.vae_kwargs()).eval()
    vae.load_state_dict(AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae").state_dict())
    parts = flow_model.build_components(seed=args.seed, vae=vae)
    pixels, combos = draw_pictures(args.pictures, args.seed)
    log(f"{len(pixels)} pictures drawn")
    latents = normalise_latents(vae, encode(vae, pixels))
    log(
        f"latents {tuple(latents.shape)}, shift_factor {vae.config.shift_factor:.4f}, "
        f"scaling_factor {vae.config.scaling_factor:.4f}"
    )
    train_flow(parts, latents, combos, args)
    log(f"flow model trained ({time.time() - started:.0f} s)")
    for part in (*TEXT_ENCODERS, "transformer", "vae"):
        parts[part].requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    flow_model.save_pipeline(parts, args.out)
    train_time, cpu_time = time.time() - started, time.process_time() - cpu_started

    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(args.out)
    pipeline.set_progress_bar_config(disable=True)
    rows = shapes.read_parquet(shapes.BUILTIN_DIR / shapes.SHAPE_DATASETS["t2i-shapes-eval"])
    captions, seeds = [r["text"] for r in rows], [r["seed"] for r in rows]
    images = flow_model.sample_images(pipeline, captions, seeds, args.check_steps)
    rate = shapes.colour_match_rate(images, captions)
    coloured = sum(shapes.dominant_colour(image) is not None for image in images)
    grid(images).save(args.out.parent / f"{args.out.name}-samples.png")
    report = {"colour_match_rate": rate, "coloured_images": coloured,
              "train_seconds": round(train_time), "train_cpu_seconds": round(cpu_time),
              "loadavg": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    log(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
