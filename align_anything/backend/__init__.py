"""The only importer of deepspeed and torch.distributed (a test enforces it).

- `distributed`: the process group and its collectives, the device, precision names.
- `ds_config`: the pure resolution of a DeepSpeed preset's "auto" values, the batch arithmetic
  and precision; testable without starting DeepSpeed.
- `zero_init`: building models under ZeRO-3 (`deepspeed.zero.Init` through transformers).
- `engine`: `Engine` (a trained model: optimizer, schedule, backward, step, checkpoints) and
  `InferenceEngine` (a frozen one), weight gathering.
- `universal`: checkpoint conversion (DeepSpeed's universal checkpoint, with workarounds) and
  reading DeepSpeed's files.
- `memory`: measured peaks and DeepSpeed's model-state estimators.

Importing the package quiets DeepSpeed's INFO logging and picks its CPU accelerator on a
machine without CUDA, before deepspeed itself is imported anywhere.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"  # say it rather than have DeepSpeed warn that it guessed
# DeepSpeed still calls collectives that torch has renamed; the warning is DeepSpeed's to fix.
warnings.filterwarnings(
    "ignore",
    message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    category=FutureWarning,
)
import deepspeed  # noqa: E402, F401  (after the settings above)

# DeepSpeed prints an INFO line for nearly everything; keep warnings and errors.
for _name in ("DeepSpeed", "deepspeed", "torch.distributed"):
    logging.getLogger(_name).setLevel(logging.WARNING)
