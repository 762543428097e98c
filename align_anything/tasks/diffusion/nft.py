"""DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117): online RL of a text-to-image pipeline on
the forward (noising) process, with no likelihood at all.

A round: G images per prompt sampled by the old policy with any sampler (here the rollout
sampler of `families.diffusion.sde` with `sample_noise`; 0: the deterministic ODE / DDIM), only
their clean latents kept; their rewards mapped to an optimality r ∈ [0, 1] per prompt group
(`losses.nft_optimality`: ½ + ½·clip(A / adv_clip_max, −1, 1), A the group-relative advantage).
Each step noises every image afresh (noise and noise level seeded by (train.seed, step, image):
`forward.draw_noise`, the training density of `diffusion_sft`) and trains on the paper's eq. 8,

    r·‖v⁺ − v‖² + (1 − r)·‖v⁻ − v‖²,   v⁺ = (1 − β)·v_old + β·v_θ,   v⁻ = (1 + β)·v_old − β·v_θ

(`losses.nft_loss`), v the forward process's target (the flow velocity ε − x₀; for SD-style
UNets their own ε or v), v_θ the trained denoiser's conditional prediction, v_old the old
policy's. The mean over the images of the global batch.

The old policy is an exponential average of the trained weights (`OldPolicy`, `old_decay` η:
old ← η·old + (1 − η)·θ after every step), as the paper's soft update: a whole fp32 copy of the
trained parameters on every rank (with LoRA: the adapters only), swapped into the denoiser for
sampling and for v_old (under ZeRO-3 inside the one gather of `gathered_for_generation`, once
per round and once per step), saved in every checkpoint (`nft_old.safetensors`). η = 0 keeps
no copy: the old policy is the trained one, v_old = v_θ without gradient. Classifier-free
guidance is for the rollout only (the paper's method is CFG-free; `guidance_scale` 1 is its
setting): the loss trains the conditional prediction.

Not done: the paper's code weighs the loss in x₀ space by an adaptive factor (the mean
|x̂₀ − x₀| of each sample); this is the velocity form of its eq. 8.

Logged: the round's figures and `nft/r_mean|std`; per step `loss`, `nft/mse` (v_θ against the
target), `nft/old_deviation` (‖v_θ − v_old‖², 0 when η = 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from align_anything.backend.engine import gathered
from align_anything.backend.params import full_numel
from align_anything.config import RunConfig
from align_anything.errors import ConfigError
from align_anything.families.diffusion import sde
from align_anything.families.diffusion.family import PipelineSide
from align_anything.families.diffusion.forward import (
    TimestepSampling,
    draw_noise,
    draw_seed,
    noisy_latents_and_target,
)
from align_anything.families.pipelines import PIPELINES
from align_anything.losses import nft_loss, nft_optimality, per_sample_mse
from align_anything.tasks.diffusion import online, rounds
from align_anything.training.batching import to_device
from align_anything.training.run import Run
from align_anything.training.task import TaskSpec

OLD_POLICY_FILE = "nft_old.safetensors"
# Elements gathered per collective under ZeRO-3 (as the weight average's, `training.ema`).
GATHER_GROUP_ELEMENTS = 2**24


class OldPolicy:
    """DiffusionNFT's old policy: the exponential average of `engine`'s trained parameters,
    whole and fp32 on every rank's device (see the module docstring)."""

    def __init__(self, engine: Any, *, decay: float) -> None:
        self.engine = engine
        self.decay = decay
        self.params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        self.average: dict[str, Tensor] = {}
        # (the module last swapped, its trained parameters with their names): found once.
        self._targets: tuple[Any, list[tuple[Any, str]]] | None = None

        def keep(names: list[str], values: list[Tensor]) -> None:
            self.average.update((n, v.clone()) for n, v in zip(names, values, strict=True))

        self._visit(keep)

    def _visit(self, fn: Any) -> None:
        """fn(names, their whole fp32 values) for the trained parameters, a group at a time, on
        every rank (under ZeRO-3 each group gathered at once: collective)."""
        stage = self.engine.zero_stage
        group: list[tuple[str, Any]] = []
        size = 0
        groups = [group]
        for name, param in self.params:
            if group and size + full_numel(param) > GATHER_GROUP_ELEMENTS:
                group, size = [], 0
                groups.append(group)
            group.append((name, param))
            size += full_numel(param)
        for part in groups:
            with gathered([p for _, p in part], stage):
                fn([name for name, _ in part], [param.detach().float() for _, param in part])

    @torch.no_grad()
    def update(self) -> None:
        """old ← decay·old + (1 − decay)·θ (after every optimizer step). Collective."""

        def blend(names: list[str], values: list[Tensor]) -> None:
            average = [self.average[n] for n in names]
            torch._foreach_mul_(average, self.decay)
            torch._foreach_add_(average, values, alpha=1.0 - self.decay)

        self._visit(blend)

    @contextlib.contextmanager
    def swapped(self, module: Any) -> Iterator[None]:
        """The old weights in `module`'s trained parameters for the block (`module` whole: the
        engine's module outside ZeRO-3, inside `gathered_for_generation` under it), the
        trained ones back after it."""
        if self._targets is None or self._targets[0] is not module:
            named = module.named_parameters()
            self._targets = (module, [(p, n) for n, p in named if n in self.average])
        kept = []
        try:
            for param, name in self._targets[1]:
                kept.append((param, param.data))
                param.data = self.average[name].to(param.data.dtype)
            yield
        finally:
            for param, data in kept:
                param.data = data

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.cpu().contiguous() for k, v in self.average.items()},
                  str(folder / OLD_POLICY_FILE))  # fmt: skip

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        path = folder / OLD_POLICY_FILE
        if not path.is_file():
            raise ConfigError(
                f"{folder} holds no {OLD_POLICY_FILE}: it is not a checkpoint of a "
                "diffusion_nft run with diffusion_nft.old_decay > 0"
            )
        saved = load_file(str(path))
        missing = sorted(set(self.average) - set(saved))
        if missing:
            raise ConfigError(
                f"{path} lacks {len(missing)} trained parameters of this run (e.g. "
                f"{missing[:3]}): it was written for another model or LoRA setting"
            )
        self.average = {k: saved[k].to(v.device, torch.float32) for k, v in self.average.items()}


