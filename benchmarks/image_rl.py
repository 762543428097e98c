"""Online RL of a text-to-image model (DiffusionNFT, Flow-GRPO): align_anything's step against
the same step in a plain PyTorch + diffusers loop, paired in one process.

    python benchmarks/image_rl.py                                  # both algorithms, z0 and z2
    python benchmarks/image_rl.py --algorithms diffusion_nft --zero z0 --steps 20 --out r.json

For each algorithm and ZeRO stage, one process (one torch thread by default, `--threads`) runs
align_anything's real optimizer step (`training.loop.train_step` under the engine, then the
task's `after_step`: `task=diffusion_nft` or `task=flow_grpo` on the built-in
`tiny-t2i-shapes-flow` and captions `t2i-shapes`, fp32, 4 prompts x G = 8 images per step,
10-step rollouts, learning rate 1e-4 constant, clipping at 1.0, no weight decay) and the plain
loop's step (`image_rl_plain.py`: diffusers' transformer, VAE, text encoders and scheduler
with the papers' maths, its own transformer loaded from the same folder, torch AdamW),
alternating step by step, each side first every other step. Every step of each side is whole:
the round (sampling, decoding, the colour reward, advantages), the loss, backward, the update
(NFT: and the old policy's average). The plain side takes from ours only the round's prompts
(ours' seeded choice, `ImageRounds.round_prompts`), hence its captions and image keys p·G + j,
from which it draws the same seeded noise (`forward.draw_seed`'s seeds: each image's initial
noise, Flow-GRPO's step noise, NFT's training noise and noise level); it samples, decodes,
scores and trains by itself, every denoising step trained (`train_fraction` 1). Per step: both
losses (the run stops when they differ by more than `--tolerance`, 1e-5, relative to
max(1, |loss|)), the gradient norms before clipping, the rollouts' largest latent difference,
whether the rewards agree, ours' round being the plain side's, and the CPU time of each side's
step (`time.process_time`: both under the same load). The speed is the ratio of the medians of
the per-round CPU seconds per step (the first round, a warm-up, left out): plain / ours, > 1
when ours is faster.

Prints a markdown table and one JSON line; writes it to --out when given.
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
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout, with or without an installed package

from common import child_env, run_child  # noqa: E402

ALGORITHMS = ("diffusion_nft", "flow_grpo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-t2i-shapes-flow")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--zero", nargs="+", default=["z0", "z2"], help="align_anything's presets")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="G images per prompt")
    parser.add_argument("--rollout-steps", type=int, default=10)
    parser.add_argument("--num-iterations", type=int, default=1, help="optimizer steps per round")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--kl-beta", type=float, default=0.04, help="flow_grpo.beta")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="losses' relative gap")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--out", type=Path, default=None)
    # Internal: one (algorithm, stage) child process, writing its JSON to --out.
    parser.add_argument("--paired-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def ours_overrides(
    args: argparse.Namespace, algorithm: str, out: Path, cache: Path, stage: str = "z0"
) -> list[str]:
    """align_anything's side: `task=<algorithm>` with the plain loop's settings."""
    overrides = [
        f"task={algorithm}", f"deepspeed={stage}", f"model.name_or_path={args.model}",
        "train.precision=fp32", f"train.max_steps={args.steps}",
        f"train.per_device_batch_size={args.prompts * args.group}",
        f"train.learning_rate={args.lr}", "train.lr_scheduler=constant",
        "train.warmup_ratio=0.0", "train.max_grad_norm=1.0", "train.weight_decay=0.0",
        f"{algorithm}.num_generations={args.group}",
        f"{algorithm}.rollout_steps={args.rollout_steps}",
        f"{algorithm}.num_iterations={args.num_iterations}", f"{algorithm}.check_samples=0",
        "logging.sample_prompts=[]", "logging.completions_every=0", "data.max_eval_samples=16",
        f"data.cache_dir={cache}", "logging.backends=[jsonl]", f"output_dir={out}",
    ]  # fmt: skip
    if algorithm == "flow_grpo":
        overrides.append(f"flow_grpo.beta={args.kl_beta}")
    return overrides


class PlainSide:
    """The plain loop's state beside ours (`image_rl_plain`): its own transformer, a frozen
    copy (NFT: the old policy; Flow-GRPO: the KL reference), AdamW, the current round."""

    def __init__(self, args: argparse.Namespace, algorithm: str, model_path: str,
                 section) -> None:  # fmt: skip
        import copy

        import image_rl_plain as plain
        import torch

        self.plain, self.args, self.algorithm, self.section = plain, args, algorithm, section
        self.pipeline = plain.Pipeline(model_path, args.rollout_steps)
        self.model = self.pipeline.transformer.train().requires_grad_(True)
        self.frozen = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.0)
        self.round: dict = {}
        if algorithm == "flow_grpo" and section.clip_range()[0] != section.clip_range()[1]:
            raise SystemExit("the plain loop clips the ratio symmetrically: epsilon_high=null")

    def rollout(self, captions: list[str], seeds: list[int], step_seeds: list[int]) -> None:
        """Sample, decode and score a round from the images' seeds."""
        plain, pipeline, section = self.plain, self.pipeline, self.section
        grpo = self.algorithm == "flow_grpo"
        embeds = [self.embeddings[c] for c in captions]
        embeds, pooled = (self._stack([e[0] for e in embeds]), self._stack([e[1] for e in embeds]))
        initial = plain.normal(seeds, pipeline.latent_shape)
        noise = None
        if grpo:
            noise = plain.normal(step_seeds, (self.args.rollout_steps, *pipeline.latent_shape))
        latents, logps = plain.rollout(
            pipeline, self.model if grpo else self.frozen, initial, noise, embeds, pooled,
            noise_level=section.noise_level if grpo else 0.0,
        )  # fmt: skip
        rewards = plain.colour_rewards(pipeline.images(latents[:, -1]), captions)
        advantages = plain.group_advantages(rewards, self.args.group, section.adv_clip_max)
        self.round = {"latents": latents, "logps": logps, "rewards": rewards,
                      "advantages": advantages, "embeds": embeds, "pooled": pooled}  # fmt: skip

    @staticmethod
    def _stack(values):
        import torch

        return torch.stack(values)

    def step(self, training_seeds: list[int], trained_steps) -> dict[str, float]:
        plain, args, section, now = self.plain, self.args, self.section, self.round
        if self.algorithm == "flow_grpo":
            old = None
            if args.num_iterations > 1:
                old = now["logps"].gather(1, trained_steps)
            return plain.grpo_step(
                self.pipeline, self.model, self.frozen, self.optimizer, now["latents"],
                trained_steps, now["embeds"], now["pooled"], now["advantages"], old,
                noise_level=section.noise_level, clip=section.epsilon, kl_beta=section.beta,
                max_grad_norm=1.0, lr=args.lr,
            )  # fmt: skip
        draws = plain.training_draws(self.pipeline.training, training_seeds,
                                     self.pipeline.latent_shape)  # fmt: skip
        r = 0.5 + 0.5 * now["advantages"] / section.adv_clip_max
        figures = plain.nft_step(
            self.model, self.frozen, self.optimizer, now["latents"][:, -1], *draws,
            now["embeds"], now["pooled"], r, beta=section.beta, max_grad_norm=1.0, lr=args.lr,
        )  # fmt: skip
        plain.ema_update(self.frozen, self.model, section.old_decay)
        return figures


