"""What online RL of a text-to-image pipeline shares (`flow_grpo`, `dance_grpo`,
`diffusion_nft`): the task (`ImageRL`, its algorithm a field), its rounds (`ImageRounds`, the
step source) and a round inside a checkpoint. Each algorithm's file gives its loss and what a
round attaches to each image.

A round, as the language tasks' (`tasks/online/rollouts.py`): the global batch counts images,
B images = B / G prompts × G; the round's prompts are a seeded permutation of the training
prompts (`batching.step_indices`), each rank taking its slice (a prompt's G images stay on one
rank); one round serves `num_iterations` optimizer steps.

1. **Sampling** with the current weights (DiffusionNFT: its old policy's), under ZeRO-3 the
   denoiser gathered once for the round (`Engine.gathered_for_generation`), in chunks of the
   micro-batch size, by the task's sampler (`families.diffusion.sde`: the flow SDE, DDIM with
   eta, or their deterministic forms). Image j of prompt row p in round k starts from noise
   seeded by (train.seed, k, p·G + j) (DanceGRPO's shared noise: p·G for the whole group) and
   draws each step's noise from its own generator, seeded likewise: the same images on any
   number of ranks and after a resume. The classifier-free guidance of the rollout is the one
   the loss recomputes with (`sde.guided_prediction`).
2. **Rewards**: the final latents decoded by the frozen VAE, the images (PIL, RGB) scored by the
   `reward` section's functions and servers (`rewards.score_completions(images=...)`: weights,
   None, timeouts and errors as for text; an error stops every rank before the step's update,
   `comm.fail_together`). The rewards of every rank are all-gathered (one float per image) and
   the algorithm turns the whole round's into its per-image numbers (GRPO: capped
   group-relative advantages; NFT: the optimality r), each rank keeping its slice.
3. **Steps**: each of the round's `num_iterations` steps trains on all of this rank's images,
   in micro-batches (the loop's normaliser: global images / (world × grad_accum), so 2 ranks
   compute the loss of 1 rank).

A checkpoint written inside a round (`num_iterations` > 1) holds the round: `rollout.json`
(its index and figures) and `rollout.safetensors` (what each image carries: its prompt row,
trajectory or clean latents, advantages, old log-probs), written by rank 0 in round order (rank
after rank); a run resumed from it continues that round, each rank taking its slice whatever
the world size, so its steps are the uninterrupted run's.

Logged per round: `reward`, `reward_std`, `rewards/<f>/mean|std`, `frac_reward_zero_std`,
`frac_reward_none`, the algorithm's figures (advantages, KL, clip fraction, ...),
`generation/seconds`, `generation/images_per_second`; every `logging.completions_every` steps
a grid of rank 0's first `logging.completions_shown` prompts' G images with their rewards
(`output_dir/samples/round-N.png`, and to TensorBoard / wandb) and a table of them (a wandb
Table with the images). Held out, before and after: the pictures and the colour check of the
pipeline tasks (`Pictures`), and `eval/reward` on `eval_samples` held-out prompts at fixed
seeds.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from align_anything import atomic
from align_anything.backend import distributed as comm
from align_anything.config import RunConfig
from align_anything.errors import ConfigError, UserError
from align_anything.families.diffusion import family as pipelines
from align_anything.families.diffusion import sde
from align_anything.families.diffusion.family import PipelineSide
from align_anything.families.diffusion.forward import batch_to, draw_seed
from align_anything.families.diffusion.latents import row_tensors
from align_anything.losses import group_reward_std, nanstd
from align_anything.rewards import functions as reward_fns
from align_anything.tasks.diffusion.common import Pictures, pictures
from align_anything.tasks.online import common as online
from align_anything.tasks.online.rollouts import ROLLOUT_JSON, ROLLOUT_TENSORS
from align_anything.training import checkpoints
from align_anything.training.batching import step_indices
from align_anything.training.run import Data, Run, Schedule
from align_anything.training.task import LossOutput, StepBatches, Task

ROUND_GRIDS = "samples"  # output_dir/samples/round-N.png, beside the pipeline tasks' samples


def latent_shape(model: PipelineSide) -> tuple[int, int, int]:
    """[C, h, w] of the latents the pipeline samples at the run's resolution."""
    side = model.resolution // model.info.vae_scale_factor
    return (model.info.latent_channels, side, side)


