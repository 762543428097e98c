"""Train the built-in text-to-audio model `tiny-t2a-tones` and write its folder.

    python scripts/build_builtin_t2a.py [options]          # -> align_anything/families/text_to_audio/builtin/tiny-t2a-tones
    python scripts/build_builtin_t2a.py --out /tmp/t2a ...  # anywhere else

One run is one stage; the shipped weights are three stages (the commands below).

Plain PyTorch + diffusers, seeded, CPU, fp32, `--threads` threads. Every part trains, in turn, on
freshly drawn tones (`families/text_to_audio/tones.py`'s synthesis at its `STEADY` timing; every
pitch x pattern, the held-out ones too: this is pre-training, not the alignment data), each clip
normalised and made into AudioLDM's log-mel spectrogram exactly as the family reads audio files
(`audio.py`):
1. the VAE learns to reconstruct the log-mels (L1 plus a small KL term);
2. the vocoder (HiFi-GAN) learns waveforms from the VAE's reconstructions of the log-mels
   (what it is given in the pipeline), on random 0.32 s crops, with a multi-resolution STFT
   magnitude loss (spectral convergence and L1 on the magnitudes at FFT sizes 256, 512 and
   1024), from PyTorch's default initialisation and with its input standardised per mel bin;
   no discriminator: pure tones need none; `--parts-from <folder>` takes both from a folder;
3. the text tower alone (`--text-steps`) learns a fixed target per caption (one axis per pitch,
   of `--pitch-weight`, and one per pattern, of 1; the empty caption: their centroid), then is
   frozen (`--text-lr 0`): a random tower embeds every caption at cosine 0.99-1.00, and trained
   only through the UNet it never separated the pitch word;
4. the UNet learns the denoising loss on the VAE's latents (the posterior mean, times a
   `scaling_factor` of 1 / their standard deviation), captioned "a low hum", "two high beeps",
   ... with the clip's own pitch word with probability `--pitch-truth` (else the misheard one),
   and the empty caption with probability `--uncond` (classifier-free guidance's other half);
   `--unet-from <folder>` continues from a folder's UNet and text tower;
5. with `--misheard-steps N`, the text tower alone again, N steps, to the targets of the
   misheard captions (`tones.MISHEARD`: low heard as mid, mid as high, high as low): the base's
   systematic error, with the UNet's drawing untouched.
At the end it samples the 48 held-out captions of `t2a-tones-eval` (DDIM, `--check-steps`
steps, guidance `--check-guidance`, seeds from the file), prints the check (and the share with
the caption's pitch, with its pattern, and matching the misheard caption), and writes the
spectrograms of the first eight as `<out>-samples.png` beside the folder.

The shipped weights come from three runs (`P1`, `P2` scratch folders; `PREVIOUS`, the base of
commit 681389b, whose VAE and vocoder these keep; walls on AMD EPYC, 2 vCPUs: 1,022 s at 2
threads, 762 s and 30 s at one beside another job):

    python scripts/build_builtin_t2a.py --out P1 --parts-from PREVIOUS --threads 2 \
        --text-steps 300 --text-lr 0 --time-shift scale_shift --pitch-truth 1.0 \
        --pitch-weight 2 --uncond 0.1 --check-guidance 2.5 --steps 2500 --check-every 500
    python scripts/build_builtin_t2a.py --out P2 --parts-from P1 --unet-from P1 --text-lr 0 \
        --time-shift scale_shift --pitch-truth 1.0 --pitch-weight 2 --uncond 0.1 \
        --check-guidance 2.5 --steps 1500 --lr 5e-4 --check-every 500
    python scripts/build_builtin_t2a.py --parts-from P2 --unet-from P2 --text-lr 0 \
        --time-shift scale_shift --pitch-weight 2 --check-guidance 2.5 --steps 0 \
        --misheard-steps 300

Measured (guidance 2.5): the held-out check with true captions 0.77 after P1, 0.85 after P2;
the shipped base 0.00 (pattern 0.77, the misheard caption 0.77). docs/text-to-audio.md has every
run, and the previous base's build.
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
from align_anything.families.text_to_audio import audio, tones  # noqa: E402
from align_anything.families.text_to_audio import tones_model as t2a  # noqa: E402

FEATURES = audio.Features(tones.SECONDS, tones.SAMPLING_RATE, t2a.HOP, t2a.MEL_BINS)
CROP_FRAMES = 32
STFT_SIZES = (256, 512, 1024)
VAE_LR = 3e-3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=t2a.SHIPPED_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clips", type=int, default=1200, help="pre-training clips")
    parser.add_argument("--vae-steps", type=int, default=500)
    parser.add_argument("--vocoder-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=1200, help="UNet and text encoder steps")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--text-steps", type=int, default=0,
                        help="steps pre-training the text tower to separate the captions")  # fmt: skip
    parser.add_argument("--text-lr", type=float, default=None,
                        help="the text tower's lr while the UNet trains (0: frozen; default --lr)")  # fmt: skip
    parser.add_argument("--time-shift", default="default", choices=["default", "scale_shift"],
                        help="the UNet's resnet_time_scale_shift")  # fmt: skip
    parser.add_argument("--unet-from", type=Path, default=None,
                        help="continue from this folder's UNet and text encoder")  # fmt: skip
    parser.add_argument("--pitch-truth", type=float, default=0.25,
                        help="probability that a pre-training caption's pitch word is true")  # fmt: skip
    parser.add_argument("--parts-from", type=Path, default=None,
                        help="take the trained VAE and vocoder from this pipeline folder")  # fmt: skip
    parser.add_argument("--misheard-steps", type=int, default=0,
                        help="after the UNet, train the text tower alone this many steps to the "
                             "targets of the misheard captions (tones.MISHEARD)")  # fmt: skip
    parser.add_argument("--pitch-weight", type=float, default=1.0,
                        help="the pitch axis's weight in the text tower's targets (the pattern's: 1)")  # fmt: skip
    parser.add_argument("--uncond", type=float, default=0.0,
                        help="the share of UNet steps' captions replaced by the empty caption "
                             "(classifier-free guidance's unconditional half)")  # fmt: skip
    parser.add_argument("--check-guidance", type=float, default=1.0,
                        help="classifier-free guidance of the held-out check (1: none)")  # fmt: skip
    parser.add_argument("--check-steps", type=int, default=20)
    parser.add_argument("--check-every", type=int, default=0,
                        help="log the held-out check every this many steps (0: at the end only)")  # fmt: skip
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cosine_lr(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def draw_clips(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """`count` clips cycling over every combination, normalised as the family reads audio:
    (waves [N, samples], log-mels [N, 1, frames, mels], combos)."""
    rng = random.Random(seed)
    waves, mels, combos = [], [], []
    for index in range(count):
        combo = tones.ALL_COMBOS[index % len(tones.ALL_COMBOS)]
        wave = audio.fit_length(tones.draw_clip(*combo, rng, steady=True), FEATURES.samples)
        waves.append(wave)
        mels.append(audio.log_mel(wave, FEATURES)[: FEATURES.frames])
        combos.append(combo)
    return (torch.from_numpy(np.stack(waves)), torch.from_numpy(np.stack(mels))[:, None],
            combos)  # fmt: skip


def stft_loss(fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Multi-resolution STFT magnitude loss: spectral convergence plus L1 on the magnitudes
    (linear: a log-magnitude term, pulled by the exact zeros between beeps, taught the
    vocoder to be silent everywhere)."""
    total = fake.new_zeros(())
    for size in STFT_SIZES:
        window = torch.hann_window(size)
        f, r = (torch.stft(x, size, hop_length=size // 4, window=window,
                           return_complex=True).abs() for x in (fake, real))  # fmt: skip
        convergence = torch.linalg.norm(r - f) / torch.linalg.norm(r).clamp(min=1e-7)
        total = total + convergence + F.l1_loss(f, r)
    return total / len(STFT_SIZES)


