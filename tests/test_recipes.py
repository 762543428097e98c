"""Recipe tests: the real entry point (`python -m align_anything.train`) on the tiny random Llama,
CPU fp32, seed 42, compared with frozen reference values and with the exported model.

Every run here is one rank, in-process (conftest.run_inline: `align_anything.train.main`, as
`python -m align_anything.train` calls it, without a new interpreter's imports); the SFT / DPO /
RM runs are session fixtures shared with test_distributed.py, where the 2-rank runs are launched
(including the 2-rank DPO runs whose step 0 is checked to be ln 2).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import COMMON, DPO_ARGS, RECIPE_STEPS, TINY_MODEL, RunResult, run_inline

from align_anything.data.formats import load_records, split_records
from align_anything.families.language import collate_preference, collate_sft
from align_anything.families.language.encode import encode_preference, encode_sft
from align_anything.families.language.forward import completion_logps
from align_anything.families.zoo import resolve_model_path

# End to end: every test here runs the real trainer.
pytestmark = pytest.mark.slow

LN2 = math.log(2.0)
# Frozen values are compared with this relative tolerance: runs on one machine repeat to ~1e-7;
# the slack covers other CPUs' kernels and thread counts, not a change in what is computed.
FROZEN_RTOL = 1e-4

# Frozen per-step training losses (metrics.jsonl "loss", steps 1-4). Produced once by running the
# fixtures' commands (conftest.SFT_ARGS / DPO_ARGS / RM_ARGS with deepspeed=z0,
# train.per_device_batch_size=4: 1 rank × micro 4 × 4 steps, tiny-random-llama v1, fp32, seed 42)
# with torch 2.13 CPU / deepspeed 0.19.8 / transformers 5.24, and pasting the logged values here
# rounded to 8 significant digits (SFT to 1e-6). The 2-rank runs of test_distributed.py log the
# same values to < 1e-6. Refresh them only for an intended change of the model, data, data order
# or loss, and say so in the commit.
SFT_FROZEN_LOSSES = [10.804016, 10.563582, 10.426896, 10.284957]
DPO_FROZEN_LOSSES = [0.69314718, 0.68346757, 0.66950291, 0.65626657]  # step 1 is ln 2
RM_FROZEN_LOSSES = [0.69775480, 0.69100666, 0.68954742, 0.68180406]

TRAIN_KEYS = ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second")
DPO_KEYS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected",
)  # fmt: skip
RM_KEYS = ("accuracy", "margin", "reward_mean", "reward_std")


def _final_dir(run: RunResult) -> Path:
    final = run.output_dir / "final"
    assert (final / "model.safetensors").exists(), f"no exported weights in {final}"
    return final


def _load_exported(run: RunResult, model_class: type) -> torch.nn.Module:
    """final/ as a user loads it: `from_pretrained` on the folder, nothing added."""
    return model_class.from_pretrained(_final_dir(run), dtype=torch.float32).eval()


def _assert_finite(values: dict, where: str) -> None:
    bad = {k: v for k, v in values.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite values in {where}: {bad}"


def _eval_preference_rows(tokenizer, *, max_length: int, count: int) -> list[dict]:
    """The first `count` pairs of the built-in eval set, encoded as the trainers encode them
    (data.eval_path=arith-pref-eval, data.max_eval_samples=count)."""
    records, _ = load_records("arith-pref-eval")
    rows, report = encode_preference(records[:count], tokenizer, max_length=max_length)
    assert len(rows) == count, report.summary()
    return rows


# ---------------------------------------------------------------------------- frozen losses


@pytest.mark.parametrize(
    ("fixture", "frozen"),
    [("sft_single", SFT_FROZEN_LOSSES), ("dpo_single", DPO_FROZEN_LOSSES), ("rm_single", RM_FROZEN_LOSSES)],
    ids=["sft", "dpo-sigmoid", "rm"],
)  # fmt: skip
def test_training_losses_match_frozen_values(
    fixture: str, frozen: list[float], request: pytest.FixtureRequest
) -> None:
    run: RunResult = request.getfixturevalue(fixture).check()
    losses = run.losses()
    assert [m["step"] for m in run.train_steps()] == list(range(1, RECIPE_STEPS + 1))
    assert losses == pytest.approx(frozen, rel=FROZEN_RTOL), (
        f"{fixture}: logged losses {losses} differ from the frozen {frozen}"
    )


# ---------------------------------------------------------------------------- metrics.jsonl


@pytest.mark.parametrize(
    ("fixture", "extra_keys"),
    [("sft_single", ("perplexity",)), ("dpo_single", DPO_KEYS), ("rm_single", RM_KEYS)],
    ids=["sft", "dpo", "rm"],
)
def test_metrics_jsonl_has_the_required_keys(
    fixture: str, extra_keys: tuple[str, ...], request: pytest.FixtureRequest
) -> None:
    run: RunResult = request.getfixturevalue(fixture).check()
    steps = run.train_steps()
    assert len(steps) == RECIPE_STEPS
    for line in steps:
        missing = [k for k in (*TRAIN_KEYS, *extra_keys) if k not in line]
        assert not missing, f"step {line.get('step')} lacks {missing}: {line}"
        _assert_finite(line, f"step {line['step']}")
        assert line["learning_rate"] > 0 and line["grad_norm"] > 0 and line["tokens_per_second"] > 0
    for phase in ("before", "after"):
        line = run.eval(phase)
        missing = [f"eval/{k}" for k in ("loss", *extra_keys) if f"eval/{k}" not in line]
        assert not missing, f"eval line ({phase}) lacks {missing}: {line}"
        _assert_finite(line, f"eval ({phase})")
    assert run.eval("after")["step"] == RECIPE_STEPS
    for name in ("summary.json", "run_config.json", "ds_config.json"):
        assert (run.output_dir / name).exists(), f"{name} missing from {run.output_dir}"
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert summary["steps"] == RECIPE_STEPS


# ---------------------------------------------------------------------------- exports


@pytest.mark.parametrize(
    ("fixture", "auto_class"),
    [("sft_single", "AutoModelForCausalLM"), ("dpo_single", "AutoModelForCausalLM"),
     ("rm_single", "AutoModelForSequenceClassification")],
    ids=["sft", "dpo", "rm"],
)  # fmt: skip
def test_final_folder_loads_with_from_pretrained(
    fixture: str, auto_class: str, request: pytest.FixtureRequest
) -> None:
    """output_dir/final is a Hugging Face folder a user loads with one call, as it is."""
    import transformers

    run: RunResult = request.getfixturevalue(fixture).check()
    final = _final_dir(run)
    hf_config = json.loads((final / "config.json").read_text())
    assert "model_type" in hf_config, (
        f"{final / 'config.json'} is not a model config (keys: {sorted(hf_config)[:8]}…): the "
        "run's resolved config was written over the one save_pretrained wrote"
    )
    model = getattr(transformers, auto_class).from_pretrained(final)
    assert type(model).__name__.startswith("Llama")
    if auto_class == "AutoModelForSequenceClassification":
        assert model.config.num_labels == 1
    # The saved tokenizer encodes a conversation (chat template included) as the base model's does.
    saved = transformers.AutoTokenizer.from_pretrained(final)
    base = transformers.AutoTokenizer.from_pretrained(resolve_model_path(TINY_MODEL))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    encoded = [
        t.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        for t in (saved, base)
    ]
    assert encoded[0] == encoded[1]
    # The resolved configs travel with the weights (DESIGN §1), under names of their own.
    assert (final / "run_config.json").exists() and (final / "ds_config.json").exists()


def test_sft_export_loads_and_scores_like_training(sft_single: RunResult) -> None:
    """final/ loads with AutoModelForCausalLM, and its loss on the held-out rows equals the
    run's own `eval/loss` after training (which moved away from the value before): final/ holds
    the trained weights, and its tokenizer encodes as training did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = sft_single.check()
    model = _load_exported(run, AutoModelForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(_final_dir(run))
    records, _ = load_records("arith-sft")
    _, held_out = split_records(records, eval_fraction=0.05, seed=42)  # train.yaml's default
    rows, report = encode_sft(held_out[:8], tokenizer, max_length=256)
    assert len(rows) == 8, report.summary()
    batch = collate_sft(rows, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps, counts = completion_logps(logits, batch["labels"])
    exported_loss = float(-logps.sum() / counts.sum())
    before, after = run.eval("before")["eval/loss"], run.eval("after")["eval/loss"]
    assert abs(after - before) > 1e-3, (
        "training did not move the eval loss; the check below is moot"
    )
    assert exported_loss == pytest.approx(after, rel=1e-5)


def test_dpo_export_loads_and_scores_like_training(dpo_single: RunResult) -> None:
    """final/ loads with AutoModelForCausalLM and gives the completion log-probs the run logged
    as `eval/logps/chosen` / `eval/logps/rejected` after training."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = dpo_single.check()
    model = _load_exported(run, AutoModelForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(_final_dir(run))
    rows = _eval_preference_rows(tokenizer, max_length=128, count=8)
    batch = collate_preference(rows, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps, _ = completion_logps(logits, batch["labels"])
    chosen, rejected = logps[:8].mean().item(), logps[8:].mean().item()
    after = run.eval("after")
    assert after["eval/logps/chosen"] != pytest.approx(
        run.eval("before")["eval/logps/chosen"], abs=1e-3
    )
    assert chosen == pytest.approx(after["eval/logps/chosen"], rel=1e-5)
    assert rejected == pytest.approx(after["eval/logps/rejected"], rel=1e-5)


def test_rm_export_scores_like_training(rm_single: RunResult) -> None:
    """final/ loads with AutoModelForSequenceClassification; scoring each eval sequence alone
    (no padding) reproduces the run's eval reward statistics after training, and a padded batch
    scores the same as one sequence at a time (the score is read at the last real token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    run = rm_single.check()
    tokenizer = AutoTokenizer.from_pretrained(_final_dir(run))
    model = _load_exported(run, AutoModelForSequenceClassification)
    # Scores are read at the last token that is not the pad id: the config must carry it.
    assert model.config.pad_token_id == tokenizer.pad_token_id
    rows = _eval_preference_rows(tokenizer, max_length=128, count=8)

    def score(ids: list[list[int]]) -> torch.Tensor:
        batch = collate_sft(
            [{"input_ids": s, "labels": s} for s in ids], pad_id=tokenizer.pad_token_id
        )
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return out.logits.squeeze(-1).float()

    chosen = torch.cat([score([r["prompt_ids"] + r["chosen_ids"]]) for r in rows])
    rejected = torch.cat([score([r["prompt_ids"] + r["rejected_ids"]]) for r in rows])
    both = torch.cat([chosen, rejected])
    after = run.eval("after")
    assert float((chosen - rejected).mean()) == pytest.approx(
        after["eval/margin"], rel=1e-4, abs=1e-6
    )
    assert float(both.mean()) == pytest.approx(after["eval/reward_mean"], rel=1e-4, abs=1e-6)
    assert float(both.std(correction=0)) == pytest.approx(after["eval/reward_std"], rel=1e-4)
    assert float((chosen > rejected).float().mean()) == pytest.approx(after["eval/accuracy"])
    # Two pairs in one right-padded batch score as they do alone.
    padded = score(
        [
            rows[0]["prompt_ids"] + rows[0]["chosen_ids"],
            rows[1]["prompt_ids"] + rows[1]["rejected_ids"],
        ]
    )
    assert padded.tolist() == pytest.approx(
        [chosen[0].item(), rejected[1].item()], rel=1e-5, abs=1e-6
    )


# ---------------------------------------------------------------------------- DPO at step 0


def _assert_step0_is_ln2(run: RunResult) -> None:
    run.check()
    before = run.eval("before")
    first = run.train_steps()[0]
    assert first["step"] == 1
    # Policy = reference at step 0: every log-ratio is 0, so the sigmoid loss is exactly ln 2.
    assert before["eval/loss"] == pytest.approx(LN2, abs=1e-6), before
    assert before["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-6), before
    assert first["loss"] == pytest.approx(LN2, abs=1e-6), first
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6), first


def test_dpo_step0_loss_is_ln2_single_rank(dpo_single: RunResult) -> None:
    _assert_step0_is_ln2(dpo_single)


# ---------------------------------------------------------------------------- DPO loss family


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "simpo", "orpo"])
def test_dpo_loss_types_run_end_to_end(loss_type: str, runs_dir: Path) -> None:
    run = run_inline(
        [*DPO_ARGS, "deepspeed=z0", "train.per_device_batch_size=4", f"dpo.loss_type={loss_type}",
         "train.max_steps=2", "data.max_eval_samples=4"],
        runs_dir / f"dpo-{loss_type}",
    ).check()  # fmt: skip
    losses = run.losses()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    for phase in ("before", "after"):
        assert math.isfinite(run.eval(phase)["eval/loss"]), run.eval(phase)
    reference = run.summary_line("reference")
    if loss_type in ("simpo", "orpo"):
        assert reference.startswith("none") and "reference-free" in reference, reference
    else:
        assert "precomputed" in reference, reference
        # With a reference, step 0 has zero log-ratios: hinge = max(0, 1 - 0) = 1 and
        # ipo = (0 - 1/(2β))² = 25 at β = 0.1.
        expected = {"hinge": 1.0, "ipo": (1 / (2 * 0.1)) ** 2}[loss_type]
        assert losses[0] == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------------------- RM learns


def _write_separable_pairs(path: Path, *, count: int, offset: int) -> None:
    """Pairs whose chosen answer always praises and whose rejected answer always disparages: a
    feature a 2-layer model picks up in a couple of dozen steps."""
    with path.open("w") as handle:
        for i in range(offset, offset + count):
            handle.write(json.dumps({
                "prompt": f"Item {i}: what do you think of it?",
                "chosen": f"Item {i} is good, good, very good.",
                "rejected": f"Item {i} is bad, bad, very bad.",
            }) + "\n")  # fmt: skip


def test_rm_accuracy_rises_above_chance_on_separable_data(tmp_path: Path) -> None:
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    _write_separable_pairs(train, count=128, offset=0)
    _write_separable_pairs(held_out, count=16, offset=1000)
    run = run_inline(
        ["task=rm", *COMMON, "deepspeed=z0", f"data.path={train}", f"data.eval_path={held_out}",
         "train.per_device_batch_size=8", "train.max_steps=20", "train.learning_rate=1e-3",
         "train.lr_scheduler=constant", "train.log_every_steps=10"],
        tmp_path / "run",
    ).check()  # fmt: skip
    before, after = run.eval("before"), run.eval("after")
    # A fresh score head gives near-zero rewards: the pairwise loss starts at chance (ln 2). The
    # accuracy before is no measure of chance here: every pair differs by the same words, so a
    # random model ranks them all alike (0 or 1).
    assert before["eval/loss"] == pytest.approx(LN2, abs=0.1), before
    assert after["eval/accuracy"] >= 0.8, after
    assert after["eval/loss"] < before["eval/loss"] - 0.2, (before, after)
