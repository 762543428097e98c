"""Shared-prompt DPO rows give the numbers of the plain two-rows-per-pair path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from align_anything.families.language import collate_preference
from align_anything.families.language.batches import SharedPrefix
from align_anything.families.language.forward import completion_forward, shared_prefix_logps
from align_anything.families.language.layouts import collate_shared_prompt, supports_shared_prompt
from align_anything.families.zoo import resolve_model_path

# Three pairs of different prompt and answer lengths (ids from the tiny vocabulary), so that
# rows are padded differently in the two layouts.
ROWS = [
    {"prompt_ids": [5, 6, 7, 8, 9], "chosen_ids": [10, 11, 12], "rejected_ids": [13, 14]},
    {"prompt_ids": [20, 21], "chosen_ids": [22], "rejected_ids": [23, 24, 25, 26]},
    {"prompt_ids": [30, 31, 32], "chosen_ids": [33, 34], "rejected_ids": [33, 35]},
]
# A fourth pair short enough to share a row with the second when rows are packed.
PACKABLE = [*ROWS, {"prompt_ids": [40], "chosen_ids": [41], "rejected_ids": [42]}]


def _model(attn: str) -> torch.nn.Module:
    path = resolve_model_path("tiny-random-llama")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)


def _assert_layout_equals_plain_rows(model: torch.nn.Module, rows: list[dict], batch) -> list[int]:
    """`batch` (a shared-prefix or packed SFT layout of `rows`) gives the per-row log-prob sums
    and every gradient of the plain padded rows; returns the per-row counts (equal on both)."""
    from align_anything.families.language import collate_sft

    results = []
    for layout in (None, batch):
        model.zero_grad()
        if layout is not None:
            sums, counts = shared_prefix_logps(model, layout, completion_only=True)
        else:
            sums, counts = completion_forward(
                model, collate_sft(rows, pad_id=0), completion_only=True
            )
        (sums * torch.arange(1.0, len(rows) + 1)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((sums.detach(), counts, grads))
    (plain_sums, plain_counts, plain_grads), (sums, counts, grads) = results
    assert counts.tolist() == plain_counts.tolist()
    torch.testing.assert_close(sums, plain_sums, rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
    return counts.tolist()


def _run(model: torch.nn.Module, shared: bool, completion_only: bool):
    model.zero_grad()
    if shared:
        eager = model.config._attn_implementation == "eager"
        batch = collate_shared_prompt(
            ROWS, pad_id=0, additive_mask_dtype=torch.float32 if eager else None
        )
        sums, counts = shared_prefix_logps(model, batch, completion_only=completion_only)
    else:
        batch = collate_preference(ROWS, pad_id=0)
        sums, counts = completion_forward(model, batch, completion_only=completion_only)
    # A loss that weighs chosen and rejected differently, so a swapped layout would show.
    (sums * torch.linspace(1.0, 2.0, sums.shape[0])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sums.detach(), counts, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("completion_only", [True, False])
def test_shared_prompt_equals_plain_pairs(attn: str, completion_only: bool) -> None:
    model = _model(attn)
    assert supports_shared_prompt(model.config)
    plain = _run(model, shared=False, completion_only=completion_only)
    shared = _run(model, shared=True, completion_only=completion_only)
    # Counts per sequence: chosen 3, 1, 2, then rejected 2, 4, 2.
    assert plain[1].tolist() == shared[1].tolist() == [3, 1, 2, 2, 4, 2]
    torch.testing.assert_close(shared[0], plain[0], rtol=1e-5, atol=1e-5)
    assert plain[2].keys() == shared[2].keys()
    # Gradients are sums over many tokens in another order: compare relative to their scale.
    for name, grad in plain[2].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(shared[2][name], grad, rtol=0, atol=1e-5 * scale, msg=name)


def test_shared_prompt_layout() -> None:
    batch = collate_shared_prompt(ROWS[:2], pad_id=0, additive_mask_dtype=None)
    # Row 1: prompt [20, 21] at positions 0-1, chosen [22] at 2, rejected [23..26] at 2-5.
    assert batch["input_ids"][1].tolist() == [20, 21, 22, 23, 24, 25, 26, 0, 0, 0]
    assert batch["position_ids"][1, :7].tolist() == [0, 1, 2, 2, 3, 4, 5]
    mask = batch["shared_prefix_mask"][1, 0]
    assert mask[3, :3].tolist() == [True, True, False]  # rejected sees the prompt, not chosen
    assert mask[2, :3].tolist() == [True, True, True]  # chosen sees the prompt and itself
    assert mask[8].tolist() == [False] * 8 + [True, False]  # padding sees only itself
    # Both answers' first tokens are predicted from the last prompt position (index 1).
    width = batch["input_ids"].shape[1]
    row1 = [(p - width, t) for p, t, s in zip(*(batch[k].tolist() for k in (
        "score_positions", "score_targets", "score_sequences")), strict=True) if s in (1, 3)]  # fmt: skip
    assert row1 == [(1, 22), (1, 23), (3, 24), (4, 25), (5, 26)]


def test_shared_sft_prefix_equals_plain_rows() -> None:
    """An SFT micro-batch as one row (common unscored prefix once) gives the plain path's
    per-row sums, counts and gradients."""
    from align_anything.families.language import IGNORE_INDEX
    from align_anything.families.language.layouts import collate_shared_sft, common_unscored_prefix

    ignore = IGNORE_INDEX
    rows = [  # common prefix [5, 6, 7]; scored tokens start after it
        {"input_ids": [5, 6, 7, 8, 40, 41], "labels": [ignore] * 4 + [40, 41]},
        {"input_ids": [5, 6, 7, 9, 50], "labels": [ignore] * 4 + [50]},
        {"input_ids": [5, 6, 7, 8, 60, 61, 62], "labels": [ignore] * 4 + [60, 61, 62]},
    ]
    ids, labels = [r["input_ids"] for r in rows], [r["labels"] for r in rows]
    assert common_unscored_prefix(ids, labels) == 3
    # A scored target inside the common prefix ends the prefix before it.
    assert common_unscored_prefix(ids, [[ignore, ignore, 7, *lab[3:]] for lab in labels]) == 2
    model = _model("sdpa")
    batch = collate_shared_sft(rows, pad_id=0, additive_mask_dtype=None)
    assert batch["input_ids"].shape == (1, 3 + 3 + 2 + 4)
    assert _assert_layout_equals_plain_rows(model, rows, batch) == [2, 1, 3]
    # Nothing to share: a single row, or rows without a common prefix of two tokens.
    assert collate_shared_sft(rows[:1], pad_id=0, additive_mask_dtype=None) is None
    other = {"input_ids": [1, 6, 7, 8], "labels": [ignore, ignore, ignore, 8]}
    assert collate_shared_sft([rows[0], other], pad_id=0, additive_mask_dtype=None) is None
    # A prefix of 3 in rows of 20 saves 3 of 40 tokens: below MIN_SAVED_SHARE, not worth it.
    long_rows = [{"input_ids": [5, 6, 7, *range(10 + k, 27 + k)],
                  "labels": [ignore] * 3 + list(range(10 + k, 27 + k))} for k in (0, 100)]  # fmt: skip
    assert collate_shared_sft(long_rows, pad_id=0, additive_mask_dtype=None) is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_rm_equals_plain_pairs(attn: str) -> None:
    """A reward model's pairs as shared-prompt rows give the plain path's scores, loss and
    gradients (the score read at each answer's last token, not at each row's)."""
    from align_anything.families.language.loading import load_model
    from align_anything.tasks.rm import RM

    path = resolve_model_path("tiny-random-llama")
    torch.manual_seed(0)
    scorer = load_model(path, reward=True, dtype=torch.float32, attn_implementation=attn)
    scorer.config.pad_token_id = 0
    results = []
    for shared in (False, True):
        task = RM(policy=scorer, pad_id=0, center_coef=0.1, media=None, share_prompt=shared,
                  mask_dtype=torch.float32 if attn == "eager" else None)  # fmt: skip
        batch = task.collate(PACKABLE)
        assert isinstance(batch.sequences, SharedPrefix) == shared
        assert task.count_items(batch) == 4
        scorer.zero_grad()
        out = task.loss(batch, normalizer=1.0, training=True)
        out.losses["policy"].backward()
        grads = {n: p.grad.clone() for n, p in scorer.named_parameters() if p.grad is not None}
        results.append((out.metrics, grads))
    (plain, plain_grads), (shared_metrics, shared_grads) = results
    # The prompts once, and the two shortest pairs in one row: 3 rows instead of 8.
    shared_batch = task.collate(PACKABLE).sequences
    assert shared_batch.input_ids.shape[0] == 3 and shared_batch.tokens == 27
    for key in ("loss", "margin", "reward_sum", "reward_sq_sum"):
        torch.testing.assert_close(shared_metrics[key], plain[key], rtol=1e-5, atol=1e-6)
    assert float(shared_metrics["accuracy"]) == float(plain["accuracy"])
    assert plain_grads.keys() == shared_grads.keys() and "score.weight" in plain_grads
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(shared_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)


def test_packed_shared_prompt_rows() -> None:
    """With `pack`, short pairs share a row (never wider than the longest pair), and each
    sequence's end and scored tokens are where its own ids are."""
    plain = collate_shared_prompt(PACKABLE, pad_id=0, additive_mask_dtype=None)
    packed = collate_shared_prompt(PACKABLE, pad_id=0, additive_mask_dtype=None, pack=True)
    assert plain.input_ids.shape == (4, 10)
    assert packed.input_ids.shape == (3, 10)  # pair lengths 10, 7, 7, 3: [10], [7, 3], [7]
    assert packed.tokens == plain.tokens == 27
    for batch in (plain, packed):
        flat = batch.input_ids.reshape(-1).tolist()
        # Each sequence's last id: the chosen answers, then the rejected ones.
        assert [flat[e] for e in batch.sequence_ends.tolist()] == [12, 22, 34, 41, 14, 26, 35, 42]
    pairs = [(s, t) for s, t in zip(packed.score_sequences.tolist(), packed.score_targets.tolist(),
                                    strict=True)]  # fmt: skip
    assert sorted(pairs) == sorted(zip(plain.score_sequences.tolist(),
                                       plain.score_targets.tolist(), strict=True))  # fmt: skip
    # The row holding pairs 1 and 3: pair 3 starts at 7 with positions from 0 and sees only
    # its own prompt, never pair 1's tokens.
    row = next(r for r in range(3) if packed.input_ids[r, 7].item() == 40)
    assert packed.input_ids[row].tolist() == [20, 21, 22, 23, 24, 25, 26, 40, 41, 42]
    assert packed.position_ids[row].tolist() == [0, 1, 2, 2, 3, 4, 5, 0, 1, 1]
    mask = packed.shared_prefix_mask[row, 0]
    assert mask[8].tolist() == [False] * 7 + [True, True, False]  # chosen: prompt + itself
    assert mask[9].tolist() == [False] * 7 + [True, False, True]  # rejected: prompt + itself
    # Pair 3's answers are both predicted from its prompt's last position (row index 7).
    width = packed.input_ids.shape[1]
    third = [(p - row * width, t) for p, t, s in zip(packed.score_positions.tolist(),
             packed.score_targets.tolist(), packed.score_sequences.tolist(), strict=True)
             if s in (3, 7)]  # fmt: skip
    assert third == [(7, 41), (7, 42)]


