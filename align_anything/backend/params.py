"""Parameter counts that hold under every ZeRO stage: a ZeRO-3 partition reports its full
size (`ds_numel`), so a partitioned model counts as the whole model it is."""

from __future__ import annotations

from typing import Any

import torch


def full_numel(param: Any) -> int:
    """A parameter's full element count, also when ZeRO-3 has partitioned it (`ds_numel`)."""
    return getattr(param, "ds_numel", None) or param.numel()


def count_parameters(model: Any) -> tuple[int, int]:
    """(trainable, frozen) parameter counts, of whole parameters also under ZeRO-3."""
    trainable = frozen = 0
    for param in model.parameters():
        if param.requires_grad:
            trainable += full_numel(param)
        else:
            frozen += full_numel(param)
    return trainable, frozen


def largest_layer(model: torch.nn.Module) -> int:
    """The most parameter elements any one module holds itself (ZeRO-3: whole parameters)."""
    return max(
        (sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()),
        default=0,
    )
