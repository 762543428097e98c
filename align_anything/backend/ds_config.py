"""A DeepSpeed preset resolved for one run, as pure functions: every "auto" filled once, the
batch arithmetic (any two of micro batch, accumulation, global batch give the third), precision,
and the configs derived from the training one. No process group, no accelerator: testable as
plain functions."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import torch

from align_anything.errors import ConfigError

AUTO = "auto"


def resolve_precision(requested: str, device_type: str, *, bf16_supported: bool) -> str:
    """`auto` is bf16 where the GPU supports it, fp16 on older GPUs, fp32 on CPU (bf16 matmuls on
    CPUs without bf16 units run hundreds of times slower than fp32)."""
    if requested != AUTO:
        return requested
    if device_type == "cpu":
        return "fp32"
    return "bf16" if bf16_supported else "fp16"


def torch_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


@dataclass(frozen=True)
class AdamSettings:
    """AdamW hyper-parameters: fill the preset's optimizer "auto"s and build our optimizer."""

    learning_rate: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    grad_accum: int
    world_size: int
    global_batch: int

    def describe(self) -> str:
        return (
            f"{self.global_batch} = micro {self.micro_batch} × grad_accum {self.grad_accum} "
            f"× world {self.world_size}"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _solve_batch(
    *,
    preset: dict[str, Any],
    world_size: int,
    micro: int | str,
    grad_accum: int | str,
    global_batch: int | str,
    explicit: frozenset[str],
    conflicts: list[str],
) -> BatchPlan:
    """Any two of (micro, grad_accum, global) determine the third; three given must agree.

    Precedence: a number in the preset or a value set on the command line (two such that
    disagree are a conflict) > the task file's defaults, which only fill what is still open.
    """
    names = {
        "micro": ("train_micro_batch_size_per_gpu", "train.per_device_batch_size", micro),
        "accum": ("gradient_accumulation_steps", "train.gradient_accumulation_steps", grad_accum),
        "global": ("train_batch_size", "train.global_batch_size", global_batch),
    }
    firm: dict[str, int] = {}
    defaults: dict[str, int] = {}
    for short, (ds_key, cfg_key, cfg_value) in names.items():
        preset_value = preset.get(ds_key, AUTO)
        if preset_value not in (AUTO, None) and not (
            _is_number(preset_value) and preset_value == int(preset_value) and preset_value > 0
        ):
            conflicts.append(
                f"deepspeed.{ds_key}: expected a positive integer or 'auto', got {preset_value!r}"
            )
            preset_value = AUTO
        if _is_number(preset_value):
            firm[short] = int(preset_value)
            if cfg_key in explicit and cfg_value != AUTO and int(cfg_value) != int(preset_value):
                conflicts.append(
                    f"{cfg_key}={cfg_value} but the preset sets {ds_key}={preset_value}: "
                    f"drop one, or set deepspeed.{ds_key}=auto"
                )
        elif cfg_value != AUTO:
            (firm if cfg_key in explicit else defaults)[short] = int(cfg_value)
    for short in ("micro", "accum"):
        if len(firm) >= 2:
            break
        if short not in firm and short in defaults:
            firm[short] = defaults[short]
    micro_v, accum_v, global_v = firm.get("micro"), firm.get("accum"), firm.get("global")
    if micro_v and accum_v and global_v:
        if micro_v * accum_v * world_size != global_v:
            raise ConfigError(
                f"batch sizes do not add up: train_batch_size {global_v} != micro {micro_v} "
                f"× grad_accum {accum_v} × world {world_size} (= {micro_v * accum_v * world_size}). "
                "Set one of train.per_device_batch_size, train.gradient_accumulation_steps, "
                "train.global_batch_size to auto."
            )
    elif micro_v and accum_v:
        global_v = micro_v * accum_v * world_size
    elif global_v and (micro_v or accum_v):
        known = micro_v or accum_v
        assert known is not None
        if global_v % (known * world_size):
            other = "grad_accum" if micro_v else "micro"
            raise ConfigError(
                f"batch sizes do not add up: train_batch_size {global_v} is not divisible by "
                f"{'micro' if micro_v else 'grad_accum'} {known} × world {world_size}, so "
                f"{other} cannot be a whole number."
            )
        derived = global_v // (known * world_size)
        micro_v, accum_v = (micro_v, derived) if micro_v else (derived, accum_v)
    else:
        raise ConfigError(
            "batch size is undetermined: set at least two of train.per_device_batch_size, "
            "train.gradient_accumulation_steps, train.global_batch_size (or the preset's "
            "train_micro_batch_size_per_gpu / gradient_accumulation_steps / train_batch_size)."
        )
    assert micro_v and accum_v and global_v
    return BatchPlan(micro_v, accum_v, world_size, global_v)


def _find_auto(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _find_auto(v, f"{path}[{i}]")]
    return [path] if node == AUTO else []


# ZeRO-3 in one process without parameter offload: a parameter's partition is the whole
# parameter, and DeepSpeed's "gather" of it is a view of that partition (no copy, no memory), so
# its per-module fetch / release and prefetching are work without a purpose. Every parameter
# persists instead (gathered once, never released), and nothing is prefetched. What this leaves
# of ZeRO-3's one-process cost is DeepSpeed's own (`one_process_zero3_note`). Only "auto" values
# take these; the numbers are the same either way.
ONE_PROCESS_ZERO3 = {
    "stage3_param_persistence_threshold": sys.maxsize,  # every parameter
    "stage3_prefetch_bucket_size": 0,
}


def preset_precision(
    preset: dict[str, Any], requested: str, device: str, *, bf16_supported: bool,
    explicit: frozenset[str] = frozenset(), conflicts: list[str] | None = None,
) -> str:  # fmt: skip
    """The precision a run with `preset` trains in: the preset's explicit bf16 / fp16 switch
    wins over `auto`; an explicit `train.precision` that disagrees with it is a conflict
    (appended to `conflicts`, else a `ConfigError`). fp16 on a CPU is a `ConfigError`: the CPU
    accelerator trains in bf16 or fp32 only. The one place that reads a preset's precision."""
    problems: list[str] = [] if conflicts is None else conflicts
    bf16_flag = preset.get("bf16", {}).get("enabled", AUTO)
    fp16_flag = preset.get("fp16", {}).get("enabled", AUTO)
    from_preset = "bf16" if bf16_flag is True else "fp16" if fp16_flag is True else None
    resolved = resolve_precision(requested, device, bf16_supported=bf16_supported)
    if from_preset:
        if "train.precision" in explicit and requested not in (AUTO, from_preset):
            problems.append(f"train.precision={requested} but the preset enables {from_preset}")
        resolved = from_preset
    elif requested == AUTO and (bf16_flag is False and resolved == "bf16"):
        resolved = "fp16" if fp16_flag is not False else "fp32"
    if resolved == "fp16" and device == "cpu":
        given = "the preset enables fp16" if from_preset else "train.precision=fp16"
        raise ConfigError(
            f"{given}, but this device (cpu) trains in bf16 or fp32 only: set "
            "train.precision=fp32 (or auto, which is fp32 on a CPU)"
        )
    if conflicts is None and problems:
        raise ConfigError("; ".join(problems))
    return resolved


def resolve_ds_config(
    preset: dict[str, Any],
    *,
    world_size: int,
    hidden_size: int,
    device: str,
    precision: str,
    micro_batch: int | str,
    grad_accum: int | str,
    global_batch: int | str,
    max_grad_norm: float,
    adam: AdamSettings,
    bf16_supported: bool,
    explicit: frozenset[str] = frozenset(),
) -> tuple[dict[str, Any], BatchPlan, str]:
    """Fill every "auto" in a preset exactly once; returns (resolved config, batch plan, precision).

    Conflicts between values set on the command line and numbers in the preset are collected
    and raised together. After resolution no "auto" is left (DeepSpeed silently ignores some).
    """
    config = copy.deepcopy(preset)
    conflicts: list[str] = []
    plan = _solve_batch(
        preset=config,
        world_size=world_size,
        micro=micro_batch,
        grad_accum=grad_accum,
        global_batch=global_batch,
        explicit=explicit,
        conflicts=conflicts,
    )
    config["train_micro_batch_size_per_gpu"] = plan.micro_batch
    config["gradient_accumulation_steps"] = plan.grad_accum
    config["train_batch_size"] = plan.global_batch

    clip = config.get("gradient_clipping", AUTO)
    if clip == AUTO:
        config["gradient_clipping"] = float(max_grad_norm)
    elif "train.max_grad_norm" in explicit and float(clip) != float(max_grad_norm):
        conflicts.append(
            f"train.max_grad_norm={max_grad_norm} but the preset sets gradient_clipping={clip}"
        )

    resolved = preset_precision(
        config, precision, device, bf16_supported=bf16_supported, explicit=explicit,
        conflicts=conflicts,
    )  # fmt: skip
    config.setdefault("bf16", {})["enabled"] = resolved == "bf16"
    config.setdefault("fp16", {})["enabled"] = resolved == "fp16"

    zero = config.setdefault("zero_optimization", {})
    fills = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        "allgather_bucket_size": hidden_size * hidden_size,
    }
    if world_size == 1 and zero.get("stage") == 3 and not offloads_params(config):
        fills.update(ONE_PROCESS_ZERO3)
    for key, value in fills.items():
        if zero.get(key) == AUTO:
            zero[key] = value

    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict):
        params = optimizer.setdefault("params", {})
        for key, value in {
            "lr": adam.learning_rate,
            "betas": list(adam.betas),
            "eps": adam.eps,
            "weight_decay": adam.weight_decay,
        }.items():
            if params.get(key) == AUTO:
                params[key] = value
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict):
        conflicts.append(
            "the preset has a 'scheduler' block: align_anything builds the schedule from "
            "train.lr_scheduler / train.warmup_ratio; remove the block from the preset"
        )
    if conflicts:
        raise ConfigError(
            "the task config and the DeepSpeed preset disagree:\n"
            + "\n".join(f"  - {c}" for c in conflicts)
        )
    left = _find_auto(config)
    if left:
        raise ConfigError(
            f"the DeepSpeed preset has 'auto' values align_anything cannot fill: {', '.join(left)}. "
            "Replace them with numbers."
        )
    return config, plan, resolved


