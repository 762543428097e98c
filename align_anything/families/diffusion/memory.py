"""The memory planner's estimate of a diffusion-pipeline run (`training.memory_plan`; the
pipeline families' `estimate_memory`): the denoiser's model states (as a language model's),
Diffusion-DPO's frozen base denoiser (none with LoRA: the adapters disabled), the frozen VAE
and text encoders (whole on every rank), and the activations of a micro-batch, which follow
no formula (convolutions, several resolutions, cross attention) and so are measured: the
denoiser runs on the meta device (shapes only, seconds even for Flux) and every tensor
autograd saves for backward is added up (`denoiser_activations`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from align_anything.backend import ds_config as dsc
from align_anything.config import RunConfig, load_preset
from align_anything.families.diffusion.pipeline import inspect_pipeline, training_resolution
from align_anything.families.diffusion.sizes import DenoiserSizes, denoiser_sizes, frozen_part_sizes
from align_anything.training.memory_plan import (
    PRESET_ORDER,
    Estimate,
    FamilyEstimates,
    model_states,
    paper_figure,
)

# Estimates of activation memory already measured in this process: (pipeline, resolution,
# samples, precision, gradient checkpointing) -> bytes.
_ACTIVATIONS: dict[tuple[Any, ...], float] = {}


def _text_length(info: Any, part: str, default: int) -> int:
    """A tokenizer's `model_max_length` from its config file (the tokens of a prompt)."""
    config = info.path / part / "tokenizer_config.json"
    try:
        length = json.loads(config.read_text()).get("model_max_length")
    except (OSError, ValueError):
        length = None
    return int(length) if isinstance(length, (int, float)) and 0 < length < 1e6 else default


def _meta_conditioning(info: Any, samples: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Text conditioning of the shapes a kind's pipeline feeds its denoiser (on the current
    device: call under `torch.device("meta")`)."""
    from align_anything.families.diffusion.kinds import DEFAULT_T5_LENGTH

    config = info.denoiser_config
    from align_anything.families.diffusion.kinds import T5_TOKENIZER, UNET_KINDS

    clip = _text_length(info, "tokenizer", 77)
    if info.kind == "audioldm":  # one CLAP vector per caption, the UNet's class embedding
        width = int(config["projection_class_embeddings_input_dim"])
        return {"prompt_embeds": torch.zeros(samples, width, dtype=dtype)}
    if info.kind in UNET_KINDS:
        width, tokens = int(config["cross_attention_dim"]), clip
    elif info.kind == "wan":
        width = int(config["text_dim"])
        tokens = min(DEFAULT_T5_LENGTH["wan"], _text_length(info, T5_TOKENIZER["wan"], 10**6))
    else:
        t5_part = "tokenizer_3" if info.kind == "sd3" else "tokenizer_2"
        t5 = min(DEFAULT_T5_LENGTH[info.kind], _text_length(info, t5_part, 10**6))
        width, tokens = (
            int(config["joint_attention_dim"]),
            t5 + (clip if info.kind == "sd3" else 0),
        )
    batch = {"prompt_embeds": torch.zeros(samples, tokens, width, dtype=dtype)}
    if info.kind == "sdxl":
        pooled = int(config["projection_class_embeddings_input_dim"]) - 6 * int(
            config["addition_time_embed_dim"]
        )
        batch["pooled_prompt_embeds"] = torch.zeros(samples, pooled, dtype=dtype)
        batch["add_time_ids"] = torch.zeros(samples, 6, dtype=dtype)
    elif info.kind in ("sd3", "flux"):
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


def _flash_attention(*args: Any, **kwargs: Any) -> Any:
    """`scaled_dot_product_attention`'s stand-in for the meta forward, however the query, key
    and value are passed (by position, or by name as diffusers' attention dispatch passes
    them for Wan)."""
    names = ("query", "key", "value")
    query, key, value = (*args[:3], *(kwargs[n] for n in names[len(args[:3]) :]))
    return _FlashAttention.apply(query, key, value)


def denoiser_activations(
    info: Any, *, resolution: int, samples: int, precision: str, gradient_checkpointing: bool,
    frames: int | None = None,
) -> float:  # fmt: skip
    """Bytes of activations one training forward of `samples` images at `resolution` keeps for
    backward, measured by running the denoiser on the meta device (shapes only: no weights, no
    memory, seconds for a 12B Flux) and adding up every tensor autograd saves that is not a
    parameter (attention counted as a memory-efficient kernel keeps it, see `_FlashAttention`).
    With gradient checkpointing, diffusers' checkpointed blocks keep only their inputs; one
    block's activations (the mean over blocks) are added for the block being recomputed.
    Hand-written: no library estimates a denoiser's activations (DeepSpeed's estimators count
    model states only; the LM formula of Korthikanti et al. does not describe convolutions)."""
    import torch.nn.functional as F

    from align_anything.families.diffusion.forward import predict
    from align_anything.families.diffusion.parts import empty_denoiser

    key = (str(info.path), info.kind, repr(sorted(info.denoiser_config.items())), resolution,
           samples, precision, gradient_checkpointing, frames)  # fmt: skip
    if key in _ACTIVATIONS:
        return _ACTIVATIONS[key]
    dtype = dsc.torch_dtype(precision)
    height, width = info.latent_size(resolution)
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
        time = () if frames is None else (frames,)
        noisy = torch.zeros(samples, info.latent_channels, *time, height, width)
        F.scaled_dot_product_attention = _flash_attention
        try:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                predict(denoiser, info, noisy, torch.zeros(samples), batch)
        finally:
            F.scaled_dot_product_attention = sdpa
    total = float(sum(t.numel() * t.element_size() for t in saved.values()))
    if gradient_checkpointing and blocks[0]:
        whole = denoiser_activations(info, resolution=resolution, samples=samples,
                                     precision=precision, gradient_checkpointing=False,
                                     frames=frames)  # fmt: skip
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
    parameter counts (`families.diffusion.sizes.DenoiserSizes`), the frozen VAE's and text encoders'
    parameters, and a micro-batch's activations (`denoiser_activations`)."""

    sizes: DenoiserSizes
    frozen_parts: int
    activations: float


