"""Datasets the project generates and ships (no copied text); see `generate` below."""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).parent / "builtin"

# name -> file under BUILTIN_DIR. `data.path=<name>` selects one.
BUILTIN_DATASETS: dict[str, str] = {}


def builtin_path(name: str) -> Path | None:
    """The shipped file for a built-in dataset name, or None when `name` is not built in."""
    filename = BUILTIN_DATASETS.get(name)
    return BUILTIN_DIR / filename if filename else None