# Measured on the main job (135M parameters in fp32, one thread per run; benchmarks/README.md,
# "ZeRO-3 in one process"): ZeRO-3's CPU time per steady step (time.process_time: the wall
# time of 2 shared cores swung 13-43 s per step with the load) and its peak RSS (os.wait4,
# benchmarks/zero3_one_process.py) over ZeRO-0's.
ONE_PROCESS_ZERO3_MEASURED = (1.15, 1.66)


def one_process_zero3_note(precision: str) -> str:
    """The start-up summary's line on ZeRO-3 in one process: what DeepSpeed costs there (no
    setting removes it) and which presets suit one process better."""
    copy = (
        "an fp32 master copy of every weight beside the weights themselves (4 more bytes per "
        "parameter), "
        if precision == "fp32"
        else ""
    )
    time_ratio, rss_ratio = ONE_PROCESS_ZERO3_MEASURED
    return (
        "  one process     ZeRO-3 has no other rank to partition over, so it saves no memory here "
        f"while DeepSpeed keeps {copy}a flat gradient buffer between steps and a hook on every "
        f"module (measured on the main job: about {time_ratio:.2f}× the CPU time per step and "
        f"{rss_ratio:.2f}× the peak RSS of deepspeed=z0). For one process use deepspeed=z0 (or z2)."
    )


