"""Diffusion-DPO: align_anything against the same work in a plain PyTorch + diffusers loop, and
what the latent cache saves.

    python benchmarks/diffusion_dpo.py                          # tiny-t2i-shapes, 20 steps x 16 pairs
    python benchmarks/diffusion_dpo.py --steps 40 --repeats 3 --zero z0 z2 --threads 2

1. Steps/s and peak RSS of Diffusion-DPO on the built-in model and pairs: align_anything through
   its real entry point (`task=diffusion_dpo deepspeed=z0`, and `z2` as `make train-t2i` runs
   it; one process, fp32, a frozen copy of the UNet as the reference, no sample grid or pixel
   check) against `benchmarks/diffusion_dpo_plain.py` (the prototype the task was checked
   against: the UNet, its deep copy, AdamW and the loss in a bare loop, nothing between the loop
   and the models). Both take the same batch of pairs, steps, learning rate, clipping and
   optimizer; each runs in its own process (its peak RSS is its own, from `wait4`), interleaved
   over the repeats. Time is the step loop alone (ours: summary.json's `train_seconds`; the
   plain loop: its `train_s`); both processes also evaluate before and after, which the RSS
   includes. One torch thread per process by default (`--threads`): a step of the tiny model
   is short, and on a shared machine two OpenMP threads of one process that wait on each other
   while the other is descheduled made the same step cost 4-30x its CPU time at random, which
   decided the ratio more than either side's code did.
3. Paired, in one process per ZeRO stage (`--paired-steps`): align_anything's real optimizer
   step (`training.loop.train_step` under the engine) and the plain loop's step (`dpo_step` on
   a deep copy of the same UNet, its own frozen copy and torch AdamW), alternating step by
   step on the same batch (the pairs, noise and timesteps of ours). The losses agree step by
   step (the run stops if they do not), so both do the same work; the CPU time of each step
   (`time.process_time`) compares them under the same load.
2. The latent cache: one step's images and captions encoded through the VAE and the text
   encoder (PNG decoding and the centre crop included), as a loop that encodes online does at
   every step, against reading the same step's latents and embeddings from the cache; and the
   one-off cost of building the cache (the first align_anything run's start-up line).

Prints a markdown table and one JSON line; writes it to --out when given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

from common import child_env, interleave, run_child  # noqa: E402

PLAIN = Path(__file__).resolve().parent / "diffusion_dpo_plain.py"
DATA = "t2i-shapes-pref"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-t2i-shapes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="pairs per step")
    parser.add_argument("--beta", type=float, default=1000.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--zero", nargs="+", default=["z0", "z2"], help="align_anything's presets")
    parser.add_argument("--cache-steps", type=int, default=5, help="steps timed in part 2")
    parser.add_argument("--paired-steps", type=int, default=20, help="steps of part 3 (0: none)")
    parser.add_argument("--out", type=Path, default=None)
    # Internal: part 3's child process (one ZeRO stage), writing its JSON to --out.
    parser.add_argument("--paired-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class Record:
    """One run: its step-loop seconds, peak RSS and first logged loss."""

    def __init__(self, seconds: float, peak_rss_mib: float, first_loss: float, note: str = ""):
        self.seconds, self.peak_rss_mib, self.first_loss, self.note = (
            seconds, peak_rss_mib, first_loss, note,
        )  # fmt: skip


def ours_overrides(
    args: argparse.Namespace, out: Path, cache: Path, stage: str = "z0"
) -> list[str]:
    """align_anything's side of the comparison: the plain loop's work (`plain_command`) as
    overrides of `task=diffusion_dpo`, under the DeepSpeed preset `stage`."""
    return [
        "task=diffusion_dpo", f"deepspeed={stage}", f"model.name_or_path={args.model}",
        f"data.path={DATA}", "train.precision=fp32", f"train.max_steps={args.steps}",
        f"train.per_device_batch_size={args.batch}", f"train.learning_rate={args.lr}",
        "train.lr_scheduler=constant", "train.warmup_ratio=0.0", "train.max_grad_norm=1.0",
        "train.weight_decay=0.0", f"diffusion_dpo.beta={args.beta}",
        "diffusion_dpo.loss_type=sigmoid", "diffusion_dpo.check_samples=0",
        "logging.sample_prompts=[]", "data.max_eval_samples=16", f"data.cache_dir={cache}",
        "logging.backends=[jsonl]", f"output_dir={out}",
    ]  # fmt: skip


def plain_command(args: argparse.Namespace, model_path: str, out: Path) -> list[str]:
    """The plain loop (`diffusion_dpo_plain.py`) on the same work: constant rate, clipping at
    1.0 and no weight decay are its defaults."""
    return [
        sys.executable, str(PLAIN), "--task", "dpo", "--model", model_path,
        "--steps", str(args.steps), "--batch", str(args.batch), "--beta", str(args.beta),
        "--lr", str(args.lr), "--sample-steps", "1", "--log-every", "1000",
        "--out", str(out / "result.json"),
    ]  # fmt: skip


def run_ours(args: argparse.Namespace, workdir: Path, cache: Path, stage: str) -> Record:
    out = Path(tempfile.mkdtemp(prefix="ours-", dir=workdir))
    overrides = ours_overrides(args, out, cache, stage)
    command = [sys.executable, "-m", "align_anything.train", *overrides]
    rss = run_child(command, env=child_env(args.threads), log=out / "run.log")
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    log = (out / "run.log").read_text()
    built = re.search(r"data\.path: (encoded .*? in [0-9.]+ s)", log)
    first = next(m for m in steps if "phase" not in m)
    return Record(float(summary["train_seconds"]), rss, float(first["loss"]),
                  built.group(1) if built else "")  # fmt: skip


def run_plain(args: argparse.Namespace, workdir: Path, model_path: str) -> Record:
    out = Path(tempfile.mkdtemp(prefix="plain-", dir=workdir))
    command = plain_command(args, model_path, out)
    rss = run_child(command, env=child_env(args.threads), log=out / "run.log")
    result = json.loads((out / "result.json").read_text())
    return Record(float(result["train_s"]), rss, float("nan"))


def paired_child(args: argparse.Namespace) -> None:
    """Part 3 for one ZeRO stage (`--paired-child`): align_anything's real step and the plain
    loop's, alternating on the same batches; writes per-step losses and CPU seconds to --out."""
    import copy
    from contextlib import ExitStack

    import torch
    from diffusion_dpo_plain import dpo_step

    from align_anything.config import load_config
    from align_anything.tasks import TASKS
    from align_anything.training import loop, setup

    steps = args.steps = args.paired_steps
    out = Path(tempfile.mkdtemp(prefix="paired-"))
    cfg = load_config(ours_overrides(args, out, args.cache, args.paired_child))
    spec = TASKS[cfg.task]
    rows: list[dict[str, float]] = []
    with ExitStack() as stack:
        run = setup.setup(cfg, spec, stack)
        task, source = spec.build(run)
        # The plain side starts from the same weights; its reference is its own frozen copy.
        unet = copy.deepcopy(run.policy.module).train().requires_grad_(True)
        reference = copy.deepcopy(unet).requires_grad_(False).eval()
        optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=0.0)
        alphas = run.model.parts.noise_scheduler.alphas_cumprod
        run.policy.train()
        for step in range(steps):
            batch = source.step(step).batches[0]  # the batch train_step draws (seeded by step)
            started = time.process_time()
            result = loop.train_step(run, task, source)
            ours_cpu = time.process_time() - started
            started = time.process_time()
            plain = dpo_step(
                unet, reference, optimizer, batch.chosen["latents"], batch.rejected["latents"],
                batch.chosen["prompt_embeds"], batch.draw.noise, batch.draw.timesteps, alphas,
                beta=args.beta, max_grad_norm=1.0, lr=args.lr,
            )  # fmt: skip
            plain_cpu = time.process_time() - started
            ours_loss = result.sums["loss"] / result.items
            rows.append({"ours_loss": ours_loss, "plain_loss": plain["loss"],
                         "ours_cpu_s": ours_cpu, "plain_cpu_s": plain_cpu})  # fmt: skip
            if abs(ours_loss - plain["loss"]) > 1e-3 * max(1.0, abs(plain["loss"])):
                raise SystemExit(f"step {step}: losses differ, ours {ours_loss} plain {plain}")
    args.out.write_text(json.dumps({"stage": args.paired_child, "steps": rows}))


