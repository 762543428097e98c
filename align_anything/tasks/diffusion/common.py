"""What the pipeline tasks share (`diffusion_sft`, `diffusion_dpo`), whatever the pipeline's
medium: their batches, the seeded noise draws, the denoiser's per-sample MSE, the DPO reference
of a LoRA run, and the samples drawn for people and for the held-out check.

A batch is read from the latent cache (`families.diffusion.latents`: VAE latents and text embeddings encoded
once), with each sample's noise and noise level drawn in the collate step from its own
generator, seeded by (run seed, optimizer step, the row's index in its split)
(`forward_diffusion.draw_seed`): a sample's draw depends on nothing else, so 2 ranks compute
what 1 rank does, any micro-batch split gives the same step, and a resumed run draws what the
uninterrupted one drew. Held-out rows take the same draws at every evaluation (`EVAL_STEP`), so
held-out losses before and after training compare the same noise; with `eval_draws` K > 1 each
held-out image is scored at K such draws (`EVAL_STEP + k`, each from the training density), so
the held-out loss is the mean of K times as many draws: the same expectation, less noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from align_anything.backend.engine import InferenceEngine
from align_anything.families import diffusion
from align_anything.families.diffusion import PipelineInfo, adapters_disabled, outputs
from align_anything.families.diffusion.family import OutputCheck, PipelineSide
from align_anything.families.diffusion.forward import (
    NoiseDraw,
    TimestepSampling,
    batch_to,
    denoising_mse,
    draw_noise,
    draw_seed,
    paired_denoising_mse,
)
from align_anything.families.diffusion.latents import LatentRow, row_tensors
from align_anything.training.run import Run
from align_anything.training.sources import RowBatches

# The "step" of held-out draws: no optimizer step has this number, so a held-out row's noise
# never repeats a training draw, and it is the same at every evaluation.
EVAL_STEP = 2**40


@dataclass
class ImageBatch:
    """B captioned images: their cached tensors (`latents`, `prompt_embeds`, ...), each
    sample's noise draw, and for held-out rows scored at several draws
    (`Denoising.eval_draws`) the further ones."""

    tensors: dict[str, Tensor]
    draw: NoiseDraw
    further_draws: tuple[NoiseDraw, ...] = ()

    @property
    def all_draws(self) -> tuple[NoiseDraw, ...]:
        """Every draw of these images: the first, then the further ones."""
        return (self.draw, *self.further_draws)

    @property
    def size(self) -> int:
        return int(self.draw.noise.shape[0])


@dataclass
class ImagePairBatch:
    """B preference pairs: the chosen and the rejected images' tensors (the same captions), and
    one noise draw per pair that both images share (Diffusion-DPO's shared noise and
    timestep)."""

    chosen: dict[str, Tensor]
    rejected: dict[str, Tensor]
    draw: NoiseDraw

    @property
    def size(self) -> int:
        return int(self.draw.noise.shape[0])


@dataclass
class Denoising:
    """The denoising pass of a run: which pipeline kind (target and conditioning), the
    training noise scheduler, how noise levels are drawn, the run's seed, and the dtype and
    device the denoiser computes in."""

    info: PipelineInfo
    scheduler: Any
    sampling: TimestepSampling
    seed: int
    dtype: torch.dtype
    device: torch.device
    guidance: float  # Flux's guidance embedding in training
    eval_draws: int = 1  # draws per held-out image (diffusion_sft.eval_draws)

    def draws(self, rows: list[LatentRow], latent_shape: Any, *, draw: int = 0) -> NoiseDraw:
        """Each row's noise and noise level, seeded by (seed, step, position in its split); a
        held-out row's `draw`-th draw by step `EVAL_STEP + draw`."""
        seeds = [
            draw_seed(self.seed, EVAL_STEP + draw if row.step is None else row.step, row.position)
            for row in rows
        ]
        return draw_noise(self.info, self.scheduler, latent_shape, seeds, sampling=self.sampling)

    def collate_images(self, rows: list[LatentRow]) -> ImageBatch:
        """Rows as a batch with their draws: held-out rows with `eval_draws` of them."""
        tensors = row_tensors(rows)
        shape = tuple(tensors["latents"].shape[1:])
        held_out = all(row.step is None for row in rows)
        further = range(1, self.eval_draws) if held_out else range(0)
        return ImageBatch(
            tensors,
            self.draws(rows, shape),
            tuple(self.draws(rows, shape, draw=k) for k in further),
        )

    def collate_pairs(self, rows: list[LatentRow]) -> ImagePairBatch:
        chosen, rejected = row_tensors(rows)
        return ImagePairBatch(
            chosen, rejected, self.draws(rows, tuple(chosen["latents"].shape[1:]))
        )

    def _on_device(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return batch_to(tensors, self.device, self.dtype)

    def mse(self, model: Any, batch: ImageBatch) -> Tensor:
        """[B]: each image's MSE against the target under `model` (the engine or a
        reference)."""
        tensors = self._on_device(batch.tensors)
        return denoising_mse(
            model, self.info, self.scheduler, tensors, batch.draw, guidance=self.guidance
        )

    def paired_mse(self, model: Any, batch: ImagePairBatch) -> tuple[Tensor, Tensor]:
        """([B], [B]): the chosen and rejected images' MSEs, one forward pass of 2B samples."""
        return paired_denoising_mse(
            model, self.info, self.scheduler, self._on_device(batch.chosen),
            self._on_device(batch.rejected), batch.draw, guidance=self.guidance,
        )  # fmt: skip


def denoising(run: Run, section: Any, *, eval_draws: int = 1) -> Denoising:
    """The run's denoising pass (the task section's noise-level density and Flux guidance);
    `eval_draws`: the draws each held-out image is scored at."""
    model: PipelineSide = run.model
    return Denoising(
        info=model.info, scheduler=model.parts.noise_scheduler,
        sampling=TimestepSampling(
            section.timestep_sampling, section.logit_mean, section.logit_std, section.mode_scale
        ),
        seed=run.cfg.train.seed, dtype=next(run.policy.module.parameters()).dtype,
        device=run.policy.device, guidance=section.flux_guidance, eval_draws=eval_draws,
    )  # fmt: skip


class BaseDenoiser:
    """The Diffusion-DPO reference of a LoRA run: the policy engine itself, in eval mode, with
    its adapters disabled (no second copy of the weights). Called like a model."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @torch.no_grad()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        was_training = self.engine.module.training
        self.engine.eval()
        try:
            with adapters_disabled(self.engine.module):
                return self.engine(*args, **kwargs)
        finally:
            if was_training:
                self.engine.train()

    def release(self) -> None:
        """Nothing to free: the weights are the policy's."""


@dataclass
class Pictures:
    """What a pipeline task draws besides its loss: the samples (before training, after it,
    every `logging.samples_every` steps) and the held-out check of built-in data (before and
    after)."""

    run: Run
    samples: outputs.Samples
    check: OutputCheck | None
    check_samples: int
    section: Any
    shown: list[str] = field(default_factory=list)

    def evaluate(self, label: str) -> dict[str, float]:
        """`eval/<medium>_check` (where the data has a check), and the samples before and
        after training. Collective."""
        results = outputs.run_check(
            self.run, self.check, samples=self.check_samples, section=self.section
        )
        if label in ("before", "after"):
            self.samples.draw(label)
        return results

    def after_step(self, step: int) -> None:
        self.samples.after_step(step)


def build_reference(run: Run) -> tuple[Any, str]:
    """The frozen base denoiser (Diffusion-DPO's reference, the KL reference of the GRPO
    tasks) and its summary line: the policy with adapters disabled in a LoRA run, else the
    denoiser loaded again from the folder (never a resumed checkpoint) in a frozen inference
    engine (under ZeRO-3 partitioned like the policy)."""
    if run.cfg.model.lora.enabled:
        line = "the base denoiser: the policy with its adapters disabled (no copy)"
        return BaseDenoiser(run.policy), line
    model: PipelineSide = run.model
    ds_plan = run.ds_plan
    base = diffusion.load_denoiser(
        model.info, dtype=next(run.policy.module.parameters()).dtype, ds_config=ds_plan.config
    )
    engine = InferenceEngine(base, ds_plan.reference_config(offload=False))
    where = "partitioned ZeRO-3 inference engine" if engine.stage == 3 else "frozen copy"
    return engine, f"the base denoiser: {where}, no gradients or optimizer state"


def pictures(run: Run, section: Any) -> Pictures:
    """The run's samples and held-out check; their start-up summary lines."""
    check = outputs.output_check(run)
    samples = outputs.build_samples(run, section)
    run.summary.append(samples.describe())
    if check is not None and section.check_samples:
        count = min(section.check_samples, len(check.captions))
        run.summary.append(
            f"  {run.model.medium.name} check     {count} held-out captions with their seeds, "
            f"before and after training: the share whose {run.model.medium.name} passes the "
            f"{check.name} rule (eval/{run.model.medium.name}_check)"
        )
    return Pictures(run, samples, check, section.check_samples, section)


def image_rows(run: Run, collate: Any) -> RowBatches:
    """The training rows as a step source: seeded batches of the latent cache's rows (the
    offline tasks' `RowBatches`), each row drawn by the step that reads it (its noise seed)."""
    rows = run.data.train
    return RowBatches(
        rows, run.ds_plan.batch, rank=run.dist.rank, seed=run.cfg.train.seed,
        steps_per_epoch=run.schedule.steps_per_epoch, collate=collate, device=run.policy.device,
        rows_of_step=lambda step, indices: [rows[i].at(step) for i in indices],
    )  # fmt: skip
