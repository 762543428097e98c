"""DanceGRPO (Xue et al. 2025, arXiv:2505.07818) for SD-style UNets (epsilon and v-prediction:
SD 1.x/2.x, SDXL): Flow-GRPO's algorithm (`flow_grpo.StepGRPO`) on DDIM with eta > 0, the
stochastic sampler DDPO (Black et al. 2023) trains SD with, whose every step is a Gaussian with
a known mean and standard deviation (`families.diffusion.sde`, "ddim"). On a flow-matching
pipeline it samples with Flow-GRPO's flow SDE (`dance_grpo.noise_level`), as DanceGRPO does for
FLUX.

DanceGRPO's choices beside the sampler: the G images of a prompt start from the same initial
noise (`shared_noise`, so their rewards differ by the sampler's noise and the policy alone),
and only a share of the denoising steps is trained (`train_fraction`). eta = 0 (deterministic
DDIM) has no log-probability and is refused before any compute.
"""

from __future__ import annotations

from align_anything.config import RunConfig
from align_anything.families.diffusion.family import PipelineSide
from align_anything.families.pipelines import PIPELINES
from align_anything.tasks.diffusion import online, rounds
from align_anything.tasks.diffusion.flow_grpo import StepGRPO, grpo_parts
from align_anything.training.run import Run
from align_anything.training.task import TaskSpec


def noise_setting(cfg: RunConfig, model: PipelineSide) -> tuple[float, str]:
    """(the rollout's noise, the setting that gives it): eta for the UNets, the flow SDE's a
    for flow-matching pipelines."""
    section = cfg.dance_grpo
    assert section is not None
    if model.info.flow:
        return section.noise_level, f"dance_grpo.noise_level={section.noise_level:g}"
    return section.eta, f"dance_grpo.eta={section.eta:g}"


def check(cfg: RunConfig, model: PipelineSide) -> None:
    """Before any data: a sampler with a density (eta > 0), the rewards."""
    noise, what = noise_setting(cfg, model)
    online.rollout_sampler(cfg, model, noise=noise, needs_log_probs=True, what=what)
    online.check_rewards(cfg)


def build(run: Run) -> tuple[online.ImageRL, rounds.ImageRounds]:
    section = run.cfg.dance_grpo
    assert section is not None
    noise, what = noise_setting(run.cfg, run.model)
    sampler = online.rollout_sampler(run.cfg, run.model, noise=noise, needs_log_probs=True,
                                     what=what)  # fmt: skip
    reference, lines = grpo_parts(run, sampler)
    shared = "the G images of a prompt from one initial noise" if section.shared_noise else (
        "each image from its own initial noise"
    )  # fmt: skip
    algorithm = StepGRPO(section, name="dance_grpo", shared_noise=section.shared_noise)
    return rounds.build_image_rl(
        run, algorithm, sampler, reference=reference, lines=[*lines, f"  noise           {shared}"]
    )


SPEC = TaskSpec(
    name="dance_grpo", record_kind="prompts", family=PIPELINES, encoding=None, build=build,
    check=check, schedule=online.schedule,
)  # fmt: skip
