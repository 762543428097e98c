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
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from align_anything.backend import distributed as comm
from align_anything.config import RunConfig
from align_anything.errors import ConfigError, UserError
from align_anything.families.diffusion import outputs, sde
from align_anything.families.diffusion.family import PipelineSide
from align_anything.families.diffusion.forward import batch_to
from align_anything.families.diffusion.latents import row_tensors
from align_anything.rewards import functions as reward_fns
from align_anything.tasks.diffusion.common import Pictures
from align_anything.tasks.online import common as online
from align_anything.training.run import Data, Schedule
from align_anything.training.task import LossOutput, Task


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
        images = outputs.draw(
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
