"""KTO end to end: the real entry point on the tiny random Llama (CPU fp32, seed 42, 6 steps of a
global batch of 4 unpaired rows from arith-kto), against frozen losses; 2 ranks under ZeRO-3 with
a reference model, and 1 rank with gradient accumulation on the plain path (every speed switch
off), against the 1-rank run; a resumed run against the uninterrupted one; LoRA's reference.

The rate (5e-4) is large enough that the KL estimate leaves its clamp at 0 after a few steps
(steps 4-6 here), so the comparisons cover the all-reduced reference point too: computed per
rank or per micro-batch instead of over the global batch, it would differ between the splits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    COMMON,
    RunResult,
    assert_script_trained,
    run_inline,
    run_script,
    script_overrides,
)

# End to end: the 2-rank run goes through scripts/kto.sh (conftest.run_script), the 1-rank runs
# are in-process (conftest.run_inline).
pytestmark = pytest.mark.slow

STEPS = 6
KTO_ARGS = [
    "task=kto", *COMMON, f"train.max_steps={STEPS}", "data.max_eval_samples=8",
    "train.learning_rate=5e-4", "kto.generation_check_samples=0",
]  # fmt: skip
# Frozen per-step losses of `kto_single` (1 rank × micro 4, ZeRO-0, reference precomputed),
# produced once by running it with torch 2.13 CPU / deepspeed 0.19.8 / transformers 5.24. Step 1
# is exactly 0.5: policy = reference, so every reward and the KL estimate are 0 and each row's
# loss is 1 − σ(0). Change them only for an intended change of the model, data, data order or
# loss, and say so in the commit.
KTO_FROZEN_LOSSES = [
    0.5, 0.4847346544265747, 0.48157739639282227, 0.5010294318199158, 0.500088095664978,
    0.49669474363327026,
]  # fmt: skip
FROZEN_RTOL = 1e-4
# Splits of the same global batch: fp32 summation order only (≤ 3e-7 observed on the loss; the
# KL estimate, a mean of summed log-probs of ~100 tokens, ≤ 1e-5).
LOSS_ATOL = 1e-5
KL_ATOL = 1e-4
KTO_KEYS = (
    "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
    "kl", "count/chosen", "count/rejected",
)  # fmt: skip
EVAL_ROWS = 16  # 8 held-out pairs, each split into a desirable and an undesirable row


@pytest.fixture(scope="module")
def kto_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("kto")
    return {
        # The baseline; checkpoints for the resume test.
        "single": run_inline(
            [
                *KTO_ARGS,
                "deepspeed=z0",
                "train.per_device_batch_size=4",
                "checkpoint.every_steps=2",
                "checkpoint.keep_last=3",
            ],
            root / "single",
        ),  # fmt: skip
        # scripts/kto.sh with PRESET=z3 and --num_gpus 2 (the deepspeed launcher).
        "z3-2ranks-model": run_script(
            "kto.sh",
            root / "z3-2ranks",
            [
                "--num_gpus",
                "2",
                *script_overrides(KTO_ARGS),
                "train.per_device_batch_size=2",
                "kto.reference=model",
            ],
            env={"PRESET": "z3"},
        ),  # fmt: skip
        # Accumulation over 4 micro-batches of 1, every speed switch off; the generation check on.
        "accum4-plain": run_inline(
            [
                *KTO_ARGS,
                "deepspeed=z0",
                "train.per_device_batch_size=1",
                "train.gradient_accumulation_steps=4",
                "speed.share_prefix=false",
                "speed.completion_only_logits=false",
                "speed.tied_grads_in_place=false",
                "kto.generation_check_samples=4",
            ],
            root / "accum4",
        ),  # fmt: skip
    }


def _assert_same_steps(run: RunResult, baseline: RunResult, what: str) -> None:
    got, want = run.check().train_steps(), baseline.check().train_steps()
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=LOSS_ATOL), (what, a["step"], "loss")
        assert a["kl"] == pytest.approx(b["kl"], abs=KL_ATOL), (what, a["step"], "kl")
        for key in ("count/chosen", "count/rejected"):
            assert a[key] == b[key], (what, a["step"], key)


def test_kto_losses_match_frozen_values(kto_runs: dict[str, RunResult]) -> None:
    run = kto_runs["single"].check()
    losses = run.losses()
    assert losses == pytest.approx(KTO_FROZEN_LOSSES, rel=FROZEN_RTOL), losses
    assert losses[0] == 0.5


def test_kto_logs_trl_metric_names_and_counts(kto_runs: dict[str, RunResult]) -> None:
    run = kto_runs["single"].check()
    for line in run.train_steps():
        missing = [k for k in KTO_KEYS if k not in line]
        assert not missing, f"step {line['step']} lacks {missing}"
        # Counts per optimizer step: the global batch's desirable and undesirable rows.
        assert line["count/chosen"] + line["count/rejected"] == 4
        assert line["rewards/margins"] == pytest.approx(
            line["rewards/chosen"] - line["rewards/rejected"]
        )
        assert line["kl"] >= 0
    # The KL estimate leaves its clamp, so the comparisons below test it.
    assert sum(m["kl"] > 0.1 for m in run.train_steps()) >= 2
    before, after = run.eval("before"), run.eval("after")
    assert before["eval/count/chosen"] == before["eval/count/rejected"] == EVAL_ROWS / 2
    # Step 0: policy = reference.
    assert before["eval/loss"] == pytest.approx(0.5, abs=1e-6)
    assert abs(before["eval/rewards/margins"]) < 1e-5 and before["eval/kl"] < 1e-5
    assert after["eval/rewards/margins"] > before["eval/rewards/margins"] + 0.01
    assert "96 desirable, 96 undesirable rows (balanced" in run.summary_line("balance")
    assert "with the completion of row k-1 of each step's global batch" in run.summary_line(
        "kl pairs"
    )
    assert run.summary_line("reference").startswith("precomputed log-probs")


def test_kto_two_ranks_zero3_with_a_reference_model_match_one_rank(
    kto_runs: dict[str, RunResult],
) -> None:
    run = kto_runs["z3-2ranks-model"]
    _assert_same_steps(run, kto_runs["single"], "2 ranks ZeRO-3, reference model")
    assert run.zero_stage() == 3
    assert run.summary_line("reference").startswith("partitioned ZeRO-3 inference engine")
    after, expected = run.eval("after"), kto_runs["single"].eval("after")
    for key in ("eval/loss", "eval/kl", "eval/rewards/margins", "eval/logps/chosen"):
        assert after[key] == pytest.approx(expected[key], rel=1e-5, abs=KL_ATOL), key


def test_kto_accumulation_on_the_plain_path_matches_one_micro_batch(
    kto_runs: dict[str, RunResult],
) -> None:
    """Micro 1 × accumulation 4 with every speed switch off (plain rows everywhere, full
    logits) against micro 4 with the defaults (the micro-batch's common prefix once, completion-
    only logits): the step's z₀ comes from all four micro-batches before any loss, so the losses
    equal micro 4's; and the generation check runs for KTO too."""
    run = kto_runs["accum4-plain"]
    _assert_same_steps(run, kto_runs["single"], "accumulation 4, plain path")
    assert run.summary_line("rows").startswith("plain rows")
    assert "common prefix once" in kto_runs["single"].summary_line("rows")
    for phase in ("before", "after"):
        assert 0.0 <= run.eval(phase)["eval/generation_check"] <= 1.0