def run_paired(args: argparse.Namespace, stage: str, cache: Path, workdir: Path) -> dict:
    """Part 3 for `stage` in its own process: medians of the per-step CPU seconds (the first
    step, a warm-up, left out) and the largest relative difference of the two losses."""
    result_file = workdir / f"paired-{stage}.json"
    command = [
        sys.executable, __file__, "--paired-child", stage, "--cache", str(cache),
        "--out", str(result_file), "--model", args.model, "--batch", str(args.batch),
        "--beta", str(args.beta), "--lr", str(args.lr), "--paired-steps", str(args.paired_steps),
    ]  # fmt: skip
    run_child(command, env=child_env(args.threads), log=workdir / f"paired-{stage}.log")
    rows = json.loads(result_file.read_text())["steps"]
    ours = statistics.median(r["ours_cpu_s"] for r in rows[1:])
    plain = statistics.median(r["plain_cpu_s"] for r in rows[1:])
    worst = max(abs(r["ours_loss"] - r["plain_loss"]) / max(1.0, abs(r["plain_loss"]))
                for r in rows)  # fmt: skip
    return {"ours_cpu_s_per_step": ours, "plain_cpu_s_per_step": plain,
            "speed_ours_over_plain": plain / ours, "max_rel_loss_diff": worst}  # fmt: skip


