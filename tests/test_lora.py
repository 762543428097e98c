"""LoRA under ZeRO-0/2/3/3-offload: adapters that train, save with their real numbers (not
ZeRO-3's empty partitions), reload with PEFT to the outputs seen in training, and merge.

The runs use the tiny random Llama. Adapters start as an exact no-op (PEFT's B = 0), so DPO's
first loss is ln 2 with the base model as reference.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    DPO_ARGS,
    REPO_ROOT,
    RM_ARGS,
    SFT_ARGS,
    TINY_MODEL,
    RunResult,
    launch,
    run_inline,
)
from safetensors.torch import load_file

from align_anything.data.formats import load_records
from align_anything.families.language import collate_preference
from align_anything.families.language.encode import encode_preference
from align_anything.families.language.forward import completion_forward
from align_anything.families.zoo import resolve_model_path

# End to end: the 2-rank runs are launched (conftest.launch), the 1-rank runs are in-process
# (conftest.run_inline).
pytestmark = pytest.mark.slow

# Adapters start at zero; a larger rate than full fine-tuning's moves them visibly in 3 steps.
LORA = [
    "model.lora.enabled=true",
    "model.lora.r=8",
    "train.learning_rate=1e-3",
    "train.max_steps=3",
]
EVAL_PAIRS = 8
DPO_LORA = [
    *DPO_ARGS,
    *LORA,
    "data.eval_path=arith-pref-eval",
    f"data.max_eval_samples={EVAL_PAIRS}",
]
# Step losses of SFT with LoRA (r=8, alpha 32, rate 1e-3) on the tiny model, recorded from a
# ZeRO-0 run on one process; ZeRO-3 with offloaded parameters and optimizer must reproduce them.
SFT_LORA_FROZEN_LOSSES = [10.804016, 10.742389, 10.722627]


@pytest.fixture(scope="module")
def dpo_lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    root = tmp_path_factory.mktemp("lora-dpo")
    return {
        "z0-1rank": run_inline(
            [*DPO_LORA, "deepspeed=z0", "train.per_device_batch_size=4"], root / "z0"
        ).check(),
        "z3-2ranks": launch(
            [*DPO_LORA, "deepspeed=z3", "train.per_device_batch_size=2"],
            root / "z3",
            launcher="deepspeed",
            nproc=2,
        ).check(),
    }


def _eval_pairs(run_dir: Path, tokenizer) -> dict[str, torch.Tensor]:
    """The run's held-out pairs, encoded and collated exactly as the trainer does."""
    run = json.loads((run_dir / "run_config.json").read_text())
    records, _ = load_records(run["data"]["eval_path"], format="auto", columns={})
    rows, _ = encode_preference(
        records[:EVAL_PAIRS], tokenizer,
        max_length=run["data"]["max_length"], truncation=run["data"]["truncation"],
    )  # fmt: skip
    return collate_preference(rows, pad_id=tokenizer.pad_token_id)


