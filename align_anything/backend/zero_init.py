"""Models built under ZeRO-3: transformers constructs them inside `deepspeed.zero.Init`
(`model_init_context`); a diffusers denoiser is built from its config under
`partitioned_construction` and its weights copied in with `load_into_partitions`; the frozen
helpers of a diffusion run are built whole (`whole_models`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from align_anything.backend.ds_config import zero_stage_of

# transformers reads a module-level weak reference to this object in `from_pretrained`; it must
# stay alive while ZeRO-3 models are built, so the context keeps it here.
_HF_DS_CONFIGS: list[Any] = []


@contextlib.contextmanager
def model_init_context(ds_config: dict[str, Any]) -> Iterator[None]:
    """Build models inside this context. Under ZeRO-3 transformers then constructs the model
    under `deepspeed.zero.Init`, so weights load straight into partitions (never whole on one
    rank) and `from_pretrained` still applies the checkpoint's weights."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # transformers keeps a process-wide reference; clear any earlier run's so that a stage-0/2
    # model built after a stage-3 one in the same process is not partitioned.
    unset_hf_deepspeed_config()
    _HF_DS_CONFIGS.clear()
    if zero_stage_of(ds_config) == 3:
        # Kept alive after the context: generation under ZeRO-3 checks it (synced_gpus).
        _HF_DS_CONFIGS.append(HfDeepSpeedConfig(ds_config))
    yield


def forget() -> None:
    """Forget the ZeRO-3 construction config (end of a run): a later stage-0/2 model in the same
    process must not be partitioned."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    _HF_DS_CONFIGS.clear()


@contextlib.contextmanager
def whole_models() -> Iterator[None]:
    """Build models inside this context whole, never partitioned, even while a ZeRO-3 run's
    construction config is alive: the frozen helpers of a diffusion run (VAE, text encoders)
    live outside the trained engine and must not be built under `zero.Init`, or every forward
    would need collectives that only the engine's hooks issue."""
    from transformers.integrations.deepspeed import (
        set_hf_deepspeed_config,
        unset_hf_deepspeed_config,
    )

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if _HF_DS_CONFIGS:
            set_hf_deepspeed_config(_HF_DS_CONFIGS[-1])


@contextlib.contextmanager
def partitioned_construction(ds_config: dict[str, Any]) -> Iterator[bool]:
    """Build a model that is not a transformers model (a diffusers denoiser) inside this
    context: under ZeRO-3 every parameter is partitioned as its module is constructed
    (`deepspeed.zero.Init`), so no rank ever holds the whole model; yields whether it did.
    transformers does this itself inside `model_init_context`; diffusers' loader does not, so
    the caller builds from the config here and then calls `load_into_partitions`. The
    partitions' dtype is the config's precision (bf16 or fp16 enabled, else fp32): DeepSpeed
    0.19.8 ignores an explicit `dtype=` wherever fp16 is unsupported, CPU included (operator
    precedence in `Init._set_dtype`), so none is passed."""
    if zero_stage_of(ds_config) != 3:
        yield False
        return
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        yield True


def load_into_partitions(module: torch.nn.Module, read: Callable[[str], torch.Tensor]) -> None:
    """Copy a checkpoint into a module built under `partitioned_construction`: one module's own
    parameters gathered at a time (rank 0 writes them, DeepSpeed scatters the new values back
    into every rank's partition), so peak memory is the largest layer, not the model.
    `read(name)` returns the checkpoint's tensor of a parameter or buffer (called on rank 0
    only for parameters, on every rank for buffers, which ZeRO-3 does not partition).
    Collective: every rank calls it with the same module."""
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        params = list(sub.named_parameters(recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        for name, param in params:
                            param.copy_(read(dot + name).to(param.dtype))
        for name, buffer in sub.named_buffers(recurse=False):
            if name in sub._non_persistent_buffers_set:
                continue
            with torch.no_grad():
                buffer.copy_(read(dot + name).to(buffer.dtype))