def test_kto_resume_equals_uninterrupted(kto_runs: dict[str, RunResult], tmp_path: Path) -> None:
    single = kto_runs["single"].check()
    step4 = single.output_dir / "checkpoints" / "step-4"
    resumed = run_inline(
        [*KTO_ARGS, "deepspeed=z0", "train.per_device_batch_size=4", f"resume={step4}"],
        tmp_path / "resumed",
    ).check()
    assert "resumed         from" in resumed.output
    got = resumed.train_steps()
    assert [m["step"] for m in got] == [5, 6]
    for a, b in zip(got, single.train_steps()[4:], strict=True):
        # Same process layout, same data order, optimizer state and reference: round-off only.
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["kl"] == pytest.approx(b["kl"], abs=1e-6) and a["kl"] > 0


def test_kto_lora_reference_is_the_base_model(tmp_path: Path) -> None:
    """With LoRA the reference is the policy with its adapters disabled (no second model): at
    step 1 (adapters at zero) every reward is 0 and the loss is 0.5; once the adapters train,
    the rewards move, which they could not if the reference followed the adapters."""
    run = run_inline(
        [*KTO_ARGS, "deepspeed=z0", "train.per_device_batch_size=4", "kto.reference=model",
         "model.lora.enabled=true", "model.lora.r=8", "train.learning_rate=1e-3",
         "train.max_steps=3"],
        tmp_path / "lora",
    ).check()  # fmt: skip
    assert "adapters disabled" in run.summary_line("reference")
    first, last = run.train_steps()[0], run.train_steps()[-1]
    assert first["loss"] == pytest.approx(0.5, abs=1e-7) and first["rewards/margins"] == 0.0
    assert abs(last["rewards/chosen"]) + abs(last["rewards/rejected"]) > 1e-3
    assert run.eval("after")["eval/rewards/margins"] != pytest.approx(0.0, abs=1e-4)


def test_script_trains_on_two_cpu_ranks(kto_runs: dict[str, RunResult]) -> None:
    """test_scripts.py's check of scripts/kto.sh, on its run above."""
    assert_script_trained(kto_runs["z3-2ranks-model"], stage=3, steps=STEPS)
