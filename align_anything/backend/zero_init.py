"""Models built under ZeRO-3: transformers constructs them inside `deepspeed.zero.Init`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

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
