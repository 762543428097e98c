"""The memory planner behind `deepspeed=auto` and `python -m align_anything plan`: for each
shipped preset, the bytes one device needs, and which presets fit the device memory (or
`train.memory_budget_gb`) with 10% headroom. `deepspeed=auto` takes the lowest ZeRO stage that
fits: lower stages communicate less.

What a run needs depends on the kind of model, so each model family estimates its own runs
(`ModelFamily.estimate_memory`: the language family's in `families/language/memory.py`, the
diffusion pipelines' in `families/diffusion/memory.py`) with the shared accounting here:

- model states (`model_states`): DeepSpeed's own estimators
  (`estimate_zero2/3_model_states_mem_needs`) for mixed precision; for fp32 training (CPU) and
  LoRA, where DeepSpeed has no estimator, the same accounting by hand (weights, gradients and
  Adam moments of what trains, weights of what is frozen), partitioned as the stage
  partitions them;
- frozen models beside the trained one, activations of one micro-batch, and online RL's
  generation, as the family counts them (`Estimate`).

Everything is computed from the model's config (built on the meta device: no weights are
loaded), so planning a 70B model takes seconds on a laptop.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from align_anything.backend import ds_config as dsc
from align_anything.backend import memory
from align_anything.config import RunConfig
from align_anything.errors import ConfigError

# Lowest communication first: the order `deepspeed=auto` tries them in.
PRESET_ORDER = ("z0", "z2", "z3", "z3_offload")

HEADROOM = 0.9  # allocator fragmentation, communication buffers, CUDA context

GIB = 2**30


@dataclass(frozen=True)
class ParameterCounts:
    """A trained model's parameters: all, those that train (LoRA: the adapters'), and the most
    any one module holds (ZeRO-3 gathers one module at a time)."""

    total: int
    trainable: int
    largest_layer: int


@dataclass(frozen=True)
class Estimate:
    preset: str
    stage: int
    model_states: float  # bytes per device
    host: float  # bytes per node kept in host memory (offloaded states)
    reference: float
    activations: float
    paper: float  # the ZeRO paper's per-parameter figure × parameters (mixed-precision Adam)
    source: str
    # Online RL: memory while generating (ZeRO-3's gathered full weights, the KV cache, the
    # last position's logits); generation ends before the training forward, so the peak is the
    # larger of the two, not their sum.
    generation: float = 0.0

    @property
    def total(self) -> float:
        return self.model_states + self.reference + max(self.activations, self.generation)


@dataclass(frozen=True)
class FamilyEstimates:
    """A family's answer for one run: an `Estimate` per preset of `PRESET_ORDER`, the trained
    model's parameter counts, and the run's shape for the report ("max_length 512")."""

    estimates: list[Estimate]
    sizes: ParameterCounts
    shape: str


# What a model family gives the planner: (run config, world size, devices per node, precision)
# -> its estimates (`ModelFamily.estimate_memory`).
Estimator = Callable[[RunConfig, int, int, str], FamilyEstimates]


def paper_figure(total: int, stage: int, world_size: int) -> float:
    """The ZeRO paper's per-parameter bytes for mixed-precision Adam × parameters."""
    return memory.estimate_model_state_memory(total, stage, world_size, offload=False) * GIB


def model_states(
    sizes: ParameterCounts, ds_config: dict[str, Any], *, precision: str, world_size: int,
    gpus_per_node: int, nodes: int,
) -> tuple[float, float, str]:  # fmt: skip
    """(bytes per device, bytes per node in host memory, how it was estimated) of one trained
    model's weights, gradients and optimizer states under `ds_config`'s ZeRO stage."""
    stage = dsc.zero_stage_of(ds_config)
    offload_opt = dsc.offloads_optimizer(ds_config)
    offload_params = dsc.offloads_params(ds_config)
    n = world_size
    weight_bytes = 4 if precision == "fp32" else 2
    full_training = sizes.trainable == sizes.total and precision != "fp32"
    if full_training:
        host, device = memory.deepspeed_model_state_estimate(
            stage, total_params=sizes.total, largest_layer_params=sizes.largest_layer,
            gpus_per_node=gpus_per_node, nodes=nodes, offload_optimizer=offload_opt,
            offload_params=offload_params,
        )  # fmt: skip
        source = "DeepSpeed estimator"
        if stage != 3 and not offload_opt:
            host = 0  # the ZeRO-2 estimator's host figure is the load-time copy, not a steady state
    else:
        # By hand: fp32 (no 16-bit copy: weights 4, grads 4, Adam 8) or mixed precision (16-bit
        # weights and grads 2+2, fp32 master and Adam 12) for what trains; weights only for what
        # is frozen.
        trained, frozen = sizes.trainable, sizes.total - sizes.trainable
        w, g, opt = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
        shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n)}.get(stage, (n, n, n))
        weights = (trained * w + frozen * weight_bytes) / shard[0]
        grads = trained * g / shard[1]
        states = trained * opt / shard[2]
        host = 0.0
        if offload_opt:
            host += states * gpus_per_node
            states = 0.0
        if offload_params and stage == 3:
            host += weights * gpus_per_node
            weights = 4.0 * sizes.largest_layer
        device = weights + grads + states
        source = "by hand (fp32)" if precision == "fp32" else "by hand (LoRA)"
    return float(device), float(host), source