# Measured on the built-in diffusion models (benchmarks/README.md, "Diffusion-DPO" and "Online
# image RL" against a plain PyTorch + diffusers loop, one thread): ZeRO-2's speed over the
# plain loop's in one process, where ZeRO-0 is at parity.
ONE_PROCESS_ZERO2_MEASURED = (0.85, 0.92)


def one_process_zero2_note() -> str:
    """The start-up summary's line on ZeRO-2 in one process (without optimizer offload): what
    DeepSpeed's gradient machinery costs there and the preset that has none of it."""
    low, high = ONE_PROCESS_ZERO2_MEASURED
    return (
        "  one process     ZeRO-2 has no other rank to partition gradients and optimizer "
        "states over, so it saves no memory here while DeepSpeed still runs a hook per "
        "parameter gradient, a bucketed all-reduce and a flat-partition copy and norm every "
        f"step (measured on the built-in diffusion models: {low:.2f}-{high:.2f}x the speed of a "
        "plain PyTorch loop, where deepspeed=z0 runs at 1.00x). For one process use "
        "deepspeed=z0."
    )


def zero_stage_of(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(config: dict[str, Any]) -> bool:
    device = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device not in (None, "none")


def offloads_params(config: dict[str, Any]) -> bool:
    device = config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    return device not in (None, "none")


def precision_of(config: dict[str, Any]) -> str:
    """The precision a resolved config trains in: bf16, fp16 or fp32."""
    if config.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp16" if config.get("fp16", {}).get("enabled") else "fp32"


def with_universal_load(config: dict[str, Any]) -> dict[str, Any]:
    """The config that makes DeepSpeed load a universal checkpoint (another ZeRO stage or world
    size) at `load_checkpoint`."""
    config = copy.deepcopy(config)
    config.setdefault("checkpoint", {})["load_universal"] = True
    return config


def inference_config(config: dict[str, Any], *, offload: bool) -> dict[str, Any]:
    """The config of a frozen model beside a trained one (the DPO reference): the training
    config's batch and precision; under ZeRO-3 partitioned like the policy (parameters on the
    host with `offload`), otherwise a plain module (on the host between uses with `offload`)."""
    derived: dict[str, Any] = {
        key: config[key]
        for key in (
            "train_micro_batch_size_per_gpu",
            "train_batch_size",
            "gradient_accumulation_steps",
        )
    }
    derived["bf16"] = {"enabled": config.get("bf16", {}).get("enabled", False)}
    derived["fp16"] = {"enabled": config.get("fp16", {}).get("enabled", False)}
    zero: dict[str, Any] = {"stage": zero_stage_of(config)}
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = config["zero_optimization"].get(
            "stage3_param_persistence_threshold", 10_000
        )
    zero["offload_param"] = {"device": "cpu" if offload else "none"}
    derived["zero_optimization"] = zero
    derived["steps_per_print"] = 1_000_000
    return derived


def universal_change(*, source_stage: int, source_world: int, stage: int, world: int) -> str | None:
    """None when a checkpoint loads as written (same ZeRO stage and world size, or ZeRO-0 on
    both sides, whose checkpoint holds whole weights and optimizer state); otherwise the change,
    which resumes through DeepSpeed's universal checkpoint. ConfigError for the changes DeepSpeed
    cannot make (from or to ZeRO-0)."""
    if (source_stage, source_world) == (stage, world) or source_stage == stage == 0:
        return None
    change = f"ZeRO-{source_stage} on {source_world} rank(s) -> ZeRO-{stage} on {world} rank(s)"
    if source_stage == 0:
        raise ConfigError(
            f"cannot resume ({change}): a ZeRO-0 checkpoint has no ZeRO optimizer-state files, "
            "which the conversion to DeepSpeed's universal checkpoint needs. Cross-stage resume "
            "needs a ZeRO-1/2/3 checkpoint; resume this one with a ZeRO-0 preset (any world "
            "size), or export its weights and start anew."
        )
    if stage == 0:
        raise ConfigError(
            f"cannot resume ({change}): DeepSpeed loads a universal checkpoint only into a "
            "ZeRO-1/2/3 engine. Resume with deepspeed=z2 or z3 (or a ZeRO-1 preset)."
        )
    if source_stage == 3 and stage < 3:
        # Measured with DeepSpeed 0.19.8: the ZeRO-1/2 universal loader fails on a checkpoint
        # converted from ZeRO-3 ("Empty ds_version", then an IndexError in
        # `universal_checkpoint.load_hp_checkpoint_state` on the flattened parameters).
        raise ConfigError(
            f"cannot resume ({change}): DeepSpeed 0.19.8 does not load a ZeRO-3 checkpoint into "
            "a ZeRO-1/2 engine through its universal format. Resume with deepspeed=z3 or "
            "z3_offload (any world size)."
        )
    return change