# ---------------------------------------------------------------------------- set-up hooks


def rollout_sampler(cfg: RunConfig, model: PipelineSide, *, noise: float, what: str,
                    needs_log_probs: bool) -> sde.Sampler:  # fmt: skip
    """The rollout sampler of the run (`sde.build_sampler`; a `SamplerError` naming `what`
    when it has no step to train on)."""
    return sde.build_sampler(
        model.info, steps=cfg.section().rollout_steps, noise=noise,
        latent_shape=latent_shape(model), needs_log_probs=needs_log_probs, what=what,
    )  # fmt: skip


def check_rewards(cfg: RunConfig) -> None:
    """Before any data or weights: the reward functions and servers resolve, and no text
    reward model is asked to score images."""
    if cfg.reward is not None and cfg.reward.model is not None:
        raise ConfigError(
            f"reward.model={cfg.reward.model!r} is a reward model trained by task=rm, which "
            f"scores text; task={cfg.task} scores images: use reward.functions (e.g. "
            "align_anything.rewards:shape_colour) or reward.remote.urls (images sent as "
            "base64 PNG), and set reward.model=null"
        )
    online.reward_functions(cfg)


def schedule(cfg: RunConfig, data: Data, batch: Any) -> Schedule:
    """Steps from rounds of prompts, `num_iterations` per round (the language RL tasks' rule,
    counting images)."""
    return online.schedule(cfg, data, batch, unit="images")


# ---------------------------------------------------------------------------- batches


@dataclass
class ImageRLBatch:
    """A micro-batch of a round's images: their text conditioning (the cache's prompt
    embeddings, `add_time_ids`) and, by algorithm, what the round attached. GRPO: `latents`
    [B, K + 1, ...] (the trajectory), `steps` [B, J] (the trained steps), `advantages` [B],
    `old_logps` [B, J] (when the round serves several steps). NFT: the step's forward-noised
    `noisy` latents of the clean `final` ones with their `target` and `timesteps`, the
    optimality `r` [B], and the old policy's prediction (attached before the losses)."""

    conditioning: dict[str, Tensor]
    advantages: Tensor | None = None
    latents: Tensor | None = None
    steps: Tensor | None = None
    old_logps: Tensor | None = None
    noisy: Tensor | None = None
    target: Tensor | None = None
    timesteps: Tensor | None = None
    r: Tensor | None = None
    old_prediction: Tensor | None = None

    @property
    def size(self) -> int:
        return int(next(iter(self.conditioning.values())).shape[0])


@dataclass
class ImageRound:
    """One round on this rank: per image (leading dimension N, this rank's images in round
    order, on the CPU) its prompt `row` of the training split, its `key` (p·G + j), its reward
    and what the algorithm attached; the round's global figures, the time it took, a table."""

    index: int
    tensors: dict[str, Tensor]
    metrics: dict[str, float]
    seconds: float
    table: list[dict[str, Any]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.tensors["row"].shape[0])