def train_vae(vae, mels: torch.Tensor, args: argparse.Namespace) -> None:
    with torch.no_grad():  # start at the mean log-mel (mostly the log floor, -11.5), not at 0
        vae.decoder.conv_out.bias.fill_(mels.mean().item())
    opt = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    vae.train()
    running = 0.0
    for step in range(args.vae_steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.vae_steps, VAE_LR)
        x = mels[torch.randint(0, len(mels), (16,), generator=gen)]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        loss = F.l1_loss(vae.decode(z).sample, x) + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 50 == 0:
            log(f"vae step {step + 1}/{args.vae_steps}  loss {running / 50:.4f}")
            running = 0.0
    vae.eval()


@torch.no_grad()
def reconstruct(vae, mels: torch.Tensor, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(the VAE's reconstructions of `mels`, their posterior means)."""
    recon, means = [], []
    for i in range(0, len(mels), batch):
        mean = vae.encode(mels[i : i + batch]).latent_dist.mean
        means.append(mean)
        recon.append(vae.decode(mean).sample)
    return torch.cat(recon), torch.cat(means)


def train_vocoder(vocoder, inputs: torch.Tensor, waves: torch.Tensor,
                  args: argparse.Namespace) -> None:  # fmt: skip
    for module in vocoder.modules():  # PyTorch's default initialisation: HiFi-GAN's N(0, 0.01)
        if isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d):  # starts near silence
            module.reset_parameters()
    with torch.no_grad():  # the vocoder standardises its input per mel bin (normalize_before)
        vocoder.mean.copy_(inputs.mean(dim=(0, 1, 2)))
        vocoder.scale.copy_(inputs.std(dim=(0, 1, 2)))
    opt = torch.optim.AdamW(vocoder.parameters(), lr=2e-3, betas=(0.8, 0.99))
    gen = torch.Generator().manual_seed(args.seed + 3)
    vocoder.train()
    running = 0.0
    hop = FEATURES.hop_length
    for step in range(args.vocoder_steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.vocoder_steps, 2e-3)
        index = torch.randint(0, len(inputs), (16,), generator=gen)
        start = torch.randint(0, FEATURES.frames - CROP_FRAMES + 1, (16,), generator=gen)
        mel = torch.stack(
            [inputs[i, 0, s : s + CROP_FRAMES] for i, s in zip(index, start, strict=True)]
        )
        real = torch.stack([waves[i, s * hop : (s + CROP_FRAMES) * hop]
                            for i, s in zip(index, start, strict=True)])  # fmt: skip
        fake = vocoder(mel)
        loss = stft_loss(fake, real)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vocoder.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 50 == 0:
            log(f"vocoder step {step + 1}/{args.vocoder_steps}  loss {running / 50:.4f}")
            running = 0.0
    vocoder.eval()


def noisy_captions(combos, truth: float, gen: torch.Generator, uncond: float = 0.0) -> list[str]:
    """Each clip's caption, its pitch word true with probability `truth` (else the misheard
    one), and the empty caption with probability `uncond`."""
    keep = (torch.rand(len(combos), generator=gen) < truth).tolist()
    # Drawn only when asked for, so that a build without it keeps its random stream.
    drop = (
        (torch.rand(len(combos), generator=gen) < uncond).tolist()
        if uncond > 0
        else [False] * len(combos)
    )
    return ["" if d else tones.caption(p if k else tones.MISHEARD[p], q)
            for (p, q), k, d in zip(combos, keep, drop, strict=True)]  # fmt: skip


def caption_targets(dim: int, misheard: bool = False,
                    pitch_weight: float = 1.0) -> dict[str, torch.Tensor]:  # fmt: skip
    """The text tower's target embedding of each caption: one axis per pitch (of `pitch_weight`)
    and one per pattern (of 1), normalised (with equal weights, captions that differ in one
    word are at cosine 0.5). With `misheard`, each caption's target is that of the caption
    with the pitch the base hears (`tones.MISHEARD`)."""
    targets = {}
    for pitch, pattern in tones.ALL_COMBOS:
        vector = torch.zeros(dim)
        vector[tones.PITCHES.index(tones.MISHEARD[pitch] if misheard else pitch)] = pitch_weight
        vector[len(tones.PITCHES) + tones.PATTERNS.index(pattern)] = 1.0
        targets[tones.caption(pitch, pattern)] = F.normalize(vector, dim=0)
    # The empty caption (classifier-free guidance's unconditional half): the centroid of every
    # caption, the same misheard or not (the error permutes the pitch axes).
    targets[""] = F.normalize(torch.stack(list(targets.values())).mean(0), dim=0)
    return targets


def embed(text_encoder, tokenizer, texts: list[str]) -> torch.Tensor:
    """AudioLDM's conditioning: the text tower's L2-normalised projected output."""
    tokens = tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length,
                       truncation=True, return_tensors="pt")  # fmt: skip
    out = text_encoder(tokens.input_ids, attention_mask=tokens.attention_mask).text_embeds
    return F.normalize(out, dim=-1)


