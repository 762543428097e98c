"""Activation checkpointing (speed.gradient_checkpointing) recomputes, it does not change the
maths: the same losses as without it, through the shared-prompt DPO path and with LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DPO_ARGS, SFT_ARGS, RunResult, run_inline

from align_anything.errors import ConfigError


@pytest.mark.slow
def test_dpo_with_checkpointing_equals_without(dpo_single: RunResult, runs_dir: Path) -> None:
    run = run_inline(
        [*DPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=4",
         "speed.gradient_checkpointing=true"],
        runs_dir / "dpo-1rank-checkpointing",
    ).check()  # fmt: skip
    assert "each layer's activations recomputed" in run.summary_line("checkpointing")
    assert run.losses() == pytest.approx(dpo_single.check().losses(), rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_lora_sft_with_checkpointing_equals_without(tmp_path: Path) -> None:
    """LoRA freezes the embedding, so the checkpointed layers' inputs carry no gradient; the
    (non-reentrant) checkpoint still trains the adapters inside them, step for step alike."""
    args = [*SFT_ARGS, "deepspeed=z0", "train.max_steps=2", "model.lora.enabled=true"]
    plain = run_inline(args, tmp_path / "plain").check()
    checkpointed = run_inline([*args, "speed.gradient_checkpointing=true"], tmp_path / "gc").check()
    assert len(plain.losses()) == 2 and plain.losses()[1] != plain.losses()[0]
    assert checkpointed.losses() == pytest.approx(plain.losses(), rel=1e-6, abs=1e-7)


def test_a_model_without_checkpointing_support_is_a_clear_error() -> None:
    import torch

    from align_anything.families.language.loading import enable_gradient_checkpointing

    with pytest.raises(ConfigError, match=r"Linear \(my-model\) does not support gradient ch"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), "my-model")