@dataclass
class NFT:
    """DiffusionNFT (the `online.ImageAlgorithm` of task=diffusion_nft)."""

    section: Any
    old: OldPolicy | None
    info: Any
    scheduler: Any  # the training noise scheduler (forward noising)
    sampling: TimestepSampling
    name: str = "diffusion_nft"
    shared_noise: bool = False
    metric_keys: tuple[str, ...] = ()

    def sampling_weights(self, module: Any) -> contextlib.AbstractContextManager[None]:
        return self.old.swapped(module) if self.old is not None else contextlib.nullcontext()

    def attach(
        self, task: online.ImageRL, current: online.ImageRound, trajectory: sde.Trajectory,
        rewards: Tensor,
    ) -> dict[str, float]:  # fmt: skip
        section = self.section
        r = nft_optimality(
            rewards, section.num_generations, scale_rewards=section.scale_rewards,
            cap=section.adv_clip_max,
        )  # fmt: skip
        current.tensors.update(final=trajectory.final, r=r.view(task.world, -1)[task.rank].clone())
        return {
            "nft/r_mean": float(r.mean()),
            "nft/r_std": float(r.std()) if r.numel() > 1 else 0.0,
        }

    def batch(self, task: online.ImageRL, records: dict[str, Tensor],
              step: int) -> online.ImageRLBatch:  # fmt: skip
        """The images noised afresh for step `step`: each image's noise and noise level from
        its own generator, seeded by (train.seed, step, image key)."""
        final = records["final"]
        seeds = [draw_seed(task.seed, step, int(key)) for key in records["key"]]
        draw = draw_noise(self.info, self.scheduler, tuple(final.shape[1:]), seeds,
                          sampling=self.sampling)  # fmt: skip
        noisy, target = noisy_latents_and_target(self.info, self.scheduler, final, draw)
        return to_device(
            online.ImageRLBatch(
                conditioning=task.conditioning(records["row"]), noisy=noisy, target=target,
                timesteps=draw.timesteps, r=records["r"],
            ),
            task.device,
        )  # fmt: skip

    def prediction(self, task: online.ImageRL, model: Any, batch: online.ImageRLBatch) -> Tensor:
        """The conditional prediction (Flux: at its guidance embedding)."""
        assert batch.noisy is not None and batch.timesteps is not None
        guidance = task.section.guidance_scale if self.info.kind == "flux" else 1.0
        return sde.guided_prediction(
            model, self.info, batch.noisy, batch.timesteps, batch.conditioning, None,
            guidance_scale=guidance,
        )  # fmt: skip

    @torch.no_grad()
    def before_losses(self, task: online.ImageRL, batches: Sequence[Any]) -> None:
        """v_old of every micro-batch of the step, with the old weights swapped in (under
        ZeRO-3 in one gather for the step). Collective."""
        if self.old is None:
            return
        with task.policy.gathered_for_generation() as module, self.old.swapped(module):
            for batch in batches:
                batch.old_prediction = self.prediction(task, module, batch).detach()

    def loss(self, task: online.ImageRL,
             batch: online.ImageRLBatch) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
        assert batch.target is not None and batch.r is not None
        prediction = self.prediction(task, task.policy, batch)
        old = batch.old_prediction if batch.old_prediction is not None else prediction.detach()
        per_image = nft_loss(prediction, old, batch.target, batch.r, beta=self.section.beta)
        with torch.no_grad():
            metrics = {
                "nft/mse": per_sample_mse(prediction, batch.target).sum(),
                "nft/old_deviation": per_sample_mse(prediction, old).sum(),
            }
        return per_image.sum(), metrics

    def after_step(self, task: online.ImageRL, step: int) -> None:
        if self.old is not None:
            self.old.update()

    def save(self, folder: Path, *, is_main: bool) -> None:
        if self.old is not None and is_main:
            self.old.save(folder)

    def load(self, folder: Path) -> None:
        if self.old is not None:
            self.old.load(folder)