class ImageAlgorithm(Protocol):
    """What Flow-GRPO, DanceGRPO and DiffusionNFT give the task: the rollout sampler's noise
    and initial noise, what a round attaches to its images, the per-step batches, the loss."""

    name: str
    shared_noise: bool
    metric_keys: tuple[str, ...]

    def sampling_weights(self, module: Any) -> contextlib.AbstractContextManager[None]:
        """The weights the rollout samples with, put in place on the gathered `module`
        (DiffusionNFT: its old policy's)."""
        ...

    def attach(self, task: ImageRL, current: ImageRound, trajectory: sde.Trajectory,
               rewards: Tensor) -> dict[str, float]:  # fmt: skip
        """Attach to `current.tensors` what the round's images carry (from their
        trajectories and the whole round's `rewards`, all ranks', in order), and run the
        round's no-grad passes; return the round's figures. Collective."""
        ...

    def batch(self, task: ImageRL, records: dict[str, Tensor], step: int) -> ImageRLBatch:
        """A micro-batch of images (`records`: a slice of the round's tensors) for step
        `step` (0-based)."""
        ...

    def before_losses(self, task: ImageRL, batches: Sequence[ImageRLBatch]) -> None: ...

    def loss(self, task: ImageRL, batch: ImageRLBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """(the micro-batch's summed per-image loss, metric sums over its images)."""
        ...

    def after_step(self, task: ImageRL, step: int) -> None: ...

    def save(self, folder: Path, *, is_main: bool) -> None:
        """What the algorithm keeps across rounds into checkpoint `folder` (NFT's old policy)."""
        ...

    def load(self, folder: Path) -> None: ...


@dataclass
class ImageRewards:
    """The run's reward functions and servers (weighted), scoring images."""

    functions: list[tuple[str, Any]]
    weights: list[float]
    timeout_s: float | None

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.functions]

    def describe(self) -> str:
        pairs = zip(self.names, self.weights, strict=True)
        return f"  rewards         {', '.join(f'{n} x{w:g}' for n, w in pairs)}"

    def score(
        self, prompts: list[str], images: list[Any], fields: dict[str, list], *,
        row_ids: list[str], step: int | None, good_checkpoint: Any,
    ) -> tuple[list[float], dict[str, list[float]]]:  # fmt: skip
        """(weighted total per image (NaN: no reward had an opinion), each reward's values).
        Every rank learns whether any rank's reward failed, and all stop. Collective."""

        def work() -> tuple[list[float], dict[str, list[float]]]:
            try:
                total, per = reward_fns.score_completions(
                    self.functions, self.weights, prompts=prompts, images=images,
                    fields=fields, row_ids=row_ids, timeout_s=self.timeout_s,
                )  # fmt: skip
            except reward_fns.RewardError as err:
                raise UserError(online.failed_reward(str(err), step, good_checkpoint())) from None
            return total.tolist(), {k: v.tolist() for k, v in per.items()}

        result = comm.fail_together(work, what="reward")
        assert result is not None
        return result


# ---------------------------------------------------------------------------- the task