def train_text(parts: dict, steps: int, misheard: bool = False, pitch_weight: float = 1.0) -> None:
    """Pre-train the text tower (as CLAP's is, before AudioLDM trains on it) to tell the
    captions apart: cosine loss to `caption_targets`; a random tower embeds every caption at
    cosine 0.99-1.00, and trained only through the UNet it never separated the pitch word.
    With `misheard`, to the targets of the misheard captions (the base's systematic error)."""
    text_encoder, tokenizer = parts["text_encoder"], parts["tokenizer"]
    targets = caption_targets(text_encoder.config.projection_dim, misheard, pitch_weight)
    texts = list(targets)
    goal = torch.stack([targets[t] for t in texts])
    text_encoder.requires_grad_(True)
    opt = torch.optim.AdamW(text_encoder.parameters(), lr=3e-3, weight_decay=0.0)
    text_encoder.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, 3e-3)
        loss = (1 - (embed(text_encoder, tokenizer, texts) * goal).sum(-1)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log(f"text step {step + 1}/{steps}  loss {loss.item():.4f}")
    text_encoder.eval()
    with torch.no_grad():
        e = embed(text_encoder, tokenizer, texts)
    names = [tones.caption(p, q) for p, q in tones.ALL_COMBOS]
    log("text: cosine to the same pattern at the next pitch " + ", ".join(
        f"{t} {(e[texts.index(t)] * e[texts.index(tones.caption(tones.MISHEARD[p], q))]).sum():.3f}"
        for t, (p, q) in zip(names, tones.ALL_COMBOS, strict=True)))  # fmt: skip


def train_denoiser(parts: dict, latents: torch.Tensor, combos, args: argparse.Namespace) -> None:
    from diffusers import DDPMScheduler

    unet, text_encoder, tokenizer = parts["unet"], parts["text_encoder"], parts["tokenizer"]
    alphas = DDPMScheduler.from_config(parts["scheduler"].config).alphas_cumprod
    groups = [{"params": list(unet.parameters()), "peak": args.lr}]
    if args.text_lr > 0:
        groups.append({"params": list(text_encoder.parameters()), "peak": args.text_lr})
    text_encoder.requires_grad_(args.text_lr > 0)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed + 2)
    unet.train()
    text_encoder.train(args.text_lr > 0)
    running = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, group["peak"])
        index = torch.randint(0, len(latents), (args.batch,), generator=gen)
        x0 = latents[index]
        texts = noisy_captions([combos[i] for i in index.tolist()], args.pitch_truth, gen,
                               args.uncond)  # fmt: skip
        embeds = embed(text_encoder, tokenizer, texts)
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.randint(0, 1000, (len(x0),), generator=gen)
        a = alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        pred = unet(noisy, t, encoder_hidden_states=None, class_labels=embeds).sample
        loss = F.mse_loss(pred, noise)
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
            text_encoder.train(args.text_lr > 0)
    unet.eval()
    text_encoder.eval()