def test_packed_sft_rows_equal_plain_rows() -> None:
    """Rows with nothing to share, placed best-fit into fewer rows no wider than the longest,
    give the plain path's per-row sums, counts and gradients; SFT's collate takes this layout
    when the common prefix does not pay."""
    from align_anything.families.language import IGNORE_INDEX
    from align_anything.families.language.layouts import collate_packed_sft
    from align_anything.tasks.sft import SFT

    ignore = IGNORE_INDEX
    rows = [  # 6, 3 and 2 tokens: the last two share a row of width 6
        {"input_ids": [5, 6, 7, 8, 40, 41], "labels": [ignore] * 4 + [40, 41]},
        {"input_ids": [9, 10, 50], "labels": [ignore, ignore, 50]},
        {"input_ids": [11, 60], "labels": [ignore, 60]},
    ]
    model = _model("sdpa")
    batch = collate_packed_sft(rows, pad_id=0, additive_mask_dtype=None)
    assert batch["input_ids"].shape == (2, 6) and batch.tokens == 11
    assert _assert_layout_equals_plain_rows(model, rows, batch) == [2, 1, 1]
    # Rows that cannot share a row: the plain layout.
    assert collate_packed_sft(rows[:2], pad_id=0, additive_mask_dtype=None) is None
    task = SFT(policy=model, pad_id=0, media=None, completion_only=True, share_prefix=True,
               flatten_packed=False, mask_dtype=None)  # fmt: skip
    assert isinstance(task.collate(rows), SharedPrefix)
    assert task.count_items(task.collate(rows)) == 4
    assert not isinstance(task.collate(rows[:2]), SharedPrefix)


def test_packed_shared_prompt_logps_equal_plain_pairs() -> None:
    model = _model("sdpa")
    results = []
    for pack in (False, True):
        model.zero_grad()
        if pack:
            batch = collate_shared_prompt(PACKABLE, pad_id=0, additive_mask_dtype=None, pack=True)
            sums, counts = shared_prefix_logps(model, batch, completion_only=True)
        else:
            batch = collate_preference(PACKABLE, pad_id=0)
            sums, counts = completion_forward(model, batch, completion_only=True)
        (sums * torch.linspace(1.0, 2.0, sums.shape[0])).sum().backward()
        results.append(
            (sums.detach(), counts, {n: p.grad.clone() for n, p in model.named_parameters()})
        )
    (plain_sums, plain_counts, plain_grads), (sums, counts, grads) = results
    assert counts.tolist() == plain_counts.tolist() == [3, 1, 2, 1, 2, 4, 2, 1]
    torch.testing.assert_close(sums, plain_sums, rtol=1e-5, atol=1e-5)
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