@dataclass
class ImageRL(Task):
    """Online RL of a text-to-image pipeline's denoiser: the algorithm's loss on the rounds'
    images (`ImageRounds`), the samples and held-out checks of the pipeline tasks, and
    `eval/reward` on held-out prompts."""

    algorithm: ImageAlgorithm
    section: Any
    policy: Any
    model: PipelineSide
    sampler: sde.Sampler
    rewards: ImageRewards
    pictures: Pictures
    eval_rows: Any
    train_rows: Any
    micro_batch: int
    seed: int
    dtype: torch.dtype
    rank: int
    world: int
    reference: Any = None  # the GRPO tasks' KL reference (None: beta = 0)
    name: str = "image_rl"
    metric_keys: tuple[str, ...] = ("loss",)
    eval_loss: bool = False  # held-out rows are prompts: evaluation draws and scores images
    _unconditional: dict[str, Tensor] | None = field(default=None, repr=False)

    @property
    def info(self) -> Any:
        return self.model.info

    @property
    def device(self) -> torch.device:
        return self.policy.device

    def conditioning(self, rows: Sequence[int] | Tensor) -> dict[str, Tensor]:
        """The text conditioning of training prompt rows `rows`, on the device in the
        denoiser's dtype."""
        split = self.train_rows
        return batch_to(row_tensors([split[int(r)] for r in rows]), self.device, self.dtype)

    def unconditional(self, count: int) -> dict[str, Tensor] | None:
        """`count` rows of the empty prompt's embeddings (classifier-free guidance's other
        half), or None when the run has no guidance."""
        if self.section.guidance_scale <= 1 or self.info.kind == "flux":
            return None
        if self._unconditional is None:
            empty = sde.unconditional_embeddings(self.model.parts, 1)
            self._unconditional = batch_to(empty, self.device, self.dtype)
        return {k: v.expand(count, *v.shape[1:]) for k, v in self._unconditional.items()}

    def model_output(self, module: Any, conditioning: dict[str, Tensor]) -> sde.ModelOutput:
        """The guided denoiser output `(x, t) -> prediction` for rows aligned with
        `conditioning` (the rollout's and the recomputation's alike)."""
        unconditional = self.unconditional(next(iter(conditioning.values())).shape[0])

        def output(x: Tensor, t: Tensor) -> Tensor:
            return sde.guided_prediction(
                module, self.info, x, t, conditioning, unconditional,
                guidance_scale=self.section.guidance_scale,
            )  # fmt: skip

        return output

    @contextlib.contextmanager
    def sampling_module(self) -> Iterator[Any]:
        """The denoiser to sample with: gathered whole under ZeRO-3 (collective), in eval mode,
        with the weights the algorithm samples with."""
        with self.policy.gathered_for_generation() as module:
            was_training = module.training
            module.eval()
            try:
                with self.algorithm.sampling_weights(module):
                    yield module
            finally:
                module.train(was_training)

    def collate(self, rows: list[dict]) -> dict[str, Tensor]:
        """Per-image records (a round's tensors, one image each) stacked."""
        return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}

    def count_items(self, batch: ImageRLBatch) -> int:
        return batch.size

    def count_tokens(self, batch: ImageRLBatch) -> int:
        return 0  # images: samples_per_second counts them

    def before_losses(self, batches: Sequence[Any], real: Sequence[bool]) -> None:
        self.algorithm.before_losses(self, batches)

    def loss(self, batch: ImageRLBatch, *, normalizer: float, training: bool) -> LossOutput:
        total, metrics = self.algorithm.loss(self, batch)
        return LossOutput({"policy": total / normalizer}, {"loss": total.detach(), **metrics})

    def after_step(self, step: int) -> None:
        self.algorithm.after_step(self, step)
        self.pictures.after_step(step)

    @torch.no_grad()
    def evaluate_extra(self, label: str) -> dict[str, float]:
        """The pipeline tasks' pictures and colour check, and `eval/reward`: the first
        `eval_samples` held-out prompts drawn at seeds 0, 1, ... by the folder's own sampler,
        scored by the rewards (each rank a share). Collective."""
        results = self.pictures.evaluate(label)
        count = min(self.section.eval_samples, len(self.eval_rows))
        if not count:
            return results
        entry = self.eval_rows.entry
        sources = [self.eval_rows[i].source for i in range(count)]
        prompts = [entry.captions[int(entry.rows[s, 0])] for s in sources]
        images = pipelines.draw(
            self.model, self.policy, prompts, list(range(count)),
            steps=self.section.sample_steps, guidance_scale=self.section.guidance_scale,
            rank=self.rank, world=self.world,
        )  # fmt: skip
        mine = list(range(self.rank, count, self.world))
        from PIL import Image

        fields = row_fields([entry.row_fields[sources[i]] for i in mine])
        total, per = self.rewards.score(
            [prompts[i] for i in mine], [Image.fromarray(images[i]) for i in mine], fields,
            row_ids=[entry.rows_from[sources[i]] for i in mine], step=None,
            good_checkpoint=lambda: None,
        )  # fmt: skip
        names = list(self.rewards.names)
        sums = [sum(v for v in total if not math.isnan(v))]
        counts = [float(sum(not math.isnan(v) for v in total))]
        for name in names:
            sums.append(sum(v for v in per[name] if not math.isnan(v)))
            counts.append(float(sum(not math.isnan(v) for v in per[name])))
        _, reduced = comm.sum_metrics({}, [], *sums, *counts)
        sums, counts = reduced[: len(sums)], reduced[len(sums) :]
        results["eval/reward"] = sums[0] / max(counts[0], 1.0)
        for k, name in enumerate(names):
            results[f"eval/rewards/{name}"] = sums[1 + k] / max(counts[1 + k], 1.0)
        return results


def row_fields(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The rows' other columns as one list per column (what reward functions get)."""
    keys = list(rows[0]) if rows else []
    return {key: [row.get(key) for row in rows] for key in keys}


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
