"""The frozen reference of a preference trainer: which model it is, the summary line that says
so, and the sharded no-grad pass that precomputes its log-probs.

The reference is the model as loaded from `model.name_or_path`, never a resumed checkpoint;
in a LoRA run, the policy itself with its adapters disabled (no second model). DPO, KTO and
online RL (β > 0) use these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch

from align_anything.backend import distributed as comm
from align_anything.backend.engine import Engine, InferenceEngine
from align_anything.families.language import lora
from align_anything.training.batching import shard_chunks

Reference = InferenceEngine | lora.AdapterDisabledReference
Key = TypeVar("Key", bound=Hashable)


def build(
    *, policy: Engine, lora_enabled: bool, load_model: Callable[[], torch.nn.Module],
    ds_config: dict[str, Any],
) -> Reference:  # fmt: skip
    """The frozen reference beside `policy`: the policy with adapters disabled in a LoRA run,
    else `load_model()` (the model as loaded before training; under ZeRO-3 partitioned like
    the policy) in a frozen inference engine with `ds_config` (`DeepSpeedPlan.reference_config`:
    offloaded to CPU when asked)."""
    if lora_enabled:
        return lora.AdapterDisabledReference(policy)
    return InferenceEngine(load_model(), ds_config)


def describe(
    reference: Reference, *, lora_enabled: bool, offload: bool, precomputed_s: float | None
) -> str:
    """The start-up summary's reference line: precomputed (and how long it took) or kept, and
    where it lives."""
    if precomputed_s is not None:
        source = (
            "from the policy with adapters disabled (no second model)"
            if lora_enabled
            else "model freed"
        )
        return (
            f"  reference       precomputed log-probs (one no-grad pass, {precomputed_s:.1f} s), "
            + source
        )
    if lora_enabled:
        return "  reference       the base model: the policy with adapters disabled (no copy)"
    assert isinstance(reference, InferenceEngine)
    where = "partitioned ZeRO-3 inference engine" if reference.stage == 3 else "frozen copy"
    where += ", offloaded to CPU" if offload else ""
    return f"  reference       {where}, no gradients or optimizer state"


def precompute(
    keys: Sequence[Key], score: Callable[[list[Key]], list[Any]], *, chunk: int, rank: int,
    world: int,
) -> dict[Key, Any]:  # fmt: skip
    """{key: value} for every key, each rank scoring a shard (`score`: a chunk of keys -> one
    value per key, a forward pass), then every rank receiving all of them, since any rank may
    need any key later. Every rank calls `score` equally often (ZeRO-3 forwards are
    collective): a rank whose shard has run out scores `keys[:1]` and drops the result."""
    results: dict[Key, Any] = {}
    for indices in shard_chunks(len(keys), chunk=chunk, rank=rank, world=world):
        part = [keys[i] for i in indices or [0]]
        values = score(part)
        if indices is not None:
            results.update(zip(part, values, strict=True))
    merged: dict[Key, Any] = {}
    for shard in comm.all_gather_objects(results):
        merged.update(shard)
    return merged
