"""The versions of the libraries a run's numbers depend on, for the start-up summary (so that a
bug report carries them)."""

from __future__ import annotations

from importlib import metadata

# The libraries whose releases change what a run computes, in the order the summary names them.
LIBRARIES = ("torch", "deepspeed", "transformers", "datasets")


def library_versions() -> str:
    """ "torch 2.13.0+cpu, deepspeed 0.19.8, transformers 5.24.0, datasets 5.2.0" (as installed;
    "not installed" for one that is missing)."""
    found = []
    for name in LIBRARIES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)
