"""Parameter counts and dimensions of a language model, for the memory planner: from its config
on the meta device (no weights loaded: planning a 70B model takes seconds), or from a built one
(ZeRO-3 partitions report their full size)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from align_anything.backend.params import count_parameters, largest_layer
from align_anything.families.language import lora
from align_anything.families.language.loading import empty_model, load_config
from align_anything.training.memory_plan import ParameterCounts


@dataclass(frozen=True)
class ModelSizes(ParameterCounts):
    """Parameter counts, and the text model's dimensions the activation formula uses."""

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


def sizes_of(model: torch.nn.Module, config: Any) -> ModelSizes:
    """Parameter counts of a built model (on the meta device, or a run's partitioned model:
    ZeRO-3 parameters report `ds_numel`) and the text model's dimensions from its config."""
    trainable, frozen = count_parameters(model)
    largest = largest_layer(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelSizes(
        total=trainable + frozen,
        trainable=trainable,
        largest_layer=largest,
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        vocab=int(text.vocab_size),
    )
