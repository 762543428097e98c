"""A loaded model made ready to train: activation checkpointing, frozen parts, LoRA adapters,
in that order (adapters after the base is built, and under ZeRO-3 partitioned: DeepSpeed
partitions the new adapter parameters when the engine wraps the model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from align_anything.families.language import lora, parts
from align_anything.families.language.loading import enable_gradient_checkpointing


def prepare_for_training(
    model: Any, *, name: str, freeze: Sequence[str], adapters: dict[str, Any] | None,
    gradient_checkpointing: bool, reward: bool,
) -> tuple[Any, list[str]]:  # fmt: skip
    """(the model to hand to the engine, start-up summary lines). `adapters`: LoRA's r, alpha,
    dropout and target_modules, or None for full training."""
    lines = []
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, name)
        lines.append(
            "  checkpointing   each layer's activations recomputed in the backward pass "
            "(speed.gradient_checkpointing)"
        )
    # Before the engine: DeepSpeed partitions and builds optimizer state for trainable ones.
    parts.freeze_parts(model, freeze, model_name=name)
    if adapters is not None:
        model = lora.add_adapters(model, **adapters, sequence_classification=reward)
        lines.append(f"  adapters        {lora.adapter_summary(model)}")
    return model, lines
