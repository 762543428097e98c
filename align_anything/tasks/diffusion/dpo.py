"""Diffusion-DPO (Wallace et al. 2023) of a text-to-image pipeline's denoiser on preference
pairs of images (Pick-a-Pic's shape: a caption, two images, which one is preferred).

Both images of a pair are noised with the same noise at the same timestep (one draw per pair,
seeded by the pair's row and the step) and go through the policy in one forward pass; their
per-sample MSEs θ_w, θ_l against the target, and the frozen reference's ref_w, ref_l, give
logits = (ref_w − ref_l) − (θ_w − θ_l) and the loss −log σ(β·logits) (hinge, IPO:
`losses.diffusion_dpo_loss`; `diffusion_dpo.sft_weight` w adds w·θ_w, the chosen image's own
denoising loss), averaged over every pair of the global batch. The reference is
the base denoiser as loaded at the start of the run: a frozen copy (under ZeRO-3 a partitioned
inference engine), or in a LoRA run the policy itself with its adapters disabled (no second
copy).

Logged (as TRL's DPO names them, with the MSEs standing in for log-probs): `loss`,
`rewards/chosen` β·(ref_w − θ_w), `rewards/rejected`, `rewards/margins`, `rewards/accuracies`
(a tie counts ½), `mse/policy_chosen|rejected`, `mse/ref_chosen|rejected`; held out: the same as
`eval/*` at fixed draws, and `eval/image_check` for built-in data. At step 0 policy and
reference agree, so the sigmoid loss is ln 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from align_anything.families.pipelines import PIPELINES
from align_anything.losses.diffusion import diffusion_dpo_loss
from align_anything.tasks.diffusion.common import (
    Denoising,
    ImagePairBatch,
    Pictures,
    build_reference,
    denoising,
    image_rows,
    pictures,
)
from align_anything.training.run import Run
from align_anything.training.sources import RowBatches
from align_anything.training.task import LossOutput, Task, TaskSpec

METRICS = (
    "loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
    "mse/policy_chosen", "mse/policy_rejected", "mse/ref_chosen", "mse/ref_rejected",
)  # fmt: skip


@dataclass
class DiffusionDPO(Task):
    """Diffusion-DPO on image pairs. `reference`: the frozen base denoiser (an
    `InferenceEngine`, or `BaseDenoiser` in a LoRA run); `sft_weight`: the weight of the chosen
    image's own MSE in each pair's loss (0: none)."""

    policy: Any
    reference: Any
    denoise: Denoising
    beta: float
    loss_type: str
    pictures: Pictures
    sft_weight: float = 0.0
    name: str = "diffusion_dpo"
    metric_keys: tuple[str, ...] = METRICS

    def collate(self, rows: list) -> ImagePairBatch:
        return self.denoise.collate_pairs(rows)

    def count_items(self, batch: ImagePairBatch) -> int:
        return batch.size

    def count_tokens(self, batch: ImagePairBatch) -> int:
        return 0  # images, not tokens: samples_per_second (pairs) is logged

    def loss(self, batch: ImagePairBatch, *, normalizer: float, training: bool) -> LossOutput:
        theta_w, theta_l = self.denoise.paired_mse(self.policy, batch)
        with torch.no_grad():
            ref_w, ref_l = self.denoise.paired_mse(self.reference, batch)
        out = diffusion_dpo_loss(
            theta_w, theta_l, ref_w, ref_l, beta=self.beta, loss_type=self.loss_type,
            sft_weight=self.sft_weight,
        )  # fmt: skip
        metrics = {"loss": out.losses.detach().sum()}
        metrics.update({key: value.sum() for key, value in out.metrics.items()})
        return LossOutput({"policy": out.losses.sum() / normalizer}, metrics)

    def after_step(self, step: int) -> None:
        self.pictures.after_step(step)

    def evaluate_extra(self, label: str) -> dict[str, float]:
        return self.pictures.evaluate(label)


def build(run: Run) -> tuple[DiffusionDPO, RowBatches]:
    section = run.cfg.diffusion_dpo
    reference, line = build_reference(run)
    run.summary.append(f"  reference       {line}")
    task = DiffusionDPO(
        policy=run.policy, reference=reference, denoise=denoising(run, section),
        beta=section.beta, loss_type=section.loss_type, sft_weight=section.sft_weight,
        pictures=pictures(run, section),
    )  # fmt: skip
    return task, image_rows(run, task.collate)


SPEC = TaskSpec(
    name="diffusion_dpo", record_kind="pairs", encoding=None, build=build, family=PIPELINES
)
