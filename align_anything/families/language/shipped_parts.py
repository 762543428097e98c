"""The built-in multimodal models that ship only their trained parts (`vlm_shapes`,
`alm_tones`): the parts' tensors by name, loading them back whole, and the complete folder
assembled with the built-in SmolLM2 on first use. Each model names its parts by the prefixes
of their parameters in the model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def trained_state(model: Any, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """The tensors of the parts under `prefixes` (what ships), by their names in the model."""
    return {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if name.startswith(prefixes)
    }


def load_trained(model: Any, path: Path, prefixes: tuple[str, ...]) -> None:
    """Load the shipped parts in `path` into `model`: every one of their tensors, no other."""
    from safetensors.torch import load_file

    from align_anything.errors import ModelError

    parts = load_file(str(path))
    expected = set(trained_state(model, prefixes))
    if set(parts) != expected:
        missing, extra = sorted(expected - set(parts)), sorted(set(parts) - expected)
        raise ModelError(f"{path}: missing {missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(parts, strict=False)


def assemble(target: Path, build_model: Callable[[Path], tuple[Any, Any]], language: str,
             parts: Path, prefixes: tuple[str, ...]) -> None:  # fmt: skip
    """Write a complete model folder to `target`: `build_model` around the built-in `language`
    model (converted on first use), the shipped `parts` loaded into it; safetensors, the
    processor beside it."""
    from align_anything.families.zoo import resolve_model_path

    model, processor = build_model(resolve_model_path(language))
    load_trained(model, parts, prefixes)
    model.save_pretrained(target, safe_serialization=True)
    processor.save_pretrained(target)
