"""The memory planner's estimate of a language-model run (`training.memory_plan`; the language
family's `estimate_memory`):

- the policy's model states, and those of a model trained beside it (PPO's critic: its weights,
  gradients and optimizer states partitioned as the policy's, and its activations, no LM head,
  beside the policy's, since a step keeps both graphs until their backward passes);
- the DPO / KTO reference model (frozen weights; partitioned under ZeRO-3; none for a LoRA run,
  whose reference is the base model with adapters off, and none for reference-free losses). A
  precomputed reference still exists while it is computed, after the policy's engine is built,
  so it counts towards the peak. Online RL (grpo, rloo, ppo): the reference when beta > 0
  (ppo: kl_coef > 0), and the reward model (`reward.model`), both frozen and partitioned
  under ZeRO-3;
- online RL's generation: under ZeRO-3 the full weights gathered on every rank for the round
  (the partition is already counted), the KV cache of `generation_batch_size` sequences of
  `data.max_length` tokens (2 · layers · hidden per token: an upper bound, grouped-query
  attention stores less) and their last logits; generation ends before the training forward,
  so the peak takes the larger of generation and activations;
- activations of one micro-batch (Korthikanti et al. 2022: 34·s·b·h bytes per layer in 16-bit
  without activation checkpointing, doubled for fp32; with `speed.gradient_checkpointing`, each
  layer's 2·s·b·h input plus one layer's 34·s·b·h) plus the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from align_anything.backend import ds_config as dsc
from align_anything.config import ONLINE_TASKS, RunConfig, load_preset
from align_anything.families.language.sizes import ModelSizes, model_sizes
from align_anything.losses import needs_reference
from align_anything.training.memory_plan import (
    PRESET_ORDER,
    Estimate,
    FamilyEstimates,
    model_states,
    paper_figure,
)


def run_model_sizes(cfg: RunConfig) -> ModelSizes:
    """Parameter counts of the run's model (with its adapters when LoRA is on)."""
    return model_sizes(
        cfg.model.name_or_path, reward=cfg.task == "rm",
        trust_remote_code=cfg.model.trust_remote_code, adapters=cfg.model.lora.adapters(),
    )  # fmt: skip


def run_critic_sizes(cfg: RunConfig) -> list[ModelSizes]:
    """Parameter counts of the models a run trains beside the policy: PPO's critic (its
    reward model's or the policy's backbone with a score head, with LoRA adapters when the run
    has them), from its config on the meta device; [] for every other run."""
    if cfg.task != "ppo" or cfg.ppo is None or not cfg.ppo.trains_critic():
        return []
    path = cfg.ppo.critic_path(
        policy=cfg.model.name_or_path,
        reward_model=cfg.reward.model if cfg.reward is not None else None,
    )
    return [
        model_sizes(
            path,
            reward=True,
            trust_remote_code=cfg.model.trust_remote_code,
            adapters=cfg.model.lora.adapters(),
        )  # fmt: skip
    ]