def check(cfg: RunConfig, model: PipelineSide) -> None:
    """Before any data: the sampler and the rewards."""
    section = cfg.diffusion_nft
    assert section is not None
    online.rollout_sampler(cfg, model, noise=section.sample_noise, needs_log_probs=False,
                           what="diffusion_nft.sample_noise")  # fmt: skip
    online.check_rewards(cfg)


def build(run: Run) -> tuple[online.ImageRL, rounds.ImageRounds]:
    section = run.cfg.diffusion_nft
    assert section is not None
    sampler = online.rollout_sampler(run.cfg, run.model, noise=section.sample_noise,
                                     needs_log_probs=False, what="diffusion_nft.sample_noise")  # fmt: skip
    old = OldPolicy(run.policy, decay=section.old_decay) if section.old_decay > 0 else None
    algorithm = NFT(
        section, old, run.model.info, run.model.parts.noise_scheduler,
        TimestepSampling(section.timestep_sampling, section.logit_mean, section.logit_std,
                         section.mode_scale),
    )  # fmt: skip
    where = (
        f"an average of the trained weights (decay {section.old_decay:g}), fp32 on every rank"
        if old is not None else "the trained weights (old_decay=0: no copy)"
    )  # fmt: skip
    lines = [
        f"  old policy      {where}; it samples the rounds and gives v_old",
        f"  loss            r |v+ - v|^2 + (1 - r) |v- - v|^2, beta {section.beta:g}, r from "
        f"advantages capped at +-{section.adv_clip_max:g}; a fresh noise draw per image and "
        "step",
    ]
    return rounds.build_image_rl(run, algorithm, sampler, lines=lines)


SPEC = TaskSpec(
    name="diffusion_nft", record_kind="prompts", family=PIPELINES, encoding=None, build=build,
    check=check, schedule=online.schedule,
)  # fmt: skip
