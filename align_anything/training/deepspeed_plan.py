"""The run's DeepSpeed config: the one place that turns the run config into the resolved
DeepSpeed config (`resolve_deepspeed`) and decides the precision the run trains in
(`run_precision`).

`resolve_deepspeed` takes the run config, the world size and the model's bucket width and
returns the resolved DeepSpeed dict, the batch plan and the precision (plus, when resuming
across ZeRO stages or world sizes, DeepSpeed's universal-load flag); nothing else edits a
DeepSpeed config. For `deepspeed=auto` it takes the preset the memory planner chose
(`training.memory_plan.choose_auto_preset`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from align_anything.backend import ds_config as dsc
from align_anything.config import AUTO_PRESET, RunConfig, load_preset, merge_nested
from align_anything.errors import ConfigError


@dataclass(frozen=True)
class DeepSpeedPlan:
    """What `resolve_deepspeed` decided for a run."""

    config: dict[str, Any]  # the resolved DeepSpeed config, as the engine gets it
    batch: dsc.BatchPlan
    precision: str
    source: str  # the preset file the config came from
    notes: tuple[str, ...] = field(default=())  # for the start-up summary
    universal: str | None = None  # resuming through a universal checkpoint: the change

    @property
    def stage(self) -> int:
        return dsc.zero_stage_of(self.config)

    def reference_config(self, *, offload: bool) -> dict[str, Any]:
        """The DeepSpeed config of a frozen model beside the trained one (the DPO reference)."""
        return dsc.inference_config(self.config, offload=offload)


def run_precision(cfg: RunConfig, *, device_type: str, bf16_supported: bool) -> str:
    """The precision the run trains in, as `resolve_deepspeed` resolves it: the preset's own
    bf16 / fp16 switch, else `train.precision` (auto: bf16 where supported, fp32 on a CPU).
    Known before any model loads (the frozen parts of a pipeline load in it)."""
    return dsc.preset_precision(
        cfg.deepspeed, cfg.train.precision, device_type, bf16_supported=bf16_supported,
        explicit=cfg.explicit_keys,
    )  # fmt: skip


def resolve_deepspeed(
    cfg: RunConfig,
    *,
    world_size: int,
    bucket_width: int,
    device_type: str,
    bf16_supported: bool,
    auto_choice: tuple[str, str] | None = None,
    resume: tuple[Any, dict[str, Any]] | None = None,
) -> DeepSpeedPlan:
    """The run's DeepSpeed config, batch plan and precision: the preset the run names (or, for
    deepspeed=auto, `auto_choice` from `choose_auto_preset`, with the command line's
    `deepspeed.*` overrides on top), every "auto" filled (the bucket sizes from `bucket_width`:
    a language model's hidden size, a denoiser's widest layer), and DeepSpeed's universal-load flag
    when `resume` (a checkpoint folder and its trainer state) was written under another ZeRO
    stage or world size. The validated run config is never changed."""
    notes: list[str] = []
    preset, source = cfg.deepspeed, cfg.deepspeed_source
    if source == AUTO_PRESET:
        if auto_choice is None:
            raise ValueError("deepspeed=auto needs the preset choice (choose_auto_preset)")
        name, reason = auto_choice
        preset, source = load_preset(name)
        preset = merge_nested(preset, cfg.deepspeed)
        notes.append(f"  deepspeed=auto  {reason}")
    train = cfg.train
    config, batch, precision = dsc.resolve_ds_config(
        preset,
        world_size=world_size,
        hidden_size=bucket_width,
        device=device_type,
        precision=train.precision,
        micro_batch=train.per_device_batch_size,
        grad_accum=train.gradient_accumulation_steps,
        global_batch=train.global_batch_size,
        max_grad_norm=train.max_grad_norm,
        adam=dsc.AdamSettings(
            train.learning_rate, train.adam_betas, train.adam_eps, train.weight_decay
        ),
        bf16_supported=bf16_supported,
        explicit=cfg.explicit_keys,
    )
    if world_size == 1 and dsc.zero_stage_of(config) == 3:
        notes.append(dsc.one_process_zero3_note(precision))
    elif world_size == 1 and dsc.zero_stage_of(config) == 2 and not dsc.offloads_optimizer(config):
        notes.append(dsc.one_process_zero2_note())
    universal = None
    if resume is not None:
        folder, state = resume
        try:
            universal = dsc.universal_change(
                source_stage=int(state["zero_stage"]), source_world=int(state["world_size"]),
                stage=dsc.zero_stage_of(config), world=world_size,
            )  # fmt: skip
        except ConfigError as err:
            raise ConfigError(f"{folder}: {err}") from None
        if universal:
            config = dsc.with_universal_load(config)
    return DeepSpeedPlan(config, batch, precision, source, tuple(notes), universal)
