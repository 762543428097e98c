"""The versions of the libraries a run's numbers depend on, for the start-up summary (so that a
bug report carries them)."""

from __future__ import annotations

import sys
from importlib import metadata

# The libraries whose releases change what a run computes, in the order the summary names them.
LIBRARIES = ("torch", "deepspeed", "transformers", "datasets")
# Those only some runs use, named when the run has imported them: diffusers (the pipeline
# families), the media decoders (av: video clips; soundfile: audio files), vllm
# (rollout.backend=vllm).
IMPORTED_LIBRARIES = ("diffusers", "av", "soundfile", "vllm")


def _version(name: str) -> str:
    try:
        return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return f"{name} not installed"


def library_versions(*, lora: bool = False) -> str:
    """ "torch 2.13.0+cpu, deepspeed 0.19.8, transformers 5.24.0, datasets 5.2.0" (as installed;
    "not installed" for one that is missing), then those of `IMPORTED_LIBRARIES` this process
    has imported, and peft for a LoRA run (`lora`; diffusers imports peft whenever it is
    installed, so an import says nothing): ", diffusers 0.42.1, peft 0.21.2" for a
    text-to-image LoRA run. Call it once the run is set up: its model is loaded."""
    used = [name for name in IMPORTED_LIBRARIES if name in sys.modules]
    return ", ".join(_version(name) for name in (*LIBRARIES, *used, *(["peft"] if lora else [])))
