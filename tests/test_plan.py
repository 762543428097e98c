"""The memory planner: hand-derived per-device figures, the choice `deepspeed=auto` makes, and
the trainer following it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SFT_ARGS, merged, run_inline

from align_anything.config import load_config, load_preset
from align_anything.errors import ConfigError
from align_anything.families.language import memory as lm_memory
from align_anything.families.language.family import LANGUAGE_MODELS
from align_anything.families.language.sizes import ModelSizes
from align_anything.tools import plan as plan_tool
from align_anything.training import memory_plan as plan

GIB = 2**30
# A made-up model small enough to derive every figure by hand.
SIZES = ModelSizes(total=1000, trainable=1000, largest_layer=100, hidden=8, layers=2, vocab=10)


def _estimate(preset: str, overrides: list[str], *, sizes=SIZES, world=2, precision="fp32"):
    cfg = load_config(["train.per_device_batch_size=2", "data.max_length=16", *overrides])
    ds_config, _ = load_preset(preset)
    return lm_memory.estimate_preset(
        preset, ds_config, sizes, cfg, world_size=world, gpus_per_node=world, precision=precision
    )


def test_fp32_model_states_by_stage() -> None:
    # fp32 Adam: weights 4 + gradients 4 + moments 8 bytes per parameter; ZeRO-2 partitions
    # gradients and moments over N=2 ranks, ZeRO-3 also the weights.
    assert _estimate("z0", ["task=sft"]).model_states == 16_000
    assert _estimate("z2", ["task=sft"]).model_states == 4000 + 4000 / 2 + 8000 / 2
    assert _estimate("z3", ["task=sft"]).model_states == 16_000 / 2
    offload = _estimate("z3_offload", ["task=sft"])
    # Moments and weights leave the device (host: both ranks' shares); the largest layer
    # stays as a gather buffer.
    assert offload.model_states == 4 * 100 + 4000 / 2
    assert offload.host == (8000 / 2 + 4000 / 2) * 2


def test_mixed_precision_uses_deepspeeds_estimators() -> None:
    # DeepSpeed: ZeRO-2 = 2·P + 18·P/N on the device; ZeRO-3 = 4·largest layer + 18·P/N.
    assert _estimate("z2", ["task=sft"], precision="bf16").model_states == 2000 + 18_000 / 2
    assert _estimate("z3", ["task=sft"], precision="bf16").model_states == 400 + 18_000 / 2
    assert _estimate("z2", ["task=sft"], precision="bf16").source == "DeepSpeed estimator"


def test_activations_reference_and_lora() -> None:
    sft = _estimate("z0", ["task=sft"])
    # 34·s·b·h bytes per layer (16-bit), doubled in fp32; plus logits b·s·V·4.
    assert sft.activations == 34 * 16 * 2 * 8 * 2 * 2 + 2 * 16 * 10 * 4
    # Checkpointing: every layer's input (2·s·b·h, doubled in fp32) plus one layer recomputed.
    checkpointed = _estimate("z0", ["task=sft", "speed.gradient_checkpointing=true"])
    assert (
        checkpointed.activations == 2 * 16 * 2 * 8 * 2 * 2 + 34 * 16 * 2 * 8 * 2 + 2 * 16 * 10 * 4
    )
    dpo = _estimate("z3", ["task=dpo"])
    assert dpo.activations == 2 * sft.activations  # chosen and rejected: twice the sequences
    assert dpo.reference == 1000 * 4 / 2  # frozen fp32 weights, partitioned under ZeRO-3
    assert _estimate("z0", ["task=dpo"]).reference == 4000
    assert _estimate("z0", ["task=dpo", "dpo.loss_type=simpo"]).reference == 0
    lora_sizes = ModelSizes(total=1000, trainable=100, largest_layer=100, hidden=8,
                                 layers=2, vocab=10)  # fmt: skip
    lora = _estimate("z0", ["task=dpo", "model.lora.enabled=true"], sizes=lora_sizes)
    assert lora.reference == 0  # the base model with adapters off is the reference
    assert lora.model_states == 100 * 16 + 900 * 4


def _fake(preset: str, stage: int, total_gib: float) -> plan.Estimate:
    return plan.Estimate(preset, stage, total_gib * GIB, 0, 0, 0, 0, "test")


def test_auto_takes_the_lowest_stage_that_fits() -> None:
    estimates = [
        _fake("z0", 0, 30),
        _fake("z2", 2, 20),
        _fake("z3", 3, 12),
        _fake("z3_offload", 3, 5),
    ]
    chosen, reason = plan.choose(estimates, 24 * GIB)  # 90%: 21.6 GiB
    assert chosen.preset == "z2"
    assert "z0 needs 30.00 GiB" in reason
    assert plan.choose(estimates, 40 * GIB)[0].preset == "z0"
    assert plan.choose(estimates, 6 * GIB)[0].preset == "z3_offload"
    with pytest.raises(ConfigError, match="no preset fits .* smallest estimate is z3_offload"):
        plan.choose(estimates, 5 * GIB)


def test_plan_command_prints_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_tool.main(["--world-size", "2", "task=dpo", "model.name_or_path=tiny-random-llama",
                      "train.memory_budget_gb=8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for preset in plan.PRESET_ORDER:
        assert f"\n{preset} " in out
    assert "budget per device: 8.00 GiB (train.memory_budget_gb)" in out
    assert "deepspeed=auto would choose z0" in out


@pytest.mark.slow
def test_train_with_auto_follows_the_planner(tmp_path: Path) -> None:
    """A budget between the ZeRO-0 and the offload estimates makes auto pick ZeRO-3 offload
    on one process (with one rank, ZeRO-2/3 partition nothing)."""
    overrides = merged([*SFT_ARGS, "train.max_steps=1"])
    cfg = load_config(overrides)
    figures, _, _ = plan.plan(cfg, LANGUAGE_MODELS.estimate_memory, world_size=1)
    by_name = {e.preset: e for e in figures.estimates}
    budget = (by_name["z3_offload"].total + by_name["z3"].total) / 2 / plan.HEADROOM / GIB
    run = run_inline(
        [*overrides, "deepspeed=auto", f"train.memory_budget_gb={budget}",
         "deepspeed.zero_optimization.overlap_comm=false"],
        tmp_path / "auto",
    ).check()  # fmt: skip
    assert run.zero_stage() == 3
    assert run.summary_line("deepspeed=auto").startswith("z3_offload: estimated")
    # The start-up summary's memory line is the planner's figure for the chosen preset.
    chosen = by_name["z3_offload"]
    assert run.summary_line("memory plan").startswith(
        f"≈ {chosen.total / GIB:.2f} GiB per device = model states {chosen.model_states / GIB:.2f}"
    )
    # The run config is saved as the user gave it (auto, with the overrides); the DeepSpeed
    # config the engine got is the chosen preset with the command line's override on top.
    saved = json.loads((tmp_path / "auto" / "run_config.json").read_text())
    assert saved["deepspeed_source"] == "auto"
    assert saved["deepspeed"] == {"zero_optimization": {"overlap_comm": False}}
    zero = json.loads((tmp_path / "auto" / "ds_config.json").read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["overlap_comm"] is False
