"""What the pipeline tasks draw from the denoiser as it trains: outputs for captions and seeds
(`draw`), the samples (`Samples`) and the held-out check of built-in data (`run_check`, with
the medium's `OutputCheck`).

`Samples` draws outputs for fixed prompts and seeds from the current denoiser, each rank a
share of them (under ZeRO-3 the denoiser is gathered once for the whole sampling loop), and
writes them with the medium's writer to `output_dir/samples/` and to TensorBoard or wandb.
`OutputCheck` is a rule on what is drawn for held-out captions (the shapes world's colour rule
for images, the tones world's pitch and envelope rule for sounds), which each medium's room
defines (`Medium.check`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from align_anything.backend import distributed as comm
from align_anything.backend.engine import Engine
from align_anything.families.diffusion.family import OutputCheck, PipelineSide
from align_anything.training.run import Run

SAMPLES_DIR = "samples"
DEFAULT_SAMPLE_PROMPTS = 4  # held-out captions drawn when logging.sample_prompts is null


def draw(
    model: PipelineSide, policy: Engine, prompts: Sequence[str], seeds: Sequence[int], *,
    steps: int, guidance_scale: float, rank: int, world: int,
) -> list[np.ndarray]:  # fmt: skip
    """One output per (prompt, seed) as the medium samples it, each rank drawing a share
    (under ZeRO-3 the denoiser is gathered once for the whole loop), every rank getting all of
    them. An output depends only on its prompt, its seed and the weights. Collective."""
    mine = list(range(rank, len(prompts), world))  # every world-th output
    outputs = model.medium.sample(
        model.parts, [prompts[i] for i in mine], [seeds[i] for i in mine],
        resolution=model.resolution, steps=steps, guidance_scale=guidance_scale,
        gathered=policy.gathered_for_generation,
    )  # fmt: skip
    drawn = dict(zip(mine, outputs, strict=True))
    merged: dict[int, np.ndarray] = {}
    for shard in comm.all_gather_objects(drawn):
        merged.update(shard)
    return [merged[i] for i in range(len(prompts))]


@dataclass
class Samples:
    """Samples for fixed `prompts` (rows) and `seeds` (columns) from the current denoiser,
    before training, after it and every `every` steps, written by the medium to
    `output_dir/samples/step-N.*` and to the metrics backends (rank 0)."""

    run: Run
    prompts: list[str]
    seeds: list[int]
    steps: int
    guidance_scale: float
    every: int

    def draw(self, label: str) -> Path | None:
        """Draw and save the samples of the current weights (`label`: "before", "after",
        "step N"). Collective."""
        if not self.prompts:
            return None
        run = self.run
        model: PipelineSide = run.model
        pairs = [(p, s) for p in self.prompts for s in self.seeds]
        outputs = draw(
            model, run.policy, [p for p, _ in pairs], [s for _, s in pairs], steps=self.steps,
            guidance_scale=self.guidance_scale, rank=run.dist.rank, world=run.dist.world_size,
        )  # fmt: skip
        if not run.dist.is_main:
            return None
        from PIL import Image

        step = run.state.step
        columns = len(self.seeds)
        rows = [outputs[r * columns : (r + 1) * columns] for r in range(len(self.prompts))]
        path = model.medium.save_samples(
            rows, run.output.path / SAMPLES_DIR / f"step-{step:06d}", self.prompts,
            [f"seed {s}" for s in self.seeds],
        )  # fmt: skip
        if run.logger is not None:
            with Image.open(path) as still:
                run.logger.log_image(step, "samples", still.convert("RGB"), caption=label)
            if model.medium.name == "audio":  # the WAVs beside the spectrogram grid
                run.logger.log_audio(step, "samples", sorted(path.with_suffix("").glob("*.wav")))
        return path

    def after_step(self, step: int) -> None:
        """The samples every `every` steps (the last step's are the "after" ones).
        Collective."""
        if self.every and step % self.every == 0 and step != self.run.schedule.total_steps:
            self.draw(f"step {step}")

    def describe(self) -> str:
        when = f"every {self.every} steps, " if self.every else ""
        return (
            f"  samples         {len(self.prompts)} prompts x {len(self.seeds)} seeds, "
            f"{self.steps} sampler steps, before training, {when}after it -> "
            f"{self.run.output.path / SAMPLES_DIR}"
        )


def build_samples(run: Run, section: Any) -> Samples:
    """The run's samples from `logging.sample_prompts` (null: the first held-out captions)
    and `logging.sample_seeds`, drawn with the task section's sampler settings."""
    logging = run.cfg.logging
    prompts = logging.sample_prompts
    if prompts is None:
        prompts = list(dict.fromkeys(run.data.eval_records))[:DEFAULT_SAMPLE_PROMPTS]
    return Samples(
        run=run, prompts=list(prompts), seeds=list(logging.sample_seeds),
        steps=section.sample_steps, guidance_scale=section.guidance_scale,
        every=logging.samples_every,
    )  # fmt: skip


def output_check(run: Run) -> OutputCheck | None:
    """The held-out check of the run's data (built-in data only), as its medium defines it."""
    data = run.cfg.data
    model: PipelineSide = run.model
    return model.medium.check(data.eval_path or data.path)


def run_check(run: Run, check: OutputCheck | None, *, samples: int, section: Any) -> dict:
    """`eval/<medium>_check`: the share of outputs for the first `samples` held-out captions
    that pass the check; nothing without a check or with `samples` 0. Collective."""
    if check is None or not samples:
        return {}
    model: PipelineSide = run.model
    captions, seeds = check.captions[:samples], check.seeds[:samples]
    outputs = draw(
        model, run.policy, captions, seeds, steps=section.sample_steps,
        guidance_scale=section.guidance_scale, rank=run.dist.rank, world=run.dist.world_size,
    )  # fmt: skip
    return {f"eval/{model.medium.name}_check": float(check.rule(outputs, captions))}
