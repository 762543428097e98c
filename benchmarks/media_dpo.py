"""Text-to-video and text-to-audio Diffusion-DPO: align_anything's optimizer step against a
plain PyTorch + diffusers loop on the same video or audio model and batch.

    python benchmarks/media_dpo.py                               # tiny-t2v-shapes, 8 pairs, z0 and z2
    python benchmarks/media_dpo.py --model tiny-random-wan --data PAIRS --num-frames 9 --steps 12
    python benchmarks/media_dpo.py --medium audio --model tiny-random-audioldm --data PAIRS

Paired, in one process per ZeRO stage, at one torch thread per process (`--threads`; the
reason is `benchmarks/diffusion_dpo.py`'s: on a shared machine two OpenMP threads of one
process waiting on each other decide the ratio more than the code does): align_anything's real
step (`training.loop.train_step` under the engine, `task=diffusion_dpo`, fp32, the reference a
frozen copy) and the plain loop's step (`plain_step` below: a deep copy of the same denoiser,
its own frozen copy, torch AdamW, the noise added with diffusers' scheduler, the denoiser called
as the kind's pipeline calls it, the loss written out), alternating step by step on the same
batch (the pairs, noise and timesteps of ours, as 5-D video latents [B, C, F, h, w] or 4-D
spectrogram latents [B, C, frames, mels]). The
losses agree step by step (the run stops if they do not), so both do the same work; the CPU
time of each step (`time.process_time`, the first step a warm-up left out) compares them
under the same load. Prints a markdown table and one JSON line; writes it to --out when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from common import child_env, run_child  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--medium", choices=("video", "audio"), default="video")
    parser.add_argument("--model", default=None, help="default: the medium's built-in model")
    parser.add_argument("--data", default=None, help="default: the medium's built-in pairs")
    parser.add_argument("--num-frames", type=int, default=9, help="video")
    parser.add_argument("--fps", type=float, default=8.0, help="video")
    parser.add_argument("--audio-seconds", type=float, default=None, help="audio")
    parser.add_argument("--steps", type=int, default=16, help="paired steps per stage")
    parser.add_argument("--batch", type=int, default=8, help="pairs per step")
    parser.add_argument("--beta", type=float, default=1000.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    parser.add_argument("--zero", nargs="+", default=["z0", "z2"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one stage's process
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    model, data = BUILT_IN[args.medium]
    args.model, args.data = args.model or model, args.data or data
    if args.data is None:
        parser.error(f"--data: give {args.medium} preference pairs (prompt, chosen, rejected)")
    return args


# Each medium's built-in model and preference pairs.
BUILT_IN = {"video": ("tiny-t2v-shapes", "t2v-shapes-pref"),
            "audio": ("tiny-t2a-tones", "t2a-tones-pref")}  # fmt: skip


def medium_overrides(args: argparse.Namespace) -> list[str]:
    """The medium's data settings; the held-out set is the pairs themselves (the task's default
    is the built-in image pairs, and the paired steps never evaluate)."""
    if args.medium == "video":
        clips = [f"data.num_frames={args.num_frames}", f"data.fps={args.fps}"]
        if args.model == BUILT_IN["video"][0]:  # a Wan folder: no sample size of its own
            clips.append("data.resolution=32")
    else:
        clips = [f"data.audio_seconds={args.audio_seconds}"] if args.audio_seconds else []
    return [*clips, f"data.eval_path={args.data}"]


def overrides(args: argparse.Namespace, stage: str, out: Path) -> list[str]:
    return [
        "task=diffusion_dpo", f"deepspeed={stage}", f"model.name_or_path={args.model}",
        f"data.path={args.data}", *medium_overrides(args),
        "train.precision=fp32", f"train.max_steps={args.steps}",
        f"train.per_device_batch_size={args.batch}", f"train.learning_rate={args.lr}",
        "train.lr_scheduler=constant", "train.warmup_ratio=0.0", "train.max_grad_norm=1.0",
        "train.weight_decay=0.0", f"diffusion_dpo.beta={args.beta}",
        "diffusion_dpo.loss_type=sigmoid", "diffusion_dpo.check_samples=0",
        "logging.sample_prompts=[]", "data.max_eval_samples=8", f"data.cache_dir={args.cache}",
        "logging.backends=[jsonl]", f"output_dir={out}",
    ]  # fmt: skip


def plain_step(denoiser, reference, optimizer, info, scheduler, chosen, rejected, draw, *,
               beta: float, max_grad_norm: float) -> float:  # fmt: skip
    """One Diffusion-DPO step written out with torch and diffusers alone: both clips of each
    pair noised with the pair's one draw (`scheduler.add_noise`, or the flow interpolation),
    the denoiser called as the kind's pipeline calls it, per-sample MSE, the sigmoid loss,
    backward, clipping, AdamW."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    x0 = torch.cat([chosen["latents"], rejected["latents"]]).float()
    embeds = torch.cat([chosen["prompt_embeds"], rejected["prompt_embeds"]])
    noise = torch.cat([draw.noise, draw.noise])
    t = torch.cat([draw.timesteps, draw.timesteps])
    if info.flow:
        sigma = torch.cat([draw.sigmas, draw.sigmas]).view(-1, *[1] * (x0.dim() - 1))
        noisy, target = (1 - sigma) * x0 + sigma * noise, noise - x0
    else:
        noisy = scheduler.add_noise(x0, noise, t)
        target = noise if info.prediction == "epsilon" else scheduler.get_velocity(x0, noise, t)

    def mse(model):
        if info.kind == "wan":
            out = model(hidden_states=noisy, timestep=t, encoder_hidden_states=embeds).sample
        elif info.kind == "audioldm":  # the CLAP embedding as the class label, no cross attention
            out = model(noisy, t, encoder_hidden_states=None, class_labels=embeds).sample
        else:
            out = model(noisy, t, encoder_hidden_states=embeds).sample
        return F.mse_loss(out.float(), target, reduction="none").flatten(1).mean(1)

    theta_w, theta_l = mse(denoiser).chunk(2)
    with torch.no_grad():
        ref_w, ref_l = mse(reference).chunk(2)
    logits = (ref_w - ref_l) - (theta_w - theta_l)
    loss = -F.logsigmoid(beta * logits).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(denoiser.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


def child(args: argparse.Namespace) -> None:
    import copy
    from contextlib import ExitStack

    import torch

    from align_anything.config import load_config
    from align_anything.tasks import TASKS
    from align_anything.training import loop, setup

    out = Path(tempfile.mkdtemp(prefix=f"{args.medium}-paired-"))
    cfg = load_config(overrides(args, args.child, out))
    spec = TASKS[cfg.task]
    rows = []
    with ExitStack() as stack:
        run = setup.setup(cfg, spec, stack)
        task, source = spec.build(run)
        # UNet3DConditionModel's temporal convolutions hold dropout 0.1 (fixed in diffusers'
        # blocks): each side would drop different activations and the losses could not agree.
        # Off on both sides, so that both do the same arithmetic.
        for module in run.policy.module.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        denoiser = copy.deepcopy(run.policy.module).train().requires_grad_(True)
        reference = copy.deepcopy(denoiser).requires_grad_(False).eval()
        optimizer = torch.optim.AdamW(denoiser.parameters(), lr=args.lr, weight_decay=0.0)
        info, scheduler = run.model.info, run.model.parts.noise_scheduler
        run.policy.train()
        for step in range(args.steps):
            batch = source.step(step).batches[0]  # the batch train_step draws (seeded by step)
            started = time.process_time()
            result = loop.train_step(run, task, source)
            ours_cpu = time.process_time() - started
            started = time.process_time()
            plain = plain_step(denoiser, reference, optimizer, info, scheduler, batch.chosen,
                               batch.rejected, batch.draw, beta=args.beta, max_grad_norm=1.0)  # fmt: skip
            plain_cpu = time.process_time() - started
            ours = result.sums["loss"] / result.items
            rows.append({"ours_loss": ours, "plain_loss": plain, "ours_cpu_s": ours_cpu,
                         "plain_cpu_s": plain_cpu})  # fmt: skip
            if abs(ours - plain) > 1e-3 * max(1.0, abs(plain)):
                raise SystemExit(f"step {step}: losses differ, ours {ours} plain {plain}")
    args.out.write_text(json.dumps({"stage": args.child, "steps": rows,
                                    "latent_shape": list(batch.chosen["latents"].shape)}))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    load = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"{args.medium}-dpo-bench-") as tmp:
        workdir = Path(tmp)
        for stage in args.zero:
            out = workdir / f"{stage}.json"
            command = [sys.executable, __file__, "--child", stage, "--cache", str(workdir / "cache"),
                       "--out", str(out), "--medium", args.medium, "--model", args.model,
                       "--data", args.data, "--num-frames", str(args.num_frames),
                       "--fps", str(args.fps),
                       *(["--audio-seconds", str(args.audio_seconds)] if args.audio_seconds else []),
                       "--steps", str(args.steps), "--batch", str(args.batch),
                       "--beta", str(args.beta), "--lr", str(args.lr)]  # fmt: skip
            run_child(command, env=child_env(args.threads), log=workdir / f"{stage}.log")
            data = json.loads(out.read_text())
            rows = data["steps"][1:]  # the first step builds kernels: a warm-up
            ours = statistics.median(r["ours_cpu_s"] for r in rows)
            plain = statistics.median(r["plain_cpu_s"] for r in rows)
            worst = max(abs(r["ours_loss"] - r["plain_loss"]) / max(1.0, abs(r["plain_loss"]))
                        for r in data["steps"])  # fmt: skip
            results[stage] = {"ours_cpu_s_per_step": ours, "plain_cpu_s_per_step": plain,
                              "speed_ours_over_plain": plain / ours, "max_rel_loss_diff": worst,
                              "latent_shape": data["latent_shape"]}  # fmt: skip
    print("| preset | align_anything CPU s/step | plain loop CPU s/step | speed ours/plain | "
          "losses agree to |\n|---|---|---|---|---|")  # fmt: skip
    for stage, r in results.items():
        print(f"| {stage} | {r['ours_cpu_s_per_step']:.3f} | {r['plain_cpu_s_per_step']:.3f} | "
              f"{r['speed_ours_over_plain']:.2f}x | {r['max_rel_loss_diff']:.1e} |")  # fmt: skip
    summary = {"medium": args.medium, "model": args.model, "batch_pairs": args.batch, "steps": args.steps,
               "threads": args.threads, "loadavg_start": load, "loadavg_end": os.getloadavg(),
               "stages": results}  # fmt: skip
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