def paired_child(args: argparse.Namespace) -> None:
    """One (algorithm, stage) (`--paired-child algorithm:stage`): align_anything's real step and
    the plain loop's, alternating; writes per-step figures and CPU seconds to --out."""
    from contextlib import ExitStack

    import torch

    from align_anything.config import load_config
    from align_anything.families.diffusion.forward import draw_seed
    from align_anything.families.zoo import resolve_model_path
    from align_anything.tasks import TASKS
    from align_anything.training import loop, setup

    algorithm, stage = args.paired_child.split(":")
    out = Path(tempfile.mkdtemp(prefix="paired-"))
    cfg = load_config(ours_overrides(args, algorithm, out, args.cache, stage))
    spec = TASKS[cfg.task]
    seed, rows_out = cfg.train.seed, []
    with ExitStack() as stack:
        run = setup.setup(cfg, spec, stack)
        task, source = spec.build(run)
        plain = PlainSide(args, algorithm, resolve_model_path(args.model), cfg.section())
        ours_params = dict(run.policy.module.named_parameters())
        differing = [n for n, p in plain.model.named_parameters()
                     if not torch.equal(p.detach(), ours_params[n].detach())]  # fmt: skip
        if differing:
            raise SystemExit(f"the two sides start from different weights: {differing[:3]}")
        entry = source.rows.entry
        plain.embeddings = plain.pipeline.encode(list(entry.captions))
        per_round, group = source.sizes.steps_per_round, args.group
        grpo = algorithm == "flow_grpo"
        if grpo and cfg.section().train_fraction != 1.0:
            raise SystemExit("the plain loop trains every denoising step: train_fraction=1")
        run.policy.train()
        for step in range(args.steps):
            # What the plain side takes from ours: the round's prompts (ours' seeded choice),
            # hence its captions and image keys p·G + j.
            round_index, within = divmod(step, per_round)
            prompt_rows = source.round_prompts(round_index)
            keys = [row * group + j for row in prompt_rows for j in range(group)]
            captions = [entry.captions[int(entry.rows[source.rows[row].source, 0])]
                        for row in prompt_rows for _ in range(group)]  # fmt: skip
            trained = torch.arange(args.rollout_steps).expand(len(keys), -1)

            def ours_step() -> Any:
                result = loop.train_step(run, task, source)
                task.after_step(run.state.step)
                return result

            def plain_step(
                step: int = step, round_index: int = round_index, within: int = within,
                keys: list[int] = keys, captions: list[str] = captions,
                trained: torch.Tensor = trained,
            ) -> dict[str, float]:  # fmt: skip
                if within == 0:
                    plain.rollout(
                        captions, [draw_seed(seed, round_index, 2 * k) for k in keys],
                        [draw_seed(seed, round_index, 2 * k + 1) for k in keys],
                    )  # fmt: skip
                return plain.step([draw_seed(seed, step, k) for k in keys], trained)

            # Each side goes first every other step (neither always gets the warmer caches).
            timed = {}
            for name, work in [("ours", ours_step), ("plain", plain_step)][:: 1 - 2 * (step % 2)]:
                started, wall = time.process_time(), time.perf_counter()
                output = work()
                timed[name] = (output, time.process_time() - started, time.perf_counter() - wall)
            (result, ours_cpu, ours_wall), (figures, plain_cpu, plain_wall) = (
                timed["ours"],
                timed["plain"],
            )
            current = source.current
            if current.tensors["key"].tolist() != keys or (
                grpo and not torch.equal(current.tensors["steps"], trained)
            ):
                raise SystemExit(f"step {step + 1}: ours' round is not the plain side's")
            ours_latents = current.tensors["latents" if grpo else "final"]
            plain_latents = plain.round["latents"]
            if not grpo:
                plain_latents = plain_latents[:, -1]
            ours_loss = result.sums["loss"] / result.items
            row = {
                "step": step + 1, "round": round_index,
                "ours_loss": ours_loss, "plain_loss": figures["loss"],
                "ours_grad_norm": result.grad_norm, "plain_grad_norm": figures["grad_norm"],
                "rollout_max_diff": float((ours_latents - plain_latents).abs().max()),
                "rewards_equal": bool(torch.equal(current.tensors["reward"],
                                                  plain.round["rewards"])),
                "reward": float(plain.round["rewards"].mean()),
                "ours_cpu_s": ours_cpu, "plain_cpu_s": plain_cpu,
                "ours_wall_s": ours_wall, "plain_wall_s": plain_wall,
            }  # fmt: skip
            if grpo:
                row.update(ours_kl=result.sums.get("kl", 0.0) / result.items,
                           plain_kl=figures["kl"])  # fmt: skip
            rows_out.append(row)
            print(json.dumps(row), flush=True)
            gap = abs(ours_loss - figures["loss"]) / max(1.0, abs(figures["loss"]))
            if gap > args.tolerance:
                raise SystemExit(f"step {step + 1}: the losses differ by {gap:.2e}: {row}")
    args.out.write_text(json.dumps({"algorithm": algorithm, "stage": stage, "steps": rows_out,
                                    "steps_per_round": per_round}))  # fmt: skip


