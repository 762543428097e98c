"""The rounds of image RL (`ImageRounds`, the step source of `flow_grpo`, `dance_grpo` and
`diffusion_nft`): sampling, rewards, the steps of a round and a round inside a checkpoint, as the
module docstring of `tasks/diffusion/online.py` describes; `build_image_rl` puts the task and its
rounds together for each algorithm's `build`."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from align_anything import atomic
from align_anything.backend import distributed as comm
from align_anything.families.diffusion import sde
from align_anything.families.diffusion.forward import draw_seed
from align_anything.losses import group_reward_std, nanstd
from align_anything.tasks.diffusion.common import pictures
from align_anything.tasks.diffusion.online import (
    ImageAlgorithm,
    ImageRewards,
    ImageRL,
    ImageRound,
    latent_shape,
    row_fields,
)
from align_anything.tasks.online import common as online
from align_anything.tasks.online.rollouts import ROLLOUT_JSON, ROLLOUT_TENSORS
from align_anything.training import checkpoints
from align_anything.training.batching import step_indices
from align_anything.training.run import Run
from align_anything.training.task import StepBatches

ROUND_GRIDS = "samples"  # output_dir/samples/round-N.png, beside the pipeline tasks' samples


def to_images(pixels: Tensor) -> list[Any]:
    """PIL RGB images from decoded pixels [B, 3, H, W] in [-1, 1], as diffusers' image
    processor makes them ((x/2 + 0.5) clipped, × 255, rounded)."""
    from PIL import Image

    array = (pixels.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(image) for image in (array * 255).round().astype(np.uint8)]


# ---------------------------------------------------------------------------- rounds


class ImageRounds:
    """The step source: a round of images every `num_iterations` steps (see the module
    docstring), served as this rank's micro-batches of each of its steps."""

    def __init__(self, run: Run, task: ImageRL, sizes: online.RoundSizes) -> None:
        self.task = task
        self.sizes = sizes
        self.rows = run.data.train
        self.batch = run.ds_plan.batch
        self.rank, self.world = run.dist.rank, run.dist.world_size
        self.seed = run.cfg.train.seed
        self.logging = run.cfg.logging
        self.output = run.output.path
        self.run = run  # its logger exists once logging has started (after the build)
        self.checkpoints = (run.output.path / "checkpoints", run.output.run_id)
        self.current: ImageRound | None = None
        self.resume_dir = run.output.resume_dir
        if self.resume_dir is not None:
            task.algorithm.load(self.resume_dir)

    # ------------------------------------------------------------------ steps

    def step(self, step: int) -> StepBatches:
        round_index = step // self.sizes.steps_per_round
        if self.current is None or self.current.index != round_index:
            self.current = self.restored(round_index) or self.rollout(round_index, step)
            fresh = self.current.seconds > 0  # a restored round was shown when it was made
        else:
            fresh = False
        current, micro = self.current, self.batch.micro_batch
        batches = []
        for start in range(0, current.size, micro):
            records = {k: v[start : start + micro] for k, v in current.tensors.items()}
            batches.append(self.task.algorithm.batch(self.task, records, step))
        return StepBatches(
            batches, metrics=dict(current.metrics), seconds=current.seconds if fresh else 0.0,
            table=current.table if fresh else [],
        )  # fmt: skip

    def round_prompts(self, round_index: int) -> list[int]:
        """This rank's training prompt rows of a round (as the language tasks' rounds)."""
        epoch, in_epoch = divmod(round_index, self.sizes.rounds_per_epoch)
        order = step_indices(
            len(self.rows), global_batch=self.sizes.prompts_per_round, seed=self.seed,
            epoch=epoch, step=in_epoch,
        )  # fmt: skip
        per_rank = self.sizes.prompts_per_rank
        return order[self.rank * per_rank : (self.rank + 1) * per_rank]

    def noise(self, round_index: int, keys: list[int]) -> tuple[Tensor, Tensor | None]:
        """(initial noise [N, C, h, w], each step's noise [N, K, C, h, w] or None for a
        deterministic sampler) of the images with keys `keys` (p·G + j), each from its own
        seeded generator (shared initial noise: the group's first image's)."""
        task, group = self.task, self.task.section.num_generations
        shape = latent_shape(task.model)
        first = [k - k % group if task.algorithm.shared_noise else k for k in keys]
        initial = sde.draw_normal([draw_seed(self.seed, round_index, 2 * k) for k in first],
                                  shape)[:, 0]  # fmt: skip
        if not task.sampler.stochastic_steps():
            return initial, None
        seeds = [draw_seed(self.seed, round_index, 2 * k + 1) for k in keys]
        return initial, sde.draw_normal(seeds, shape, count=task.sampler.steps)

    def rollout(self, round_index: int, step: int) -> ImageRound:
        """Sample, decode, score and attach one round (collective)."""
        task, group, micro = self.task, self.task.section.num_generations, self.batch.micro_batch
        start = time.perf_counter()
        prompt_rows = self.round_prompts(round_index)
        rows = [row for row in prompt_rows for _ in range(group)]
        keys = [row * group + j for row in prompt_rows for j in range(group)]
        initial, noise = self.noise(round_index, keys)
        latents, log_probs = [], []
        with task.sampling_module() as module:
            for begin in range(0, len(rows), micro):
                chunk = slice(begin, begin + micro)
                output = task.model_output(module, task.conditioning(rows[chunk]))
                trajectory = sde.sample_trajectory(
                    output, task.sampler, initial[chunk].to(task.device),
                    None if noise is None else noise[chunk],
                )  # fmt: skip
                latents.append(trajectory.latents)
                log_probs.append(trajectory.log_probs)
        trajectory = sde.Trajectory(torch.cat(latents), torch.cat(log_probs))
        sampled = time.perf_counter() - start
        images = []
        with torch.no_grad():
            for begin in range(0, len(rows), micro):
                images += to_images(task.model.parts.decode_latents(
                    trajectory.final[begin : begin + micro]
                ))  # fmt: skip
        entry = self.rows.entry
        sources = [self.rows[row].source for row in rows]
        prompts = [entry.captions[int(entry.rows[s, 0])] for s in sources]
        good = lambda: checkpoints.last_complete(*self.checkpoints)  # noqa: E731
        total, per = task.rewards.score(
            prompts, images, row_fields([entry.row_fields[s] for s in sources]),
            row_ids=[entry.rows_from[s] for s in sources], step=step, good_checkpoint=good,
        )  # fmt: skip
        gathered = torch.tensor(
            [v for part in comm.all_gather_objects(total) for v in part], dtype=torch.float32
        )
        current = ImageRound(
            round_index,
            {"row": torch.tensor(rows), "key": torch.tensor(keys),
             "reward": torch.tensor(total, dtype=torch.float32)},
            {}, 0.0,
        )  # fmt: skip
        figures = task.algorithm.attach(task, current, trajectory, gathered)
        seconds = max(time.perf_counter() - start, 1e-9)
        current.metrics = (
            round_metrics(gathered, per, group=group, names=task.rewards.names)
            | figures
            | {"generation/seconds": sampled,
               "generation/images_per_second": gathered.numel() / max(sampled, 1e-9)}
        )  # fmt: skip
        if current.metrics.get("frac_reward_none") == 1.0 and self.rank == 0:
            print(
                f"warning: step {step + 1}: no reward had an opinion on any of its "
                f"{gathered.numel()} images (every reward returned None), so the step changes "
                "nothing; check the reward functions and the prompts' fields",
                flush=True,
            )
        current.seconds = seconds
        every = self.logging.completions_every
        if every and (step + 1) % every == 0 and self.rank == 0:
            current.table = self.show(current, prompts, images, step)
        return current

    def show(self, current: ImageRound, prompts: list[str], images: list[Any],
             step: int) -> list[dict[str, Any]]:  # fmt: skip
        """Rank 0's first `logging.completions_shown` prompts with their G images: a grid
        with the rewards (samples/round-N.png, and an image to the metrics backends), and the
        table's rows."""
        group = self.task.section.num_generations
        shown = min(self.logging.completions_shown, current.size // group)
        rewards = current.tensors["reward"].tolist()
        advantage = current.tensors.get("advantage", current.tensors.get("r"))
        rows, labels, table = [], [], []
        for p in range(shown):
            block = range(p * group, (p + 1) * group)
            rows.append([np.asarray(images[i]) for i in block])
            labels.append(f"{prompts[p * group]}: " + " ".join(f"{rewards[i]:.3g}" for i in block))
            for i in block:
                table.append({"prompt": prompts[i], "image": images[i], "reward": rewards[i],
                              "advantage": float(advantage[i]) if advantage is not None else 0.0})  # fmt: skip
        if rows:
            path = self.task.model.medium.save_samples(
                rows, self.output / ROUND_GRIDS / f"round-{current.index:06d}", labels,
                [str(j + 1) for j in range(group)],
            )  # fmt: skip
            logger = self.run.logger
            if logger is not None:
                from PIL import Image

                with Image.open(path) as grid:
                    logger.log_image(step + 1, "rollouts", grid.convert("RGB"),
                                     caption=f"round {current.index}")  # fmt: skip
        return table

    # ------------------------------------------------------------------ inside a checkpoint

    def save(self, folder: Path, step: int) -> None:
        """The algorithm's own state (NFT's old policy) always; inside a round (it serves
        several steps and `step` is not at its end) the round, rank 0 writing every rank's
        images in round order. Collective."""
        self.task.algorithm.save(folder, is_main=self.rank == 0)
        current = self.current
        if current is None or step % self.sizes.steps_per_round == 0:
            return
        parts = comm.all_gather_objects(current.tensors)
        if self.rank != 0:
            return
        tensors = {k: torch.cat([part[k] for part in parts]).contiguous() for k in parts[0]}
        save_file(tensors, str(folder / ROLLOUT_TENSORS))
        meta = {"round": current.index, "metrics": current.metrics, "world_size": self.world}
        atomic.write_text(folder / ROLLOUT_JSON, json.dumps(meta))

    def restored(self, round_index: int) -> ImageRound | None:
        """The round a resumed run's checkpoint holds, if it holds this one (asked once: the
        resumed run's first step): this rank's slice of it."""
        folder, self.resume_dir = self.resume_dir, None
        if folder is None or not (folder / ROLLOUT_JSON).is_file():
            return None
        meta = json.loads((folder / ROLLOUT_JSON).read_text())
        if meta["round"] != round_index:
            return None
        tensors = load_file(str(folder / ROLLOUT_TENSORS))
        per_rank = tensors["row"].shape[0] // self.world
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        return ImageRound(round_index, {k: v[mine] for k, v in tensors.items()}, meta["metrics"],
                          0.0)  # fmt: skip


def round_metrics(
    rewards: Tensor, per_function: dict[str, list[float]], *, group: int, names: list[str]
) -> dict[str, float]:
    """The round's reward figures over every rank's images (`rewards`: all of them, in order;
    `per_function`: this rank's). Collective."""
    values = rewards.double()
    none = torch.isnan(values)
    metrics = {
        "reward": float(torch.nanmean(values)),
        "reward_std": float(nanstd(values)),
        "frac_reward_none": float(none.double().mean()),
        "frac_reward_zero_std": float((group_reward_std(values, group) == 0).double().mean()),
    }
    gathered = comm.all_gather_objects({name: per_function[name] for name in names})
    for name in names:
        column = torch.tensor([v for part in gathered for v in part[name]], dtype=torch.float64)
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(column))
        metrics[f"rewards/{name}/std"] = float(nanstd(column))
    if bool(none.all()):
        metrics.pop("frac_reward_zero_std")
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


