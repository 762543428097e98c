"""Activation checkpointing (train.gradient_checkpointing) recomputes, it does not change the
maths: the same losses as without it, through the shared-prompt DPO path and with LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import DPO_ARGS, SFT_ARGS, RunResult, launch

from align_anything.config import load_config
from align_anything.errors import ConfigError
from align_anything.trainers.base import Trainer


@pytest.mark.slow
def test_dpo_with_checkpointing_equals_without(dpo_single: RunResult, runs_dir: Path) -> None:
    run = launch(
        [*DPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=4",
         "train.gradient_checkpointing=true"],
        runs_dir / "dpo-1rank-checkpointing",
    ).check()  # fmt: skip
    assert "each layer's activations recomputed" in run.summary_line("checkpointing")
    assert run.losses() == pytest.approx(dpo_single.check().losses(), rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_lora_sft_with_checkpointing_equals_without(tmp_path: Path) -> None:
    """LoRA freezes the embedding, so the checkpointed layers' inputs carry no gradient; the
    (non-reentrant) checkpoint still trains the adapters inside them, step for step alike."""
    args = [*SFT_ARGS, "deepspeed=z0", "train.max_steps=2", "model.lora.enabled=true"]
    plain = launch(args, tmp_path / "plain").check()
    checkpointed = launch([*args, "train.gradient_checkpointing=true"], tmp_path / "gc").check()
    assert len(plain.losses()) == 2 and plain.losses()[1] != plain.losses()[0]
    assert checkpointed.losses() == pytest.approx(plain.losses(), rel=1e-6, abs=1e-7)


def test_a_model_without_checkpointing_support_is_a_clear_error() -> None:
    import torch

    trainer = Trainer(load_config([*SFT_ARGS, "train.gradient_checkpointing=true"]))
    trainer.summary_lines = []
    with pytest.raises(ConfigError, match="does not support gradient checkpointing"):
        trainer._enable_gradient_checkpointing(torch.nn.Linear(2, 2))