def denoiser_figures(
    cfg: RunConfig, info: Any, *, precision: str, resolution: int
) -> DenoiserFigures:
    """The run's `DenoiserFigures`, from the pipeline's configs on the meta device (a video
    kind's activations at the run's latent frames)."""
    frames = info.frames(cfg.data.num_frames)
    return DenoiserFigures(
        sizes=denoiser_sizes(info, adapters=cfg.model.lora.adapters()),
        frozen_parts=sum(frozen_part_sizes(info).values()),
        activations=denoiser_activations(
            info, resolution=resolution, samples=denoiser_samples(cfg), precision=precision,
            gradient_checkpointing=cfg.speed.gradient_checkpointing,
            frames=None if frames is None else info.latent_frames(frames),
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
    device, host, source = model_states(
        sizes, ds_config, precision=precision, world_size=world_size,
        gpus_per_node=gpus_per_node, nodes=max(1, world_size // gpus_per_node),
    )  # fmt: skip
    reference = figures.frozen_parts * weight_bytes
    if cfg.task == "diffusion_dpo" and not cfg.model.lora.enabled:  # the frozen base denoiser
        reference += sizes.total * weight_bytes / (world_size if stage == 3 else 1)
    return Estimate(
        preset=preset, stage=stage, model_states=device, host=host, reference=reference,
        activations=figures.activations,
        paper=paper_figure(sizes.total, stage, world_size),
        source=source,
    )  # fmt: skip


def estimate_memory(
    cfg: RunConfig, world_size: int, gpus_per_node: int, precision: str
) -> FamilyEstimates:
    """The run's estimate under every shipped preset (the kind's `estimate_memory`)."""
    info = inspect_pipeline(cfg.model.name_or_path)
    resolution = training_resolution(info, cfg.data.resolution, cfg.data.audio_seconds)
    figures = denoiser_figures(cfg, info, precision=precision, resolution=resolution)
    estimates = [
        estimate_denoiser(
            name,
            load_preset(name)[0],
            cfg,
            figures,
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            precision=precision,
        )  # fmt: skip
        for name in PRESET_ORDER
    ]
    shape = f"resolution {cfg.data.resolution or 'the pipeline default'}"
    if info.medium == "audio":
        shape = f"{resolution} mel frames x {info.mel_bins} mels"
    frames = info.frames(cfg.data.num_frames)
    if frames is not None:
        shape += f", {frames} frames ({info.latent_frames(frames)} latent)"
    return FamilyEstimates(estimates, figures.sizes, shape)