def estimate_preset(
    preset: str,
    ds_config: dict[str, Any],
    sizes: ModelSizes,
    cfg: RunConfig,
    *,
    world_size: int,
    gpus_per_node: int,
    precision: str,
    trained_beside: Sequence[ModelSizes] = (),
) -> Estimate:
    """Per-device memory of `cfg` under one preset. `trained_beside`: the models trained
    beside the policy (PPO's critic, `run_critic_sizes`): their model states join the
    policy's, and their activations (no LM head) the policy's, since the step keeps both
    graphs until their backward passes."""
    stage = dsc.zero_stage_of(ds_config)
    nodes = max(1, world_size // gpus_per_node)
    n = world_size
    weight_bytes = 4 if precision == "fp32" else 2
    device, host, source = model_states(
        sizes, ds_config, precision=precision, world_size=n, gpus_per_node=gpus_per_node,
        nodes=nodes,
    )  # fmt: skip
    for other in trained_beside:
        more, more_host, _ = model_states(
            other, ds_config, precision=precision, world_size=n, gpus_per_node=gpus_per_node,
            nodes=nodes,
        )  # fmt: skip
        device, host = device + more, host + more_host
    reference = 0.0
    share = n if stage == 3 else 1
    if _has_reference_model(cfg):
        offloaded = getattr(cfg.section(), "reference_offload", False)
        reference = 0.0 if offloaded else sizes.total * weight_bytes / share
    generation = 0.0
    if cfg.task in ONLINE_TASKS:
        if cfg.reward is not None and cfg.reward.model is not None:
            reference += reward_model_params(cfg.reward.model) * weight_bytes / share
        if stage == 3:
            generation += sizes.total * weight_bytes * (1 - 1 / n)
        batch = cfg.section().generation_batch_size  # type: ignore[union-attr]
        kv = 2 * sizes.layers * sizes.hidden * cfg.data.max_length * batch * weight_bytes
        generation += kv + batch * sizes.vocab * 4
    micro = cfg.train.per_device_batch_size
    micro = micro if isinstance(micro, int) else 4
    # Sequences whose activations are kept for backward: a DPO / RM pair is two; a KTO row one
    # (its KL sequence runs without gradient, so its activations do not stay).
    sequences = micro * (2 if cfg.task in ("dpo", "rm") else 1)
    seq = cfg.data.max_length
    scale = 2 if precision == "fp32" else 1
    activations = sum(
        _layer_activations(model, seq=seq, sequences=sequences, scale=scale, cfg=cfg)
        for model in (sizes, *trained_beside)
    )
    if cfg.task != "rm":
        activations += sequences * seq * sizes.vocab * weight_bytes  # logits (upper bound)
    return Estimate(
        preset=preset,
        stage=stage,
        model_states=float(device),
        host=float(host),
        reference=reference,
        activations=float(activations),
        paper=paper_figure(sizes.total, stage, n),
        source=source,
        generation=float(generation),
    )


def _layer_activations(
    sizes: ModelSizes, *, seq: int, sequences: int, scale: int, cfg: RunConfig
) -> float:
    """Activations one micro-batch keeps for the backward pass in a model's layers
    (Korthikanti et al.: 34·s·b·h bytes per layer in 16-bit; `scale` 2 for fp32)."""
    per_layer = 34 * seq * sequences * sizes.hidden * scale
    if cfg.speed.gradient_checkpointing:
        # Each layer's input (2·s·b·h bytes in 16-bit) is kept; one layer is recomputed at a time.
        return 2 * seq * sequences * sizes.hidden * sizes.layers * scale + per_layer
    return per_layer * sizes.layers


def _has_reference_model(cfg: RunConfig) -> bool:
    """Whether the run holds a second, frozen model: the DPO / KTO reference (none with LoRA,
    whose reference is the policy with adapters off, nor for DPO's reference-free losses)."""
    if cfg.model.lora.enabled:
        return False
    if cfg.task in ONLINE_TASKS:
        return cfg.section().uses_reference()  # type: ignore[union-attr]
    if cfg.task == "kto":
        return cfg.kto is not None
    return cfg.dpo is not None and needs_reference(cfg.dpo.loss_terms()[0])


def reward_model_params(path: str) -> int:
    """Parameters of a reward model: counted from its safetensors headers (no model is built:
    inside a ZeRO-3 run transformers would construct even a meta-device model under
    `zero.Init`, a collective), else from its config on the meta device."""
    from pathlib import Path

    from safetensors import safe_open

    from align_anything.families.zoo import resolve_model_path

    files = sorted(Path(resolve_model_path(path)).glob("*.safetensors"))
    if not files:
        return model_sizes(path, reward=True, trust_remote_code=False, adapters=None).total
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total


def estimate_memory(
    cfg: RunConfig, world_size: int, gpus_per_node: int, precision: str
) -> FamilyEstimates:
    """The run's estimate under every shipped preset (the family's `estimate_memory`)."""
    sizes = run_model_sizes(cfg)
    beside = run_critic_sizes(cfg)
    estimates = [
        estimate_preset(
            name,
            load_preset(name)[0],
            sizes,
            cfg,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            precision=precision,
            trained_beside=beside,
        )  # fmt: skip
        for name in PRESET_ORDER
    ]
    return FamilyEstimates(estimates, sizes, f"max_length {cfg.data.max_length}")
