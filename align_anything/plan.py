"""The run's DeepSpeed plan: the one place that turns the run config into the resolved DeepSpeed
config (`resolve_deepspeed`), and the memory planner behind `deepspeed=auto` and
`python -m align_anything plan`.

`resolve_deepspeed` takes the run config, the world size and the model config and returns the
resolved DeepSpeed dict, the batch plan and the precision (plus, when resuming across ZeRO
stages or world sizes, DeepSpeed's universal-load flag); nothing else edits a DeepSpeed config.

The memory planner estimates, for each shipped preset,


- model states: DeepSpeed's own estimators (`estimate_zero2/3_model_states_mem_needs`) for
  mixed precision; for fp32 training (CPU) and LoRA, where DeepSpeed has no estimator, the same
  accounting by hand (weights, gradients and Adam moments of what trains, weights of what is
  frozen), partitioned as the stage partitions them;
- PPO's critic (`ppo.advantage_estimator=gae`): a second trained model, its weights, gradients
  and optimizer states partitioned as the policy's, and its activations (no LM head) beside the
  policy's, since a step keeps both graphs until their backward passes;
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
  layer's 2·s·b·h input plus one layer's 34·s·b·h) plus the logits;

and which presets fit the device memory (or `train.memory_budget_gb`) with 10% headroom.
`deepspeed=auto` takes the lowest ZeRO stage that fits: lower stages communicate less.

Everything is computed from the model's config (built on the meta device: no weights are
loaded), so planning a 70B model takes seconds on a laptop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from align_anything.backend import ds_config as dsc
from align_anything.backend import memory
from align_anything.config import (
    AUTO_PRESET,
    DIFFUSION_TASKS,
    ONLINE_TASKS,
    RunConfig,
    load_preset,
    merge_nested,
)
from align_anything.errors import ConfigError
from align_anything.losses import needs_reference
from align_anything.models.sizes import ModelSizes, model_sizes

# Lowest communication first: the order `deepspeed=auto` tries them in.
PRESET_ORDER = ("z0", "z2", "z3", "z3_offload")

HEADROOM = 0.9  # allocator fragmentation, communication buffers, CUDA context

GIB = 2**30


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


def run_model_sizes(cfg: RunConfig) -> ModelSizes:
    """Parameter counts of the run's model (with its adapters when LoRA is on)."""
    return model_sizes(
        cfg.model.name_or_path, reward=cfg.task == "rm",
        trust_remote_code=cfg.model.trust_remote_code, adapters=cfg.model.lora.adapters(),
    )  # fmt: skip


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


