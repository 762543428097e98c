"""Model parts (vision tower, audio tower, projector, language model, reward head): which part
a parameter belongs to, freezing by part (`model.freeze`), and the per-part summary line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from align_anything.backend.params import full_numel
from align_anything.errors import ConfigError

# Parts `model.freeze` names, matched against parameter-name components in this order (the
# projector first: Qwen2-VL's merger sits inside `visual`). Anything unmatched is the language
# model, except a reward head.
PARTS = ("vision_tower", "audio_tower", "projector", "language_model")

_PART_COMPONENTS = {
    "projector": ("multi_modal_projector", "merger", "connector", "mm_projector"),
    "vision_tower": ("vision_tower", "visual", "vision_model"),
    "audio_tower": ("audio_tower", "audio_model"),
    "head": ("score", "v_head"),
}


def part_of(name: str) -> str:
    """The part a parameter belongs to: vision_tower, audio_tower, projector, head or
    language_model."""
    components = name.split(".")
    for part, markers in _PART_COMPONENTS.items():
        if any(marker in components for marker in markers):
            return part
    return "language_model"


def part_counts(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """part -> (trainable, frozen) parameter counts (ZeRO-3 partitions report `ds_numel`)."""
    counts: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        entry = counts.setdefault(part_of(name), [0, 0])
        entry[0 if param.requires_grad else 1] += full_numel(param)
    return {part: (t, f) for part, (t, f) in counts.items()}


def freeze_parts(model: torch.nn.Module, parts: Sequence[str], *, model_name: str) -> None:
    """Turn off gradients of the named parts; errors name parts the model does not have."""
    if not parts:
        return
    present = part_counts(model)
    missing = [p for p in parts if p not in present]
    if missing:
        raise ConfigError(
            f"model.freeze={list(parts)}: {model_name} has no {', '.join(missing)}; its parts: "
            f"{', '.join(p for p in PARTS if p in present)}"
        )
    for name, param in model.named_parameters():
        if part_of(name) in parts:
            param.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.freeze={list(parts)} leaves nothing to train")


def describe_parts(counts: Mapping[str, tuple[int, int]]) -> str:
    """One summary line: each part's trainable and frozen parameters."""
    order = [*PARTS[:3], "language_model", "head"]
    shown = []
    for part in order:
        if part in counts:
            trainable, frozen = counts[part]
            state = "frozen" if not trainable else "trainable" if not frozen else "partly frozen"
            shown.append(f"{part} {(trainable + frozen) / 1e6:.2f}M {state}")
    return ", ".join(shown)
