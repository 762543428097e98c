"""The weight EMA: hand-derived averages of the logged weights, under ZeRO-0 and ZeRO-3 on two
ranks, saved in checkpoints and restored on resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SFT_ARGS, TINY_MODEL, RunResult, launch, run_inline
from safetensors.torch import load_file

from align_anything.backend.universal import checkpoint_state_dict
from align_anything.families.zoo import resolve_model_path

# End to end: the 2-rank run is launched (conftest.launch), the 1-rank runs are in-process
# (conftest.run_inline).
pytestmark = pytest.mark.slow

# decay 0.5 over two steps: e2 = 0.5·(0.5·w0 + 0.5·w1) + 0.5·w2 = 0.25·w0 + 0.25·w1 + 0.5·w2,
# with w0 the initial weights and w1, w2 the weights after steps 1 and 2.
EMA_ARGS = [*SFT_ARGS, "train.max_steps=2", "train.ema.enabled=true", "train.ema.decay=0.5",
            "checkpoint.every_steps=1", "checkpoint.keep_last=2"]  # fmt: skip


def _expected_average(run: RunResult) -> dict[str, torch.Tensor]:
    w0 = load_file(Path(resolve_model_path(TINY_MODEL)) / "model.safetensors")
    w1 = checkpoint_state_dict(run.output_dir / "checkpoints" / "step-1")
    w2 = load_file(run.output_dir / "final" / "model.safetensors")
    # Keys of the initial folder: a tied output head is saved once (as the embedding) there.
    return {k: 0.25 * w0[k] + 0.25 * w1[k] + 0.5 * w2[k] for k in w0}


def _check_average(run: RunResult) -> dict[str, torch.Tensor]:
    averaged = load_file(run.output_dir / "final-ema" / "model.safetensors")
    expected = _expected_average(run)
    assert expected.keys() <= averaged.keys()
    for name, value in expected.items():
        torch.testing.assert_close(averaged[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # The average really differs from the final weights (the check above is not vacuous).
    final = load_file(run.output_dir / "final" / "model.safetensors")
    assert max((averaged[k] - final[k]).abs().max().item() for k in final) > 1e-5
    # The last checkpoint holds the same average.
    saved = load_file(run.output_dir / "checkpoints" / "step-2" / "ema.safetensors")
    for name, value in saved.items():
        torch.testing.assert_close(averaged[name], value, rtol=0, atol=0, msg=name)
    return averaged


def test_ema_zero3_two_ranks_is_the_hand_derived_average(tmp_path: Path) -> None:
    run = launch([*EMA_ARGS, "deepspeed=z3", "train.per_device_batch_size=2"], tmp_path / "z3",
                 launcher="deepspeed", nproc=2).check()  # fmt: skip
    assert run.zero_stage() == 3
    assert "decay 0.5" in run.summary_line("ema")
    _check_average(run)


def test_ema_zero0_average_and_resume(tmp_path: Path) -> None:
    run = run_inline([*EMA_ARGS, "deepspeed=z0"], tmp_path / "z0").check()
    averaged = _check_average(run)
    resumed = run_inline(
        [*EMA_ARGS, "deepspeed=z0", f"resume={run.output_dir / 'checkpoints' / 'step-1'}"],
        tmp_path / "resumed",
    ).check()
    assert "restored from the checkpoint" in resumed.summary_line("ema")
    again = load_file(resumed.output_dir / "final-ema" / "model.safetensors")
    for name, value in averaged.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=1e-7, msg=name)