def summarise(rows: list[dict], steps_per_round: int) -> dict[str, float]:
    """Medians of the per-round CPU seconds per step (the first round, a warm-up, left out;
    all rounds when there is only one), the speed plain / ours, and the largest gaps."""
    rounds: dict[int, list[dict]] = {}
    for row in rows:
        rounds.setdefault(row["round"], []).append(row)
    kept = list(rounds.values())[1:] or list(rounds.values())

    def per_step(side: str) -> float:
        return statistics.median(sum(r[f"{side}_cpu_s"] for r in rnd) / len(rnd) for rnd in kept)

    ours, plain = per_step("ours"), per_step("plain")

    def worst(key: str, floor: float = 1.0) -> float:
        return max(abs(r[f"ours_{key}"] - r[f"plain_{key}"]) / max(floor, abs(r[f"plain_{key}"]))
                   for r in rows)  # fmt: skip

    result = {
        "ours_cpu_s_per_step": ours, "plain_cpu_s_per_step": plain,
        "speed_ours_over_plain": plain / ours, "max_rel_loss_diff": worst("loss"),
        "max_rel_grad_norm_diff": worst("grad_norm", 1e-12),
        "rollout_max_latent_diff": max(r["rollout_max_diff"] for r in rows),
        "rewards_equal_every_step": all(r["rewards_equal"] for r in rows),
        "steps": len(rows), "steps_per_round": steps_per_round,
    }  # fmt: skip
    if "ours_kl" in rows[0]:
        result["max_rel_kl_diff"] = worst("kl")
    return result