def device_budget(cfg: RunConfig, *, gpus_per_node: int) -> tuple[float, str]:
    """Bytes one device may use, and where the figure comes from."""
    if cfg.train.memory_budget_gb:
        return cfg.train.memory_budget_gb * GIB, "train.memory_budget_gb"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name} memory"
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    return total_kib * 1024 / gpus_per_node, f"system RAM / {gpus_per_node} local rank(s)"


def local_devices(world_size: int) -> int:
    """Devices (ranks) per node: the launcher's LOCAL_WORLD_SIZE, else all ranks on one node."""
    return min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def plan(
    cfg: RunConfig, estimator: Estimator, *, world_size: int, gpus_per_node: int | None = None
) -> tuple[FamilyEstimates, float, str]:
    """Estimates for every shipped preset (by the run's model family, `estimator`), the
    per-device budget and its source."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus_per_node = gpus_per_node or local_devices(world_size)
    precision = dsc.resolve_precision(
        cfg.train.precision,
        device,
        bf16_supported=device == "cuda" and torch.cuda.is_bf16_supported(),
    )
    figures = estimator(cfg, world_size, gpus_per_node, precision)
    budget, source = device_budget(cfg, gpus_per_node=gpus_per_node)
    return figures, budget, source


def choose_auto_preset(cfg: RunConfig, estimator: Estimator, *, world_size: int) -> tuple[str, str]:
    """deepspeed=auto: the lowest-stage shipped preset whose estimate fits, and why."""
    figures, budget, _ = plan(cfg, estimator, world_size=world_size)
    estimate, reason = choose(figures.estimates, budget)
    return estimate.preset, reason


def choose(estimates: list[Estimate], budget: float) -> tuple[Estimate, str]:
    """The lowest-stage preset whose estimate fits the budget (with headroom), and why."""
    limit = budget * HEADROOM
    for estimate in estimates:
        if estimate.total <= limit:
            skipped = estimates[: estimates.index(estimate)]
            why = "; ".join(f"{e.preset} needs {e.total / GIB:.2f} GiB" for e in skipped)
            reason = (
                f"{estimate.preset}: estimated {estimate.total / GIB:.2f} GiB per device fits "
                f"{limit / GIB:.2f} GiB (90% of {budget / GIB:.2f})"
                + (f", lower stages do not ({why})" if why else ", the lowest ZeRO stage")
            )
            return estimate, reason
    smallest = min(estimates, key=lambda e: e.total)
    raise ConfigError(
        f"deepspeed=auto: no preset fits {limit / GIB:.2f} GiB per device (90% of "
        f"{budget / GIB:.2f}); the smallest estimate is {smallest.preset} at "
        f"{smallest.total / GIB:.2f} GiB. Use more devices, LoRA (model.lora.enabled=true), a "
        "smaller train.per_device_batch_size or data.max_length, or set train.memory_budget_gb "
        "if the detected memory is wrong."
    )


def format_table(
    figures: FamilyEstimates, budget: float, source: str, *, cfg: RunConfig, world_size: int
) -> str:
    """The planner's printed report."""
    limit = budget * HEADROOM
    estimates, sizes, shape = figures.estimates, figures.sizes, figures.shape
    lines = [
        f"memory plan: task={cfg.task} model={cfg.model.name_or_path} "
        f"({sizes.total / 1e6:.1f}M parameters, {sizes.trainable / 1e6:.2f}M trainable), "
        f"world size {world_size}, micro-batch {cfg.train.per_device_batch_size}, {shape}",
        f"budget per device: {budget / GIB:.2f} GiB ({source}); fits if total <= "
        f"{limit / GIB:.2f} GiB",
        "",
        f"{'preset':<11}{'stage':>6}{'states':>10}{'ref':>9}{'activ.':>9}{'gen.':>9}{'total':>9}"
        f"{'ZeRO paper':>12}{'host/node':>11}  fits  source",
    ]
    for e in estimates:
        lines.append(
            f"{e.preset:<11}{e.stage:>6}{e.model_states / GIB:>10.2f}{e.reference / GIB:>9.2f}"
            f"{e.activations / GIB:>9.2f}{e.generation / GIB:>9.2f}{e.total / GIB:>9.2f}"
            f"{e.paper / GIB:>12.2f}"
            f"{e.host / GIB:>11.2f}  {'yes ' if e.total <= limit else 'no  '}  {e.source}"
        )
    lines.append(
        "(GiB per device; 'ref': frozen models (reference, reward model; text-to-image: the VAE "
        "and text encoders too); 'gen.': online RL's "
        "generation (ZeRO-3 gathered weights, KV cache), counted as max(activ., gen.); 'ZeRO "
        "paper': 16 / 4+12/N / 2+14/N / 16/N bytes per parameter)"
    )
    try:
        _, reason = choose(estimates, budget)
        lines.append(f"deepspeed=auto would choose {reason}")
    except ConfigError as err:
        lines.append(str(err))
    return "\n".join(lines)