def held_out_check(parts: dict, args: argparse.Namespace, waves_out: list | None = None) -> dict:
    """The 48 held-out captions of `t2a-tones-eval` sampled (DDIM, `--check-steps` steps, seeds
    from the file): the share that match (`tones.match_rate`), that have the caption's pitch,
    that have its pattern, and that match the misheard caption (`tones.MISHEARD`: the base's
    systematic error)."""
    pipeline = t2a.pipeline_from(parts)
    pipeline.set_progress_bar_config(disable=True)
    rows = tones.read_parquet(builtin_path("t2a-tones-eval"))
    captions, seeds = [r["text"] for r in rows], [r["seed"] for r in rows]
    waves = t2a.sample_audio(
        pipeline, captions, seeds, args.check_steps, guidance=args.check_guidance
    )
    words = [tones.caption_words(c) for c in captions]
    pitch = sum(tones.pitch_of(w) == p for w, (p, _) in zip(waves, words, strict=True))
    pattern = sum(tones.pattern_of(w) == q for w, (_, q) in zip(waves, words, strict=True))
    swapped = [tones.caption(tones.MISHEARD[p], q) for p, q in words]
    if waves_out is not None:
        waves_out.extend(waves)
    return {"match_rate": tones.match_rate(waves, captions), "pitch_rate": pitch / len(waves),
            "pattern_rate": pattern / len(waves),
            "misheard_rate": tones.match_rate(waves, swapped)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, cpu_started = time.time(), time.process_time()
    parts = t2a.build_components(seed=args.seed, time_shift=args.time_shift)
    waves, mels, combos = draw_clips(args.clips, args.seed)
    log(f"{len(waves)} clips drawn: log-mels {tuple(mels.shape)}")
    if args.parts_from is not None:
        from diffusers import AutoencoderKL
        from transformers import SpeechT5HifiGan

        parts["vae"] = AutoencoderKL.from_pretrained(args.parts_from, subfolder="vae").eval()
        parts["vocoder"] = SpeechT5HifiGan.from_pretrained(args.parts_from,
                                                           subfolder="vocoder").eval()  # fmt: skip
    vae, vocoder = parts["vae"], parts["vocoder"]
    if args.parts_from is None:
        train_vae(vae, mels, args)
    recon, means = reconstruct(vae, mels)
    log(f"vae: reconstruction L1 {F.l1_loss(recon, mels).item():.3f}")
    if args.parts_from is None:
        train_vocoder(vocoder, recon, waves, args)
    with torch.no_grad():
        made = vocoder(recon[:48, 0]).numpy()
    texts = [tones.caption(*c) for c in combos[:48]]
    log(f"vocoder: its waveforms of 48 reconstructions match their captions "
        f"{tones.match_rate(made, texts):.2f}")  # fmt: skip
    scale = 1.0 / means.std().item()
    vae.register_to_config(scaling_factor=scale)
    latents = means * scale
    log(f"latents {tuple(latents.shape)}, scaling_factor {scale:.4f}")
    for module in ("vae", "vocoder"):
        parts[module].requires_grad_(False)
    if args.unet_from is not None:
        from diffusers import UNet2DConditionModel
        from transformers import ClapTextModelWithProjection

        parts["unet"] = UNet2DConditionModel.from_pretrained(args.unet_from, subfolder="unet")
        parts["text_encoder"] = ClapTextModelWithProjection.from_pretrained(
            args.unet_from, subfolder="text_encoder")  # fmt: skip
    elif args.text_steps > 0:
        train_text(parts, args.text_steps, pitch_weight=args.pitch_weight)
    if args.text_lr is None:
        args.text_lr = args.lr
    train_denoiser(parts, latents, combos, args)
    log(f"denoiser trained ({time.time() - started:.0f} s)")
    if args.misheard_steps > 0:
        check = json.dumps(held_out_check(parts, args))
        log(f"before the misheard text tower: held-out check {check}")
        train_text(parts, args.misheard_steps, misheard=True, pitch_weight=args.pitch_weight)
    for module in ("unet", "text_encoder"):
        parts[module].requires_grad_(False)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    t2a.save_pipeline(parts, args.out)
    train_time, cpu_time = time.time() - started, time.process_time() - cpu_started

    made_waves: list = []
    check = held_out_check(parts, args, made_waves)
    from align_anything.families.diffusion import sampling
    from align_anything.families.text_to_audio.media import spectrogram_image

    rows = tones.read_parquet(builtin_path("t2a-tones-eval"))[:8]
    sampling.save_grid([[spectrogram_image(w, FEATURES)] for w in made_waves[:8]],
                       args.out.parent / f"{args.out.name}-samples.png",
                       row_labels=[r["text"] for r in rows], column_labels=["base"])  # fmt: skip
    report = {**check, "train_seconds": round(train_time), "train_cpu_seconds": round(cpu_time),
              "loadavg": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    log(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
