"""The frozen reference of a preference trainer: which model it is, the summary line that says
so, and the sharded no-grad pass that precomputes its log-probs.

The reference is the model as loaded from `model.name_or_path`, never a resumed checkpoint (so
it is built before a checkpoint is loaded into the policy); in a LoRA run, the policy itself
with its adapters disabled (no second model). KTO uses these helpers; DPO keeps the same steps
in `dpo.py` for now (its file is being changed on another branch) and can move onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from align_anything.backend import distributed as comm
from align_anything.backend.engine import InferenceEngine
from align_anything.backend.zero_init import model_init_context
from align_anything.models import lora
from align_anything.trainers.batching import shard_chunks

if TYPE_CHECKING:
    from align_anything.trainers.base import Trainer

Reference = InferenceEngine | lora.AdapterDisabledReference
Key = TypeVar("Key", bound=Hashable)


def build(trainer: Trainer, *, offload: bool) -> Reference:
    """The reference model of `trainer` (whose engine is built, and no checkpoint loaded yet):
    the policy with adapters disabled in a LoRA run, else the model loaded afresh into a frozen
    inference engine (under ZeRO-3 partitioned like the policy; `offload`: kept on CPU)."""
    if trainer.cfg.model.lora.enabled:
        return lora.AdapterDisabledReference(trainer.engine)
    with model_init_context(trainer.ds_config):
        model = trainer.build_model()
    return InferenceEngine(model, trainer.deepspeed.reference_config(offload=offload))


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
