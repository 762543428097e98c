"""Parameter counts of a diffusion pipeline's parts, for the memory planner: built from their
configs on the meta device (no weights read, no memory: a 12B Flux transformer counts in under
a second)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from align_anything.backend.params import count_parameters, largest_layer
from align_anything.families.diffusion.adapters import add_denoiser_adapters
from align_anything.families.diffusion.parts import empty_denoiser
from align_anything.families.diffusion.pipeline import PipelineInfo
from align_anything.training.memory_plan import ParameterCounts

# A denoiser's counts; `trainable` is the LoRA adapters' only when adapters are given.
DenoiserSizes = ParameterCounts


def denoiser_sizes(info: PipelineInfo, *, adapters: dict[str, Any] | None = None) -> DenoiserSizes:
    """Parameter counts of a pipeline's denoiser built from its config on the meta device (no
    weights read, no memory: a 12B Flux transformer counts in under a second); with `adapters`
    (r, alpha, dropout, target_modules) LoRA adapters are added and only they train."""
    with torch.device("meta"):
        model = empty_denoiser(info)
        if adapters:
            add_denoiser_adapters(model, kind=info.kind, **adapters)
    trainable, frozen = count_parameters(model)
    return DenoiserSizes(trainable + frozen, trainable, largest_layer(model))


def frozen_part_sizes(info: PipelineInfo) -> dict[str, int]:
    """Parameter counts of a pipeline's frozen parts (VAE, text encoders, a vocoder), each built from its
    config on the meta device (no weights read)."""
    counts = {}
    for part in ("vae", *info.text_encoders, *info.extra_parts):
        library, class_name = info.components[part]
        cls = getattr(importlib.import_module(library), class_name)
        folder = str(info.part_path(part))
        with torch.device("meta"):
            if library == "diffusers":
                model = cls.from_config(cls.load_config(folder))
            else:  # the class's own config (AutoConfig does not know SpeechT5HifiGan's)
                model = cls(cls.config_class.from_pretrained(folder))
        counts[part] = sum(p.numel() for p in model.parameters())
    return counts