def _mean_chosen_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        logps, _ = completion_forward(model.eval(), batch, completion_only=False)
    return float(logps[: logps.shape[0] // 2].mean())


def test_dpo_lora_zero3_two_ranks_equals_zero0_one_rank(dpo_lora: dict[str, RunResult]) -> None:
    single, sharded = dpo_lora["z0-1rank"], dpo_lora["z3-2ranks"]
    assert sharded.zero_stage() == 3 and single.zero_stage() == 0
    # Policy = base model at step 1 (adapters are zero), so sigmoid DPO starts at ln 2.
    assert single.losses()[0] == pytest.approx(math.log(2), abs=1e-6)
    assert single.losses()[-1] < single.losses()[0] - 1e-3, single.losses()
    for a, b in zip(single.losses(), sharded.losses(), strict=True):
        assert b == pytest.approx(a, abs=1e-5)
    # The reference is the policy with adapters off: no second model is built.
    for run in dpo_lora.values():
        assert "adapters disabled" in run.summary_line("reference")
        assert "LoRA r=8" in run.summary_line("adapters")
        assert "q_proj" in run.summary_line("adapters")
        assert "lm_head" not in run.summary_line("adapters")


def test_zero3_adapter_has_trained_numbers_and_reloads_with_peft(
    dpo_lora: dict[str, RunResult], tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = dpo_lora["z3-2ranks"].output_dir / "final"
    weights = load_file(final / "adapter_model.safetensors")
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 8
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    lora_a = {k: v for k, v in weights.items() if "lora_A" in k}
    # 2 layers × 7 linear modules (q, k, v, o, gate, up, down), A and B each.
    assert len(lora_a) == len(lora_b) == 14
    for name, tensor in lora_b.items():
        assert tensor.shape[1] == 8 and tensor.numel() > 0, name  # [out, r], not a partition
        assert tensor.abs().max() > 0, f"{name} was not updated"
    for name, tensor in lora_a.items():
        assert tensor.shape[0] == 8, name

    tokenizer = AutoTokenizer.from_pretrained(final)
    batch = _eval_pairs(final, tokenizer)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TINY_MODEL), dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, final)
    trained = dpo_lora["z3-2ranks"].eval("after")["eval/logps/chosen"]
    assert _mean_chosen_logps(reloaded, batch) == pytest.approx(trained, abs=1e-4)
    # Adapters off give the base model, whose log-probs the run logged before training.
    with reloaded.disable_adapter():
        base_logps = _mean_chosen_logps(reloaded, batch)
    before = dpo_lora["z3-2ranks"].eval("before")["eval/logps/chosen"]
    assert base_logps == pytest.approx(before, abs=1e-4)
    assert abs(trained - before) > 1e-3

    # export merges the adapter into a plain model folder with the same outputs.
    from align_anything.tools.export import main as export_main

    assert export_main([str(final), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert _mean_chosen_logps(merged, batch) == pytest.approx(trained, abs=1e-4)


@pytest.fixture(scope="module")
def rm_lora(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """A LoRA reward model, 2 ranks under ZeRO-2: final/ (the adapter), final-merged/ and the
    checkpoint of step 3."""
    return launch(
        [*RM_ARGS, *LORA, "deepspeed=z2", "model.lora.save_merged=true",
         "checkpoint.every_steps=3", "train.per_device_batch_size=2"],
        tmp_path_factory.mktemp("lora-rm") / "rm", launcher="deepspeed", nproc=2,
    ).check()  # fmt: skip


def test_rm_lora_trains_the_score_head_fully(rm_lora: RunResult, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from align_anything.backend.universal import checkpoint_state_dict
    from align_anything.tools.export import main as export_main

    run = rm_lora
    assert run.zero_stage() == 2
    assert "trained fully: classifier, score" in run.summary_line("adapters")
    adapter = load_file(run.output_dir / "final" / "adapter_model.safetensors")
    (score_key,) = [k for k in adapter if "score" in k]
    state = checkpoint_state_dict(run.output_dir / "checkpoints" / "step-3")
    trained = state["base_model.model.score.modules_to_save.default.weight"]
    initial = state["base_model.model.score.original_module.weight"]
    torch.testing.assert_close(adapter[score_key], trained)
    assert (trained - initial).abs().max() > 1e-4, "the score head did not train"

    assert export_main([str(run.output_dir / "checkpoints" / "step-3"), "--out",
                        str(tmp_path / "exported")]) == 0  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(run.output_dir / "final-merged")
    texts = ["User: is 3 > 2?\nAssistant: yes", "User: hi\nAssistant: hello there"]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    scores = []
    for folder in ("final-merged", "exported"):
        path = run.output_dir / folder if folder == "final-merged" else tmp_path / folder
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        assert model.config.pad_token_id == tokenizer.pad_token_id
        with torch.no_grad():
            scores.append(model.eval()(**inputs).logits.squeeze(-1))
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-5)


def _score(model_dir: Path, rows: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    """`python -m align_anything score model_dir rows.jsonl --out scored.jsonl`, offline."""
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return subprocess.run(
        [sys.executable, "-m", "align_anything", "score", str(model_dir), str(source),
         "--out", str(tmp_path / "scored.jsonl")],
        cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip


def test_score_takes_the_adapter_folder_of_a_lora_reward_model(
    rm_lora: RunResult, tmp_path: Path
) -> None:
    """final/ of a LoRA rm run is an adapter; score applies it to the base model and scores as
    the merged folder does. Content given as text parts scores like the joined text."""
    from align_anything.rewards.scoring import score_rows

    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    rows = [{"prompt": "is 3 > 2?", "response": "yes"},
            {"prompt": "hi", "response": [{"role": "assistant", "content": parts}]}]  # fmt: skip
    result = _score(rm_lora.output_dir / "final", rows, tmp_path)
    assert result.returncode == 0, result.stderr
    scored = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in scored] == ["is 3 > 2?", "hi"]
    merged = score_rows(
        str(rm_lora.output_dir / "final-merged"),
        [rows[0], {"prompt": "hi", "response": "hello there"}],
    )
    assert [row["score"] for row in scored] == pytest.approx(merged, abs=1e-5)


def test_score_refuses_the_adapter_of_a_policy(dpo_lora: dict[str, RunResult], tmp_path: Path):
    result = _score(dpo_lora["z0-1rank"].output_dir / "final", [{"prompt": "p", "response": "r"}],
                    tmp_path)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "is a LoRA adapter of a task=dpo model, not a reward model" in result.stderr
    assert "python -m align_anything.train task=rm" in result.stderr
    assert not (tmp_path / "scored.jsonl").exists()


def test_sft_lora_zero3_offload_reproduces_frozen_losses(tmp_path: Path) -> None:
    run = run_inline([*SFT_ARGS, *LORA, "deepspeed=z3_offload"], tmp_path / "sft").check()
    assert run.zero_stage() == 3
    assert run.losses() == pytest.approx(SFT_LORA_FROZEN_LOSSES, abs=1e-5)
    trainable = run.summary_line("model")
    assert "K trainable" in trainable, trainable  # adapters only: thousands, not millions
