"""Diffusion fine-tuning of a text-to-image pipeline's denoiser: the denoising loss, each
image's MSE between the denoiser's prediction and the scheduler's target (epsilon, v or the
flow velocity; `forward_diffusion`), optionally weighted by min-SNR-γ (epsilon and
v-prediction), averaged over every image of the global batch. The VAE and the text encoders
stay frozen; images and captions come encoded from the latent cache.

Logged: `loss` (the weighted loss), `mse` (the plain MSE); held out: `eval/loss`, `eval/mse`
at fixed draws (`diffusion_sft.eval_draws` K of them per image, each image's loss their mean:
the expectation of one draw, the part of its variance that comes from the draws K times
smaller), `eval/image_check` for built-in data.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from align_anything.config import RunConfig
from align_anything.errors import ConfigError
from align_anything.families.diffusion.family import PipelineSide
from align_anything.families.diffusion.forward import signal_to_noise
from align_anything.families.pipelines import PIPELINES
from align_anything.losses.diffusion import denoising_loss, min_snr_weights
from align_anything.tasks.diffusion.common import (
    Denoising,
    ImageBatch,
    Pictures,
    denoising,
    image_rows,
    pictures,
)
from align_anything.training.run import Run
from align_anything.training.sources import RowBatches
from align_anything.training.task import LossOutput, Task, TaskSpec


def check(cfg: RunConfig, model: PipelineSide) -> None:
    """min-SNR-γ weights apply to epsilon and v-prediction: an error for a flow kind."""
    gamma = cfg.diffusion_sft.min_snr_gamma  # type: ignore[union-attr]
    if gamma is not None and model.info.flow:
        raise ConfigError(
            f"diffusion_sft.min_snr_gamma={gamma}: min-SNR weighting is for epsilon and "
            f"v-prediction denoisers; {model.name} is a flow-matching {model.info.kind} "
            "pipeline, whose timestep density (diffusion_sft.timestep_sampling) plays that "
            "part: set diffusion_sft.min_snr_gamma=null"
        )


@dataclass
class DiffusionSFT(Task):
    """The denoising loss on captioned images."""

    policy: Any
    denoise: Denoising
    min_snr_gamma: float | None
    pictures: Pictures
    name: str = "diffusion_sft"
    metric_keys: tuple[str, ...] = ("loss", "mse")

    def collate(self, rows: list) -> ImageBatch:
        return self.denoise.collate_images(rows)

    def count_items(self, batch: ImageBatch) -> int:
        return batch.size

    def count_tokens(self, batch: ImageBatch) -> int:
        return 0  # images, not tokens: samples_per_second is logged

    def loss(self, batch: ImageBatch, *, normalizer: float, training: bool) -> LossOutput:
        # One draw per image in training; a held-out image's loss is the mean over its draws
        # (one forward pass per draw, so evaluation needs no more memory than a training step).
        mses, losses = [], []
        for draw in batch.all_draws:
            mse = self.denoise.mse(self.policy, replace(batch, draw=draw, further_draws=()))
            weights = None
            if self.min_snr_gamma is not None:
                info = self.denoise.info
                snr = signal_to_noise(info, self.denoise.scheduler, draw).to(mse.device)
                weights = min_snr_weights(snr, gamma=self.min_snr_gamma, prediction=info.prediction)
            mses.append(mse)
            losses.append(denoising_loss(mse, weights=weights))
        mse, loss = torch.stack(mses).mean(0), torch.stack(losses).mean(0)
        metrics = {"loss": loss.detach().sum(), "mse": mse.detach().sum()}
        return LossOutput({"policy": loss.sum() / normalizer}, metrics)

    def after_step(self, step: int) -> None:
        self.pictures.after_step(step)

    def evaluate_extra(self, label: str) -> dict[str, float]:
        return self.pictures.evaluate(label)


def build(run: Run) -> tuple[DiffusionSFT, RowBatches]:
    section = run.cfg.diffusion_sft
    denoise = denoising(run, section, eval_draws=section.eval_draws)
    task = DiffusionSFT(
        policy=run.policy, denoise=denoise, min_snr_gamma=section.min_snr_gamma,
        pictures=pictures(run, section),
    )  # fmt: skip
    if section.eval_draws > 1:
        run.summary.append(
            f"  held-out loss   each held-out image at {section.eval_draws} fixed noise draws "
            "(the same at every evaluation), its loss their mean"
        )
    if section.min_snr_gamma is not None:
        run.summary.append(
            f"  loss            the {denoise.info.prediction} MSE weighted by min-SNR-gamma "
            f"{section.min_snr_gamma}"
        )
    return task, image_rows(run, task.collate)


SPEC = TaskSpec(
    name="diffusion_sft", record_kind="captioned", encoding=None, build=build,
    family=PIPELINES, check=check,
)  # fmt: skip
