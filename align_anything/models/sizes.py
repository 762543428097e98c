"""Parameter counts and dimensions of a model, for the memory planner: from a model's config
on the meta device (no weights loaded: planning a 70B model takes seconds), or from a built one
(ZeRO-3 partitions report their full size). Language models: `model_sizes`; text-to-image
denoisers: `denoiser_sizes`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from align_anything.models import lora
from align_anything.models.diffusion.adapters import add_denoiser_adapters
from align_anything.models.diffusion.pipeline import PipelineInfo, empty_denoiser
from align_anything.models.loading import count_parameters, empty_model, full_numel, load_config


@dataclass(frozen=True)
class ModelSizes:
    total: int
    trainable: int
    largest_layer: int
    hidden: int
    layers: int
    vocab: int


def model_sizes(
    name_or_path: str, *, reward: bool, trust_remote_code: bool, adapters: dict[str, Any] | None
) -> ModelSizes:
    """Parameter counts of a run's model (with LoRA adapters when `adapters` holds their
    settings: r, alpha, dropout, target_modules), from its config on the meta device."""
    config = load_config(name_or_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = empty_model(config, reward=reward)
        if adapters:
            model = lora.add_adapters(model, **adapters, sequence_classification=reward)
    return sizes_of(model, config)


def _largest_layer(model: torch.nn.Module) -> int:
    """The most parameter elements any one module holds itself (ZeRO-3: whole parameters)."""
    return max(
        (sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()),
        default=0,
    )


def sizes_of(model: torch.nn.Module, config: Any) -> ModelSizes:
    """Parameter counts of a built model (on the meta device, or a run's partitioned model:
    ZeRO-3 parameters report `ds_numel`) and the text model's dimensions from its config."""
    trainable, frozen = count_parameters(model)
    largest = _largest_layer(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelSizes(
        total=trainable + frozen,
        trainable=trainable,
        largest_layer=largest,
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        vocab=int(text.vocab_size),
    )


@dataclass(frozen=True)
class DenoiserSizes:
    """A text-to-image denoiser's parameter counts, for the memory planner; `trainable` is
    the LoRA adapters' only when adapters are given."""

    total: int
    trainable: int
    largest_layer: int


def denoiser_sizes(info: PipelineInfo, *, adapters: dict[str, Any] | None = None) -> DenoiserSizes:
    """Parameter counts of a pipeline's denoiser built from its config on the meta device (no
    weights read, no memory: a 12B Flux transformer counts in under a second); with `adapters`
    (r, alpha, dropout, target_modules) LoRA adapters are added and only they train."""
    with torch.device("meta"):
        model = empty_denoiser(info)
        if adapters:
            add_denoiser_adapters(model, family=info.family, **adapters)
    trainable, frozen = count_parameters(model)
    return DenoiserSizes(trainable + frozen, trainable, _largest_layer(model))


def frozen_part_sizes(info: PipelineInfo) -> dict[str, int]:
    """Parameter counts of a pipeline's frozen parts (VAE, text encoders), each built from its
    config on the meta device (no weights read)."""
    import importlib

    counts = {}
    for part in ("vae", *info.text_encoders):
        library, class_name = info.components[part]
        cls = getattr(importlib.import_module(library), class_name)
        folder = str(info.part_path(part))
        with torch.device("meta"):
            if library == "diffusers":
                model = cls.from_config(cls.load_config(folder))
            else:
                from transformers import AutoConfig

                model = cls(AutoConfig.from_pretrained(folder))
        counts[part] = sum(p.numel() for p in model.parameters())
    return counts
