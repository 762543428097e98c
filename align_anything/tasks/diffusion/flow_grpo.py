"""Flow-GRPO (Liu et al. 2025, arXiv:2505.05470): GRPO for flow-matching text-to-image
pipelines (SD3, Flux), whose deterministic sampler is turned into an SDE with the same
marginals (`families.diffusion.sde`, "flow_sde": σ_t = a·√(t/(1 − t))), so every denoising
step is a Gaussian with a known log-probability.

The algorithm, shared with DanceGRPO (`dance_grpo.py`, the same on DDIM with eta): a round of
G images per prompt (`tasks/diffusion/online.py`), their rewards turned into group-relative
advantages capped at ±`adv_clip_max` (`losses.capped_group_advantages`), and per trained
denoising step k of image i the clipped ratio of eq. 6,

    −min(ρ_ik·A_i, clip(ρ_ik, 1 − ε, 1 + ε_high)·A_i) + β·KL_ik,
    ρ_ik = π_θ(x_{k+1} | x_k) / π_old(x_{k+1} | x_k)

(`losses.step_policy_loss`), KL_ik the Gaussian KL of the step to the reference's step from the
same latent (`losses.gaussian_kl`: the base denoiser, with LoRA the adapters disabled), averaged
over the image's trained steps and then over the images of the global batch. The trained steps
are `train_fraction` of the trajectory's stochastic steps, a seeded choice per image and round
(DanceGRPO's timestep selection; Flow-GRPO's `timestep_fraction`). The log-probs are recomputed
with gradients from the stored trajectory, under the rollout's classifier-free guidance. With
`num_iterations` = 1 the old policy is the one being trained (`logps.detach()`: ratio 1 exactly,
no clip); with more, the round's no-grad pass after sampling gives the old log-probs, through
the same engine call as the loss.

Logged: the round's (`reward`, ..., `advantages/mean|std`), and per step `loss`,
`clip_ratio` (the share of trained steps whose clip bites), `clip_ratio/low_mean|high_mean`,
`ratio/mean`, `kl` (β > 0).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from align_anything.config import RunConfig
from align_anything.errors import ConfigError
from align_anything.families.diffusion import sde
from align_anything.families.diffusion.family import PipelineSide
from align_anything.families.diffusion.forward import draw_seed
from align_anything.families.pipelines import PIPELINES
from align_anything.losses import capped_group_advantages, gaussian_kl, step_policy_loss
from align_anything.tasks.diffusion import online, rounds
from align_anything.tasks.diffusion.common import build_reference
from align_anything.training.batching import to_device
from align_anything.training.run import Run
from align_anything.training.task import TaskSpec

# Mixed into a trained-step choice's seed, so it is not the image's noise stream.
_STEPS_SALT = 0x57E95


@dataclass
class StepGRPO:
    """GRPO over denoising steps (the `online.ImageAlgorithm` of Flow-GRPO and DanceGRPO)."""

    section: Any
    name: str
    shared_noise: bool = False
    metric_keys: tuple[str, ...] = ()

    def sampling_weights(self, module: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def trained_steps(self, task: online.ImageRL, round_index: int, keys: list[int]) -> Tensor:
        """[N, J] each image's trained steps, ascending: J = `train_fraction` of the sampler's
        stochastic steps (at least one), chosen by a generator seeded by the image's key."""
        stochastic = torch.tensor(task.sampler.stochastic_steps())
        chosen = max(1, round(self.section.train_fraction * len(stochastic)))
        steps = []
        for key in keys:
            seed = draw_seed(task.seed, round_index, 2 * key) ^ _STEPS_SALT
            order = torch.randperm(len(stochastic), generator=torch.Generator().manual_seed(seed))
            steps.append(stochastic[order[:chosen]].sort().values)
        return torch.stack(steps)

    def attach(
        self, task: online.ImageRL, current: online.ImageRound, trajectory: sde.Trajectory,
        rewards: Tensor,
    ) -> dict[str, float]:  # fmt: skip
        section = self.section
        advantages = capped_group_advantages(
            rewards, section.num_generations, section.scale_rewards, cap=section.adv_clip_max
        )
        keys = current.tensors["key"].tolist()
        current.tensors.update(
            latents=trajectory.latents,
            advantage=advantages.view(task.world, -1)[task.rank].clone(),
            steps=self.trained_steps(task, current.index, keys),
        )  # fmt: skip
        figures = {
            "advantages/mean": float(advantages.mean()),
            "advantages/std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        }
        if section.num_iterations > 1:
            figures.update(self.old_log_probs(task, current, trajectory))
        return figures

    @torch.no_grad()
    def old_log_probs(self, task: online.ImageRL, current: online.ImageRound,
                      trajectory: sde.Trajectory) -> dict[str, float]:  # fmt: skip
        """The old policy's log-probs of the trained steps, through the engine call the loss
        makes (the ratio of the round's first step is then 1 but for the batch's
        arithmetic), and how far they are from those measured while sampling. Collective
        under ZeRO-3 (every rank runs the same number of micro-batches)."""
        micro, old = task.micro_batch, []
        for start in range(0, current.size, micro):
            records = {k: v[start : start + micro] for k, v in current.tensors.items()}
            batch = self.batch(task, records, step=-1)
            logps, _ = self.step_log_probs(task, task.policy, batch)
            old.append(logps.float().cpu())
        current.tensors["old_logps"] = torch.cat(old)
        sampled = trajectory.log_probs.gather(1, current.tensors["steps"])
        difference = (current.tensors["old_logps"] - sampled).abs()
        return {"sampling/logp_difference/max": float(difference.max())}

    def batch(self, task: online.ImageRL, records: dict[str, Tensor],
              step: int) -> online.ImageRLBatch:  # fmt: skip
        return to_device(
            online.ImageRLBatch(
                conditioning=task.conditioning(records["row"]), advantages=records["advantage"],
                latents=records["latents"], steps=records["steps"],
                old_logps=records.get("old_logps"),
            ),
            task.device,
        )  # fmt: skip

    def step_log_probs(
        self, task: online.ImageRL, model: Any, batch: online.ImageRLBatch
    ) -> tuple[Tensor, sde.StepGaussian]:
        """[B, J] the trained steps' log-probs under `model` (one denoiser pass of B·J rows,
        the rollout's guidance), and their Gaussians."""
        assert batch.steps is not None and batch.latents is not None
        chosen = batch.steps.shape[1]
        conditioning = {
            k: v.repeat_interleave(chosen, dim=0) for k, v in batch.conditioning.items()
        }
        return sde.trained_step_log_probs(
            task.model_output(model, conditioning), task.sampler, batch.latents, batch.steps
        )

    def before_losses(self, task: online.ImageRL, batches: Any) -> None:
        return None

    def loss(self, task: online.ImageRL,
             batch: online.ImageRLBatch) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
        section = self.section
        logps, gaussian = self.step_log_probs(task, task.policy, batch)
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        kl = None
        if section.beta > 0:
            with torch.no_grad():
                _, reference = self.step_log_probs(task, task.reference, batch)
            kl = gaussian_kl(gaussian.mean, reference.mean, gaussian.std).reshape(logps.shape)
        low, high = section.clip_range()
        assert batch.advantages is not None
        out = step_policy_loss(
            logps, old.to(logps), batch.advantages.to(logps), epsilon_low=low,
            epsilon_high=high, kl=kl, beta=section.beta,
        )  # fmt: skip
        per_image = out.loss.mean(dim=1)
        metrics = {
            "clip_ratio": out.clip.is_region_clipped.mean(dim=1).sum(),
            "clip_ratio/low_mean": out.clip.is_low_clipped.mean(dim=1).sum(),
            "clip_ratio/high_mean": out.clip.is_high_clipped.mean(dim=1).sum(),
            "ratio/mean": out.ratio.mean(dim=1).sum(),
        }
        if kl is not None:
            metrics["kl"] = kl.detach().mean(dim=1).sum()
        return per_image.sum(), metrics

    def after_step(self, task: online.ImageRL, step: int) -> None:
        return None

    def save(self, folder: Any, *, is_main: bool) -> None:
        return None

    def load(self, folder: Any) -> None:
        return None


def grpo_parts(run: Run, sampler: sde.Sampler) -> tuple[Any, list[str]]:
    """The KL reference (β > 0; none otherwise) and the summary lines of the GRPO tasks."""
    section = run.cfg.section()
    stochastic = len(sampler.stochastic_steps())
    chosen = max(1, round(section.train_fraction * stochastic))
    low, high = section.clip_range()
    lines = [
        f"  trained steps   {chosen} of the {stochastic} stochastic steps per image "
        f"({run.cfg.task}.train_fraction={section.train_fraction:g}), the ratio clipped to "
        f"[1 - {low:g}, 1 + {high:g}], advantages capped at +-{section.adv_clip_max:g}"
    ]
    if section.beta <= 0:
        return None, [*lines, f"  reference       none ({run.cfg.task}.beta=0)"]
    reference, line = build_reference(run)
    return reference, [*lines, f"  reference       {line} (KL weight {section.beta:g})"]


def check(cfg: RunConfig, model: PipelineSide) -> None:
    """Before any data: a flow-matching pipeline, a sampler with a density, the rewards."""
    info = model.info
    if not info.flow:
        raise ConfigError(
            f"task=flow_grpo samples with the flow SDE of flow-matching pipelines (sd3, flux), "
            f"but {info.name} is a {info.kind} pipeline ({info.prediction} prediction): use "
            "task=dance_grpo (DDIM with eta, the same GRPO) or task=diffusion_nft"
        )
    section = cfg.flow_grpo
    assert section is not None
    online.rollout_sampler(
        cfg, model, noise=section.noise_level, needs_log_probs=True,
        what=f"flow_grpo.noise_level={section.noise_level:g}",
    )  # fmt: skip
    online.check_rewards(cfg)


def build(run: Run) -> tuple[online.ImageRL, rounds.ImageRounds]:
    section = run.cfg.flow_grpo
    assert section is not None
    sampler = online.rollout_sampler(
        run.cfg, run.model, noise=section.noise_level, needs_log_probs=True,
        what="flow_grpo.noise_level",
    )  # fmt: skip
    reference, lines = grpo_parts(run, sampler)
    algorithm = StepGRPO(section, name="flow_grpo")
    return rounds.build_image_rl(run, algorithm, sampler, reference=reference, lines=lines)


SPEC = TaskSpec(
    name="flow_grpo", record_kind="prompts", family=PIPELINES, encoding=None, build=build,
    check=check, schedule=online.schedule,
)  # fmt: skip