def choose_auto_preset(cfg: RunConfig, *, world_size: int) -> tuple[str, str]:
    """deepspeed=auto: the lowest-stage shipped preset whose estimate fits, and why."""
    estimates, budget, _, _ = plan(cfg, world_size=world_size)
    estimate, reason = choose(estimates, budget)
    return estimate.preset, reason


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
    device, host, source = _model_states(
        sizes, ds_config, precision=precision, world_size=n, gpus_per_node=gpus_per_node,
        nodes=nodes,
    )  # fmt: skip
    for other in trained_beside:
        more, more_host, _ = _model_states(
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
        paper=memory.estimate_model_state_memory(sizes.total, stage, n, offload=False) * GIB,
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


def _model_states(
    sizes: ModelSizes, ds_config: dict[str, Any], *, precision: str, world_size: int,
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


def _has_reference_model(cfg: RunConfig) -> bool:
    """Whether the run holds a second, frozen model: the DPO / KTO reference (none with LoRA,
    whose reference is the policy with adapters off, nor for DPO's reference-free losses)."""
    if cfg.model.lora.enabled:
        return False
    if cfg.task in DIFFUSION_TASKS:
        return cfg.task == "diffusion_dpo"  # the frozen base denoiser
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

    from align_anything.models.zoo import resolve_model_path

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
    cfg: RunConfig, *, world_size: int, gpus_per_node: int | None = None
) -> tuple[list[Estimate], float, str, ModelSizes]:
    """Estimates for every shipped preset, the per-device budget and its source."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus_per_node = gpus_per_node or local_devices(world_size)
    precision = dsc.resolve_precision(
        cfg.train.precision,
        device,
        bf16_supported=device == "cuda" and torch.cuda.is_bf16_supported(),
    )
    estimates = []
    if cfg.task in DIFFUSION_TASKS:  # a text-to-image pipeline: its denoiser trains
        from align_anything.models.diffusion import inspect_pipeline

        info = inspect_pipeline(cfg.model.name_or_path)
        resolution = cfg.data.resolution or info.default_resolution
        figures = denoiser_figures(cfg, info, precision=precision, resolution=resolution)
        sizes: Any = figures.sizes
        for name in PRESET_ORDER:
            estimates.append(
                estimate_denoiser(
                    name,
                    load_preset(name)[0],
                    cfg,
                    figures,
                    world_size=world_size,
                    gpus_per_node=gpus_per_node,
                    precision=precision,
                )  # fmt: skip
            )
    else:
        sizes = run_model_sizes(cfg)
        beside = run_critic_sizes(cfg)
        for name in PRESET_ORDER:
            preset, _ = load_preset(name)
            estimates.append(
                estimate_preset(
                    name,
                    preset,
                    sizes,
                    cfg,
                    world_size=world_size,
                    gpus_per_node=gpus_per_node,
                    precision=precision,
                    trained_beside=beside,
                )  # fmt: skip
            )
    budget, source = device_budget(cfg, gpus_per_node=gpus_per_node)
    return estimates, budget, source, sizes


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
    estimates: list[Estimate], budget: float, source: str, sizes: ModelSizes, *,
    cfg: RunConfig, world_size: int,
) -> str:  # fmt: skip
    """The planner's printed report."""
    limit = budget * HEADROOM
    shape = (
        f"resolution {cfg.data.resolution or 'the pipeline default'}"
        if cfg.task in DIFFUSION_TASKS
        else f"max_length {cfg.data.max_length}"
    )
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


# ---------------------------------------------------------------------------- denoisers


# Estimates of activation memory already measured in this process: (pipeline, resolution,
# samples, precision, gradient checkpointing) -> bytes.
_ACTIVATIONS: dict[tuple[Any, ...], float] = {}


def _text_length(info: Any, part: str, default: int) -> int:
    """A tokenizer's `model_max_length` from its config file (the tokens of a prompt)."""
    import json

    config = info.path / part / "tokenizer_config.json"
    try:
        length = json.loads(config.read_text()).get("model_max_length")
    except (OSError, ValueError):
        length = None
    return int(length) if isinstance(length, (int, float)) and 0 < length < 1e6 else default


def _meta_conditioning(info: Any, samples: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Text conditioning of the shapes a family's pipeline feeds its denoiser (on the current
    device: call under `torch.device("meta")`)."""
    from align_anything.models.diffusion.families import DEFAULT_T5_LENGTH

    config = info.denoiser_config
    clip = _text_length(info, "tokenizer", 77)
    if info.family in ("sd", "sdxl"):
        width, tokens = int(config["cross_attention_dim"]), clip
    else:
        t5_part = "tokenizer_3" if info.family == "sd3" else "tokenizer_2"
        t5 = min(DEFAULT_T5_LENGTH[info.family], _text_length(info, t5_part, 10**6))
        width, tokens = (
            int(config["joint_attention_dim"]),
            t5 + (clip if info.family == "sd3" else 0),
        )
    batch = {"prompt_embeds": torch.zeros(samples, tokens, width, dtype=dtype)}
    if info.family == "sdxl":
        pooled = int(config["projection_class_embeddings_input_dim"]) - 6 * int(
            config["addition_time_embed_dim"]
        )
        batch["pooled_prompt_embeds"] = torch.zeros(samples, pooled, dtype=dtype)
        batch["add_time_ids"] = torch.zeros(samples, 6, dtype=dtype)
    elif info.family in ("sd3", "flux"):
        pooled = int(config["pooled_projection_dim"])
        batch["pooled_prompt_embeds"] = torch.zeros(samples, pooled, dtype=dtype)
    return batch


class _FlashAttention(torch.autograd.Function):
    """Scaled dot-product attention as a memory-efficient kernel keeps it for backward (the
    inputs, the output and one log-sum-exp per query; never the score matrix), for the meta
    forward of `denoiser_activations`: on the meta device torch would take its math path, which
    saves the whole softmax, and overstate attention at high resolution many times over."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Any:
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # never run: shapes only
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def denoiser_activations(
    info: Any, *, resolution: int, samples: int, precision: str, gradient_checkpointing: bool
) -> float:
    """Bytes of activations one training forward of `samples` images at `resolution` keeps for
    backward, measured by running the denoiser on the meta device (shapes only: no weights, no
    memory, seconds for a 12B Flux) and adding up every tensor autograd saves that is not a
    parameter (attention counted as a memory-efficient kernel keeps it, see `_FlashAttention`).
    With gradient checkpointing, diffusers' checkpointed blocks keep only their inputs; one
    block's activations (the mean over blocks) are added for the block being recomputed.
    Hand-written: no library estimates a denoiser's activations (DeepSpeed's estimators count
    model states only; the LM formula of Korthikanti et al. does not describe convolutions)."""
    import torch.nn.functional as F

    from align_anything.forward_diffusion import predict
    from align_anything.models.diffusion.pipeline import empty_denoiser

    key = (str(info.path), info.family, repr(sorted(info.denoiser_config.items())), resolution,
           samples, precision, gradient_checkpointing)  # fmt: skip
    if key in _ACTIVATIONS:
        return _ACTIVATIONS[key]
    dtype = dsc.torch_dtype(precision)
    side = resolution // info.vae_scale_factor
    saved: dict[int, torch.Tensor] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        # Parameters, and views of them (a Linear saves its weight transposed), are not
        # activations.
        # Views of one tensor are counted once, as the tensor they view.
        base = tensor if tensor._base is None else tensor._base
        if not (base.is_leaf and base.requires_grad):
            saved[id(base)] = base  # held, so no id is reused
        return tensor

    blocks = [0]
    sdpa = F.scaled_dot_product_attention
    with torch.device("meta"):
        denoiser = empty_denoiser(info, dtype=dtype).train()
        if gradient_checkpointing:
            denoiser.enable_gradient_checkpointing()
            checkpoint = denoiser._gradient_checkpointing_func

            def counted(*args: Any, **kwargs: Any) -> Any:
                blocks[0] += 1
                return checkpoint(*args, **kwargs)

            denoiser._gradient_checkpointing_func = counted
        batch = _meta_conditioning(info, samples, dtype)
        noisy = torch.zeros(samples, info.latent_channels, side, side)
        F.scaled_dot_product_attention = lambda q, k, v, *a, **kw: _FlashAttention.apply(q, k, v)
        try:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                predict(denoiser, info, noisy, torch.zeros(samples), batch)
        finally:
            F.scaled_dot_product_attention = sdpa
    total = float(sum(t.numel() * t.element_size() for t in saved.values()))
    if gradient_checkpointing and blocks[0]:
        whole = denoiser_activations(info, resolution=resolution, samples=samples,
                                     precision=precision, gradient_checkpointing=False)  # fmt: skip
        total += whole / blocks[0]
    _ACTIVATIONS[key] = total
    return total


def denoiser_samples(cfg: RunConfig) -> int:
    """Images one micro-batch runs through the trained denoiser with gradients: a
    Diffusion-DPO pair is two (the reference's forward keeps nothing)."""
    micro = cfg.train.per_device_batch_size
    micro = micro if isinstance(micro, int) else 4
    return micro * (2 if cfg.task == "diffusion_dpo" else 1)


@dataclass(frozen=True)
class DenoiserFigures:
    """What a text-to-image run's estimate is made of, whatever the preset: the denoiser's
    parameter counts (`models.sizes.DenoiserSizes`), the frozen VAE's and text encoders'
    parameters, and a micro-batch's activations (`denoiser_activations`)."""

    sizes: Any
    frozen_parts: int
    activations: float


def denoiser_figures(
    cfg: RunConfig, info: Any, *, precision: str, resolution: int
) -> DenoiserFigures:
    """The run's `DenoiserFigures`, from the pipeline's configs on the meta device."""
    from align_anything.models.sizes import denoiser_sizes, frozen_part_sizes

    return DenoiserFigures(
        sizes=denoiser_sizes(info, adapters=cfg.model.lora.adapters()),
        frozen_parts=sum(frozen_part_sizes(info).values()),
        activations=denoiser_activations(
            info, resolution=resolution, samples=denoiser_samples(cfg), precision=precision,
            gradient_checkpointing=cfg.speed.gradient_checkpointing,
        ),
    )  # fmt: skip


def estimate_denoiser(
    preset: str, ds_config: dict[str, Any], cfg: RunConfig, figures: DenoiserFigures, *,
    world_size: int, gpus_per_node: int, precision: str,
) -> Estimate:  # fmt: skip
    """Per-device memory of a text-to-image run under one preset: the denoiser's model states
    (as a language model's), Diffusion-DPO's frozen base denoiser (none with LoRA: the adapters
    disabled), the frozen VAE and text encoders (whole on every rank), and the activations of a
    micro-batch measured on the meta device (`denoiser_activations`)."""
    sizes = figures.sizes
    stage = dsc.zero_stage_of(ds_config)
    weight_bytes = 4 if precision == "fp32" else 2
    device, host, source = _model_states(
        sizes, ds_config, precision=precision, world_size=world_size,
        gpus_per_node=gpus_per_node, nodes=max(1, world_size // gpus_per_node),
    )  # fmt: skip
    reference = figures.frozen_parts * weight_bytes
    if _has_reference_model(cfg):
        reference += sizes.total * weight_bytes / (world_size if stage == 3 else 1)
    return Estimate(
        preset=preset, stage=stage, model_states=device, host=host, reference=reference,
        activations=figures.activations,
        paper=memory.estimate_model_state_memory(sizes.total, stage, world_size, offload=False)
        * GIB,
        source=source,
    )  # fmt: skip
