"""SFT packing (`sft.packing`) and the attention kernels (`model.attn_implementation`).

- Best-fit decreasing against hand-worked assignments.
- Packed rows give the loss, the token count and the gradients of the same rows unpacked, on the
  tiny model, for every layout a kernel gets (one row per packed sequence; all rows flattened
  into one row, flash-attention's layout, run here on sdpa/eager since FlashAttention needs a
  CUDA GPU).
- No token attends across rows: changing row A's tokens leaves row B's logits as they were.
- The kernel checks: errors before any weights load, through the real entry point.
- A real `task=sft sft.packing=true` run against frozen losses (slow).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SFT_ARGS, launch, merged, run_inline
from transformers import AutoModelForCausalLM

from align_anything.errors import ConfigError
from align_anything.families.language import IGNORE_INDEX, collate_sft
from align_anything.families.language.forward import completion_forward
from align_anything.families.language.loading import check_attention, load_config
from align_anything.families.language.packing import (
    PackedRows,
    best_fit_decreasing,
    collate_packed,
    fill_share,
)
from align_anything.families.zoo import resolve_model_path
from align_anything.train import main

# ---------------------------------------------------------------------------- best-fit decreasing


def test_best_fit_decreasing_hand_checked() -> None:
    # Capacity 8, lengths by row: 5 3 7 2 4 1. Longest first: row 2 (7) opens bin 0 (1 left);
    # row 0 (5) fits nowhere: bin 1 (3 left); row 4 (4): bin 2 (4 left); row 1 (3): the tightest
    # bin it fits is bin 1 (3 left -> 0); row 3 (2): bin 2 (4 -> 2); row 5 (1): bin 0 (1 -> 0).
    bins = best_fit_decreasing([5, 3, 7, 2, 4, 1], 8)
    assert bins.as_lists() == [[2, 5], [0, 1], [4, 3]]
    assert bins.lengths.tolist() == [8, 8, 6]
    assert fill_share(bins, 8) == pytest.approx(22 / 24)


def test_best_fit_is_not_first_fit() -> None:
    # Capacity 10, lengths 7 4 4 1: bins {7} (3 left) and {4, 4} (2 left). The 1 goes to the
    # tighter second bin; first-fit decreasing would put it into the first.
    assert best_fit_decreasing([7, 4, 4, 1], 10).as_lists() == [[0], [1, 2, 3]]


def test_best_fit_ties() -> None:
    # Equal lengths keep index order; of two bins with equal room, the one that had it first.
    assert best_fit_decreasing([4, 4, 2, 2], 6).as_lists() == [[0, 2], [1, 3]]
    assert best_fit_decreasing([3, 3, 3, 3], 6).as_lists() == [[0, 1], [2, 3]]
    assert best_fit_decreasing([6, 6], 6).as_lists() == [[0], [1]]
    # Capacity 10, lengths 7 5 4 2 1: bins {7} (3 left), {5} (5 left); the 4 into bin 1 (5 -> 1),
    # the 2 into bin 0 (3 -> 1). Both have 1 left; bin 1 had it first, so the 1 goes there
    # (TRL's rule; the lower bin number would be bin 0).
    assert best_fit_decreasing([7, 5, 4, 2, 1], 10).as_lists() == [[0, 3], [1, 2, 4]]


def test_best_fit_covers_every_row_once_within_capacity() -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 513, (5000,), generator=generator).tolist()
    bins = best_fit_decreasing(lengths, 512)
    content = bins.as_lists()
    assert sorted(i for b in content for i in b) == list(range(5000))
    assert all(
        sum(lengths[i] for i in b) == n <= 512 for b, n in zip(content, bins.lengths, strict=True)
    )
    # BFD on uniform lengths fills well over 90%; the lower bound is sum / capacity bins.
    assert len(bins) <= 1.08 * sum(lengths) / 512
    assert best_fit_decreasing(lengths, 512).as_lists() == content  # deterministic


def test_best_fit_refuses_a_row_over_capacity() -> None:
    with pytest.raises(ValueError, match="row 1 has 9 tokens; packing needs 1 to 8"):
        best_fit_decreasing([3, 9], 8)


# ---------------------------------------------------------------------------- collate

# Rows of different lengths; prompt tokens unscored (-100), and one row scored from its first
# token (assistant_only_loss=false), whose first label packing must not score.
ROWS = [
    {"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, -100, -100, 8, 9, 10, 11]},
    {"input_ids": [20, 21, 22], "labels": [-100, 21, 22]},
    {"input_ids": [30, 31, 32, 33, 34], "labels": [30, 31, 32, 33, 34]},
    {"input_ids": [40, 41, 42, 43], "labels": [-100, -100, 42, 43]},
    {"input_ids": [50, 51], "labels": [-100, 51]},
]


def _packed(capacity: int = 10) -> list:
    view = PackedRows(ROWS, best_fit_decreasing([len(r["input_ids"]) for r in ROWS], capacity))
    return [view[b] for b in range(len(view))]


def test_collate_packed_layout() -> None:
    # Capacity 10: bins {row 0 (7), row 1 (3)}, {row 2 (5), row 3 (4)}, {row 4 (2)}.
    sequences = _packed()
    assert [[r["input_ids"][0] for r in s.rows] for s in sequences] == [[5, 20], [30, 40], [50]]
    batch = collate_packed(sequences, pad_id=0, flatten=False)
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 0, 1, 2],
        [0, 1, 2, 3, 4, 0, 1, 2, 3, 0],  # the padding restarts too
        [0, 1, 0, 1, 2, 3, 4, 5, 6, 7],
    ]
    assert batch["attention_mask"].sum(1).tolist() == [10, 9, 2]
    # Row 2's first token (30) is not a target: nothing in its own row predicts it.
    assert batch["labels"][1].tolist() == [-100, 31, 32, 33, 34, -100, -100, 42, 43, -100]
    flat = collate_packed(sequences, pad_id=0, flatten=True)
    assert flat["input_ids"].shape == (1, 21) and int(flat["attention_mask"].sum()) == 21
    assert flat["position_ids"][0].tolist()[10:] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1]


# ---------------------------------------------------------------------------- loss and gradients


def _model(attn: str) -> torch.nn.Module:
    path = resolve_model_path("tiny-random-llama")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)


def _loss_and_grads(model: torch.nn.Module, batch: dict, completion_only: bool):
    """The SFT trainer's loss on one micro-batch: summed NLL over the scored tokens divided by
    their count (the normalizer of a one-micro-batch step), and its gradients."""
    model.zero_grad()
    sums, _ = completion_forward(model, batch, completion_only=completion_only)
    items = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    loss = -sums.sum() / items
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), items, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("flatten", [False, True], ids=["rows", "flattened"])
@pytest.mark.parametrize("completion_only", [True, False])
def test_packed_loss_and_gradients_equal_unpacked(
    attn: str, flatten: bool, completion_only: bool
) -> None:
    model = _model(attn)
    plain_rows = [{**r, "labels": [IGNORE_INDEX, *r["labels"][1:]]} for r in ROWS]
    plain = _loss_and_grads(model, collate_sft(plain_rows, pad_id=0), completion_only)
    packed_batch = collate_packed(_packed(), pad_id=0, flatten=flatten)
    packed = _loss_and_grads(model, packed_batch, completion_only)
    # Scored targets: 4 + 2 + 4 + 2 + 1 (row 2's first label is never a target).
    assert plain[1] == packed[1] == 13
    torch.testing.assert_close(packed[0], plain[0], rtol=1e-5, atol=1e-6)
    assert packed[2].keys() == plain[2].keys()
    for name, grad in plain[2].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(packed[2][name], grad, rtol=0, atol=1e-5 * scale, msg=name)


def _row_logits(model: torch.nn.Module, rows: list[dict], flatten: bool = False) -> torch.Tensor:
    sequences = PackedRows(rows, best_fit_decreasing([len(r["input_ids"]) for r in rows], 64))
    assert len(sequences) == 1  # both rows in one packed sequence
    batch = collate_packed([sequences[0]], pad_id=0, flatten=flatten)
    with torch.no_grad():
        return model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_token_attends_across_rows(attn: str) -> None:
    model = _model(attn)
    a, b = ROWS[0], ROWS[2]  # packed as a (7 tokens) then b (5 tokens)
    changed_a = {**a, "input_ids": [99, 98, 97, 96, 95, 94, 93]}
    before, after = _row_logits(model, [a, b]), _row_logits(model, [changed_a, b])
    assert not torch.allclose(before[:7], after[:7])  # row a's own logits did change
    torch.testing.assert_close(after[7:], before[7:], rtol=0, atol=1e-6)
    with torch.no_grad():  # and row b's logits are those of b alone
        alone = model(input_ids=torch.tensor([b["input_ids"]])).logits[0]
    torch.testing.assert_close(before[7:], alone, rtol=0, atol=1e-5)


@pytest.mark.slow  # not a launch, but torch compiles FlexAttention's kernel on CPU (~20 s)
def test_flex_attention_packed_forward_sees_only_its_row() -> None:
    # FlexAttention has no backward on CPU (torch 2.13): forward only, so packing's mask (a
    # BlockMask from the restarting position ids) is checked here and training needs a GPU.
    model = _model("flex_attention")
    a, b = ROWS[0], ROWS[2]
    packed = _row_logits(model, [a, b])
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([r["input_ids"]])).logits[0] for r in (a, b)]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- kernel selection


def _tiny_config():
    return load_config(resolve_model_path("tiny-random-llama"))


def test_check_attention_choices() -> None:
    config = _tiny_config()
    common = dict(reward=False, device_type="cpu", precision="auto")
    assert check_attention("auto", config, **common) is None  # transformers' own pick
    assert check_attention("sdpa", config, **common) == "sdpa"
    assert check_attention("eager", config, **common) == "eager"
    assert check_attention("sdpa", config, **{**common, "reward": True}) == "sdpa"


def test_flash_attention_without_the_package_is_an_error() -> None:
    # flash-attn is not installed here (no CUDA build on a CPU machine): an error, not a
    # silent substitute, since the user named the kernel.
    with pytest.raises(ConfigError, match="needs the flash-attn package, which is not installed"):
        check_attention(
            "flash_attention_2", _tiny_config(), reward=False, device_type="cuda", precision="bf16"
        )


def test_flex_attention_cannot_train_on_cpu() -> None:
    with pytest.raises(ConfigError, match="no backward pass on CPU"):
        check_attention(
            "flex_attention", _tiny_config(), reward=False, device_type="cpu", precision="auto"
        )


def test_a_kernel_the_model_class_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "_supports_sdpa", False)
    with pytest.raises(ConfigError, match="LlamaForCausalLM does not implement sdpa"):
        check_attention("sdpa", _tiny_config(), reward=False, device_type="cpu", precision="auto")


@pytest.mark.usefixtures("in_process_offline")
@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model.attn_implementation=flash_attention_2"], "flash-attn package"),
        (["model.attn_implementation=flex_attention"], "no backward pass on CPU"),
        (["model.attn_implementation=flash"], "model.attn_implementation"),
        (["model.name_or_path=tiny-random-llava", "sft.packing=true"], "sft.packing packs text"),
    ],
    ids=["flash-missing", "flex-cpu", "unknown-kernel", "packing-multimodal"],
)
def test_bad_kernel_or_packing_is_reported_before_weights_load(
    overrides: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # The multimodal case names its own model in place of the tiny Llama.
    args = merged(["task=sft", "model.name_or_path=tiny-random-llama", *overrides])
    status = main([*args, f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert fragment in err, err
    assert (
        not (tmp_path / "metrics.jsonl").exists()
        or "loss" not in (tmp_path / "metrics.jsonl").read_text()
    )


# ---------------------------------------------------------------------------- the real entry point

# Frozen from the first run of this recipe (CPU fp32, seed 42): 4 steps of 4 packed sequences
# of <= 256 tokens of arith-sft on the tiny model (243 training rows in 49 packed sequences).
PACKED_FROZEN_LOSSES = [10.824138, 10.550331, 10.403185, 10.319325]
PACKED_SEQUENCES = 49
TRAIN_ROWS = 243


@pytest.mark.slow
def test_packed_sft_run_matches_frozen_losses(tmp_path: Path) -> None:
    run = run_inline(
        [*SFT_ARGS, "deepspeed=z0", "train.per_device_batch_size=4", "sft.packing=true"],
        tmp_path / "packed",
    ).check()
    assert (
        f"{TRAIN_ROWS} rows in {PACKED_SEQUENCES} packed sequences of <= 256 tokens" in run.output
    )
    assert "attention       sdpa (model.attn_implementation=auto)" in run.output
    assert run.losses() == pytest.approx(PACKED_FROZEN_LOSSES, rel=1e-4), run.losses()


@pytest.mark.slow
def test_packed_step_equals_unpacked_step_through_the_entry_point(tmp_path: Path) -> None:
    """One step over the whole training set, packed (49 sequences) and not (243 rows): the
    same tokens at the same weights, so the same loss, the same gradient norm, and after the
    update the same held-out loss."""
    args = [a for a in SFT_ARGS if not a.startswith("train.max_steps=")]
    args += ["train.max_steps=1", "deepspeed=z0"]
    packed = run_inline(
        [*args, f"train.per_device_batch_size={PACKED_SEQUENCES}", "sft.packing=true"],
        tmp_path / "packed",
    ).check()
    plain = run_inline(
        [*args, f"train.per_device_batch_size={TRAIN_ROWS}"], tmp_path / "plain"
    ).check()
    (p_step,), (u_step,) = packed.train_steps(), plain.train_steps()
    assert p_step["loss"] == pytest.approx(u_step["loss"], rel=1e-6)
    assert p_step["grad_norm"] == pytest.approx(u_step["grad_norm"], rel=1e-5)
    assert packed.eval("after")["eval/loss"] == pytest.approx(
        plain.eval("after")["eval/loss"], rel=1e-6
    )


@pytest.mark.slow
def test_packed_sft_on_two_ranks_matches_one_rank(tmp_path: Path) -> None:
    """2 ranks × 2 packed sequences under ZeRO-2 log the 1-rank × 4 losses: each rank's
    micro-batch holds other packed sequences, and the loss is normalised by the global count of
    scored tokens over both ranks."""
    run = launch(
        [*SFT_ARGS, "deepspeed=z2", "train.per_device_batch_size=2", "sft.packing=true"],
        tmp_path / "packed-2rank",
        launcher="deepspeed",
        nproc=2,
    ).check()
    assert run.losses() == pytest.approx(PACKED_FROZEN_LOSSES, abs=1e-5), run.losses()
