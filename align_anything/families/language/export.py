"""A language model's exported folders: `final/` (the model, or a LoRA run's adapter, with its
tokenizer or processor and the run's configs), `final-ema/`, `final-merged/` (the adapter merged
into the base weights), written from gathered full state dicts on rank 0, each folder complete
or absent (`atomic.folder`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from align_anything import atomic
from align_anything.families.language import lora


def without_tied_copies(
    module: Any, state: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    """`state` without the weights the model ties to another one (its `all_tied_weights_keys`,
    target -> source: e.g. `lm_head.weight` -> `model.embed_tokens.weight`) where the two are
    equal. save_pretrained leaves out a tied weight only when both names share one tensor; a
    gathered full state dict (ZeRO, the EMA) holds two equal copies, which it would store twice
    (25 MB instead of 12.9 MB for the tiny model); `from_pretrained` ties them again."""
    tied = getattr(module, "all_tied_weights_keys", None) or {}
    if state is None or not tied:
        return state
    return {
        name: value
        for name, value in state.items()
        if not (name in tied and tied[name] in state and torch.equal(value, state[tied[name]]))
    }


def write_final(
    folder: Path, module: Any, state: dict[str, torch.Tensor] | None, *, tokenizer: Any,
    configs: dict[str, Any],
) -> None:  # fmt: skip
    """A Hugging Face folder from a full state dict (rank 0): the model (or, for a LoRA model,
    the adapter) as safetensors, the tokenizer or processor, and `configs` (name → JSON)."""
    with atomic.folder(folder) as tmp:
        if lora.is_peft_model(module):
            lora.save_adapter(module, state, tmp)
        else:
            state = without_tied_copies(module, state)
            module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, data in configs.items():
            (tmp / name).write_text(atomic.to_json(data))


def save_final(
    output_dir: Path, module: Any, state: dict[str, torch.Tensor] | None, *,
    ema_state: dict[str, torch.Tensor] | None, tokenizer: Any, configs: dict[str, Any],
    merge_onto: str | None, task: str,
) -> None:  # fmt: skip
    """A run's exported folders (rank 0): `final/` (the model, or a LoRA run's adapter), with
    an EMA `final-ema/`, and with `merge_onto` (the base model's path) `final-merged/`, the
    adapter merged into the base weights."""
    final = Path(output_dir) / "final"
    write_final(final, module, state, tokenizer=tokenizer, configs=configs)
    if ema_state is not None:
        write_final(final.with_name("final-ema"), module, ema_state, tokenizer=tokenizer,
                    configs=configs)  # fmt: skip
    if merge_onto is not None:
        lora.merge_adapter_folder(final, merge_onto, final.with_name("final-merged"), task=task)