def cache_saving(
    model: str, *, batch: int, steps: int, threads: int | None = None
) -> dict[str, float]:
    """Seconds per step to encode a step's 2 x batch images and batch captions through the VAE
    and the text encoder, against reading them from the latent cache (median over `steps`), on
    `threads` torch threads (the training runs' count; None: torch's default)."""
    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)

    from align_anything.families import diffusion
    from align_anything.families.diffusion.latents import (
        ensure_latent_cache,
        latent_cache_folder,
        open_latent_cache,
    )
    from align_anything.families.text_to_image import media
    from align_anything.families.text_to_image.images import center_crop, read_image_source

    info = diffusion.inspect_pipeline(model)
    parts = diffusion.load_frozen_parts(info, dtype=torch.float32)
    source = read_image_source(DATA, "pairs")
    resolution = info.default_resolution
    root = Path(tempfile.mkdtemp(prefix="latents-"))
    key = media.latent_key_parts(source, resolution=resolution, encoder="benchmark")
    start = time.perf_counter()
    ensure_latent_cache(
        source, key, root=root, resolution=resolution, refs=media.image_refs(source),
        prepare=media.cropper(resolution), encode_media=parts.encode_images,
        encode_prompts=parts.encode_prompts, batch_size=32,
    )  # fmt: skip
    build = time.perf_counter() - start
    cached = open_latent_cache(latent_cache_folder(root, key))
    online, reads = [], []
    for step in range(steps):
        rows = [(step * batch + i) % len(source.items) for i in range(batch)]
        start = time.perf_counter()
        with torch.no_grad():
            items = [source.items[r] for r in rows]
            refs = [ref for it in items for ref in (it.chosen, it.rejected)]
            pixels = np.stack([center_crop(ref.read(), resolution).pixels for ref in refs])
            parts.encode_images(torch.from_numpy(pixels))
            parts.encode_prompts([it.caption for it in items])
        online.append(time.perf_counter() - start)
        start = time.perf_counter()
        cached.batch(rows)
        reads.append(time.perf_counter() - start)
    return {
        "encode_online_s_per_step": statistics.median(online),
        "cache_read_s_per_step": statistics.median(reads),
        "cache_build_s": build,
        "cache_images": 2 * len(source.items),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.paired_child:
        paired_child(args)
        return 0
    from align_anything.families.zoo import resolve_model_path

    model_path = resolve_model_path(args.model)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="diffusion-dpo-bench-") as tmp:
        workdir, cache = Path(tmp), Path(tmp) / "cache"
        runners = {f"align_anything {stage}": (lambda s=stage: run_ours(args, workdir, cache, s))
                   for stage in args.zero}  # fmt: skip
        runners["plain loop"] = lambda: run_plain(args, workdir, model_path)
        records = interleave(runners, args.repeats)
        paired = {stage: run_paired(args, stage, cache, workdir)
                  for stage in (args.zero if args.paired_steps > 1 else [])}  # fmt: skip
    saving = cache_saving(
        args.model, batch=args.batch, steps=args.cache_steps, threads=args.threads
    )
    ours, plain = records[f"align_anything {args.zero[0]}"], records["plain loop"]
    rows = ["| variant | steps/s | peak RSS MiB | speed this/plain | RSS this/plain |",
            "|---|---|---|---|---|"]  # fmt: skip
    ours_s = statistics.median(r.seconds for r in ours)
    plain_s = statistics.median(r.seconds for r in plain)
    plain_rss = statistics.median(r.peak_rss_mib for r in plain)
    result: dict = {"steps": args.steps, "batch_pairs": args.batch, "model": args.model,
                    "threads": args.threads, "loadavg_start": load, "paired": paired}  # fmt: skip
    for name, runs in records.items():
        seconds = statistics.median(r.seconds for r in runs)
        rss = statistics.median(r.peak_rss_mib for r in runs)
        result[name] = {"steps_per_s": args.steps / seconds, "peak_rss_mib": rss}
        rows.append(
            f"| {name} | {args.steps / seconds:.3f} | {rss:.0f} | "
            f"{'—' if runs is plain else f'{plain_s / seconds:.2f}x'} | "
            f"{'—' if runs is plain else f'{rss / plain_rss:.2f}'} |"
        )
    step_s = ours_s / args.steps
    result["latent_cache"] = {**saving, "dpo_step_s": step_s,
                              "cache_build_first_run": ours[0].note}  # fmt: skip
    result["loadavg_end"] = os.getloadavg()[0]
    print("\n".join(rows))
    for stage, figures in paired.items():
        print(
            f"paired, {stage}: align_anything {figures['ours_cpu_s_per_step']:.3f} CPU s/step, "
            f"plain loop {figures['plain_cpu_s_per_step']:.3f}: speed ours/plain "
            f"{figures['speed_ours_over_plain']:.2f}x (losses agree to "
            f"{figures['max_rel_loss_diff']:.1e} relative over {args.paired_steps} steps)"
        )
    print(
        f"latent cache: encoding a step's {2 * args.batch} images and {args.batch} captions "
        f"online takes {saving['encode_online_s_per_step']:.3f} s "
        f"({saving['encode_online_s_per_step'] / step_s:.0%} of a DPO step of {step_s:.3f} s); "
        f"reading them from the cache {saving['cache_read_s_per_step'] * 1e3:.2f} ms; building "
        f"the cache of {saving['cache_images']} images once: {saving['cache_build_s']:.1f} s"
    )
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