def run_paired(args: argparse.Namespace, algorithm: str, stage: str, cache: Path,
               workdir: Path) -> dict:  # fmt: skip
    """One (algorithm, stage) in its own process; its summary (`summarise`)."""
    result_file = workdir / f"paired-{algorithm}-{stage}.json"
    command = [
        sys.executable, __file__, "--paired-child", f"{algorithm}:{stage}", "--cache",
        str(cache), "--out", str(result_file), "--model", args.model, "--steps", str(args.steps),
        "--prompts", str(args.prompts), "--group", str(args.group), "--rollout-steps",
        str(args.rollout_steps), "--num-iterations", str(args.num_iterations), "--lr",
        str(args.lr), "--kl-beta", str(args.kl_beta), "--tolerance", str(args.tolerance),
    ]  # fmt: skip
    started = time.perf_counter()
    log = workdir / f"paired-{algorithm}-{stage}.log"
    run_child(command, env=child_env(args.threads), log=log)
    result = json.loads(result_file.read_text())
    summary = summarise(result["steps"], result["steps_per_round"])
    print(f"  {algorithm} {stage}: {time.perf_counter() - started:.0f} s, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    return summary


def table(results: dict[str, dict[str, dict]]) -> list[str]:
    lines = [
        "| algorithm | stage | ours CPU s/step | plain CPU s/step | speed ours/plain | "
        "max loss diff (rel.) | max grad-norm diff (rel.) | rollout max latent diff | "
        "rewards equal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, stages in results.items():
        for stage, f in stages.items():
            lines.append(
                f"| {algorithm} | {stage} | {f['ours_cpu_s_per_step']:.3f} | "
                f"{f['plain_cpu_s_per_step']:.3f} | **{f['speed_ours_over_plain']:.2f}x** | "
                f"{f['max_rel_loss_diff']:.1e} | {f['max_rel_grad_norm_diff']:.1e} | "
                f"{f['rollout_max_latent_diff']:.1e} | "
                f"{'yes' if f['rewards_equal_every_step'] else 'no'} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.paired_child:
        paired_child(args)
        return 0
    load = os.getloadavg()[0]
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="image-rl-bench-") as tmp:
        workdir, cache = Path(tmp), Path(tmp) / "cache"
        for algorithm in args.algorithms:
            results[algorithm] = {
                stage: run_paired(args, algorithm, stage, cache, workdir) for stage in args.zero
            }
    summary = {
        "model": args.model, "steps": args.steps, "images_per_step": args.prompts * args.group,
        "group": args.group, "rollout_steps": args.rollout_steps,
        "num_iterations": args.num_iterations, "lr": args.lr, "flow_grpo_beta": args.kl_beta,
        "threads": args.threads, "loadavg_start": load, "loadavg_end": os.getloadavg()[0],
        "paired": results,
    }  # fmt: skip
    print("\n".join(table(results)))
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