# ---------------------------------------------------------------------------- build


def build_image_rl(run: Run, algorithm: ImageAlgorithm, sampler: sde.Sampler, *,
                   reference: Any = None, lines: Sequence[str] = ()) -> tuple[ImageRL, ImageRounds]:  # fmt: skip
    """The image RL task around `algorithm` and `sampler`, its rewards, pictures and rounds;
    its start-up summary lines."""
    cfg = run.cfg
    section = cfg.section()
    reward = cfg.reward
    assert reward is not None
    rewards = ImageRewards(
        online.reward_functions(cfg), reward.weight_list(), reward.timeout_seconds
    )
    sizes = online.round_sizes(cfg, len(run.data.train), run.ds_plan.batch, unit="images")
    task = ImageRL(
        algorithm=algorithm, section=section, policy=run.policy, model=run.model,
        sampler=sampler, rewards=rewards, pictures=pictures(run, section),
        eval_rows=run.data.eval, train_rows=run.data.train,
        micro_batch=run.ds_plan.batch.micro_batch, seed=cfg.train.seed,
        dtype=next(run.policy.module.parameters()).dtype, rank=run.dist.rank,
        world=run.dist.world_size, reference=reference, name=cfg.task,
        metric_keys=("loss", *algorithm.metric_keys),
    )  # fmt: skip
    noise = "no noise (the deterministic sampler)" if not sampler.stochastic_steps() else (
        f"noise {sampler.noise:g}"
    )  # fmt: skip
    per = (
        "step"
        if sizes.steps_per_round == 1
        else f"round, served over {sizes.steps_per_round} steps"
    )
    run.summary += [
        rewards.describe(),
        f"  rollouts        {section.num_generations} images per prompt, "
        f"{sizes.prompts_per_round} prompts per {per} ({sizes.prompts_per_rank} per rank); "
        f"{sampler.kind} sampler, {sampler.steps} steps, {noise}, guidance "
        f"{section.guidance_scale:g}",
        *lines,
    ]  # fmt: skip
    return task, ImageRounds(run, task, sizes)
