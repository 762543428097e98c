"""Preference pairs with the prompt computed once: one row `prompt + chosen + rejected` per pair.

The plain path runs `prompt + chosen` and `prompt + rejected` as two rows, so the prompt goes
through the model twice; in chat data it is most of each row (SmolLM2's template adds a system
prompt of ~30 tokens). Here each pair is one row with an attention mask that lets the rejected
tokens see the prompt but not the chosen tokens, and position ids that restart the rejected
completion where the prompt ends. Every token then sees exactly the keys and positions it sees
in its own row on the plain path, so the log-probs are the same numbers (up to float summation
order), from about (P + C + R) instead of 2P + C + R tokens of compute.

transformers passes a 4D mask through unchanged (`masking_utils`), to SDPA as a boolean mask and
to eager attention as an additive float mask; other kernels (FlashAttention, flex) take no dense
mask, so trainers use this path only with `sdpa` or `eager` (`supports_shared_prompt`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from align_anything.losses import selected_token_logps

# Attention implementations that accept a dense 4D mask as given.
DENSE_MASK_ATTENTION = ("sdpa", "eager")


def supports_shared_prompt(config: Any) -> bool:
    """Whether a model (by its config) can run shared-prompt rows: a text-only model whose
    attention takes a dense 4D mask."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text_config is config and getattr(config, "_attn_implementation", None) in (
        DENSE_MASK_ATTENTION
    )


def collate_shared_prompt(
    rows: Sequence[Mapping[str, Any]], *, pad_id: int, additive_mask_dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """Batch `encode_preference` rows into B rows `prompt + chosen + rejected` (right-padded).

    Returns `input_ids` and `attention_mask` ([B, L]; the 2D mask marks real tokens, for
    counting only), `position_ids` [B, L], `shared_prompt_mask` [B, 1, L, L] (boolean, True =
    may attend; additive 0 / dtype-min when `additive_mask_dtype` is given, for eager
    attention), and the scored tokens flattened: `score_positions` (b·L + the position whose
    logits predict the token), `score_targets` (the token) and `score_sequences` (which of the
    2B sequences it belongs to: pair i's chosen is i, its rejected B + i, the plain path's
    layout). The first completion token of both answers is predicted from the last prompt
    position, which is therefore scored twice.
    """
    if not rows:
        raise ValueError("cannot collate an empty batch")
    batch = len(rows)
    lengths = [len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows]
    width = max(lengths)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((batch, width), dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    # Segment per position: 0 prompt, 1 chosen, 2 rejected, 3 padding.
    segment = torch.full((batch, width), 3, dtype=torch.long)
    positions, targets, sequences = [], [], []
    for i, row in enumerate(rows):
        prompt, chosen, rejected = (
            list(row["prompt_ids"]),
            list(row["chosen_ids"]),
            list(row["rejected_ids"]),
        )
        p, c, r = len(prompt), len(chosen), len(rejected)
        input_ids[i, : p + c + r] = torch.tensor(prompt + chosen + rejected, dtype=torch.long)
        attention_mask[i, : p + c + r] = 1
        position_ids[i, : p + c] = torch.arange(p + c)
        position_ids[i, p + c : p + c + r] = torch.arange(p, p + r)
        segment[i, :p], segment[i, p : p + c], segment[i, p + c : p + c + r] = 0, 1, 2
        base = i * width
        # Token k of an answer is predicted by the position before it in its own sequence.
        for start, answer, seq in ((p, chosen, i), (p + c, rejected, batch + i)):
            for k, token in enumerate(answer):
                predictor = p - 1 if k == 0 else start + k - 1
                positions.append(base + predictor)
                targets.append(token)
                sequences.append(seq)
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # [L(query), L(key)]
    query_seg, key_seg = segment[:, :, None], segment[:, None, :]
    allowed = causal[None] & ~((query_seg == 2) & (key_seg == 1))
    # A padding query attends to itself only: a row with no allowed key would give NaN.
    eye = torch.eye(width, dtype=torch.bool)[None]
    allowed = torch.where(query_seg == 3, eye, allowed)[:, None]
    mask: Tensor = allowed
    if additive_mask_dtype is not None:
        mask = torch.zeros(allowed.shape, dtype=additive_mask_dtype)
        mask.masked_fill_(~allowed, torch.finfo(additive_mask_dtype).min)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "shared_prompt_mask": mask,
        "score_positions": torch.tensor(positions, dtype=torch.long),
        "score_targets": torch.tensor(targets, dtype=torch.long),
        "score_sequences": torch.tensor(sequences, dtype=torch.long),
    }


def shared_prompt_logps(
    model: Any, batch: Mapping[str, Tensor], *, completion_only: bool
) -> tuple[Tensor, Tensor]:
    """Summed completion log-probs and token counts of the 2B sequences ([2B], [2B]: chosen of
    every pair, then rejected), from a `collate_shared_prompt` batch.

    With `completion_only`, the LM head runs only at the predicting positions (transformers'
    `logits_to_keep` mask); otherwise on every position, and the needed rows are picked after.
    """
    input_ids = batch["input_ids"]
    positions = batch["score_positions"]
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": batch["shared_prompt_mask"],
        "position_ids": batch["position_ids"],
    }
    if completion_only:
        keep = torch.zeros(input_ids.numel(), dtype=torch.bool, device=input_ids.device)
        keep[positions] = True
        # Row of each kept position in the [kept, V] logits (row-major order of the mask).
        kept_row = keep.long().cumsum(0) - 1
        logits = model(**kwargs, logits_to_keep=keep.view_as(input_ids)).logits
        logits = logits.reshape(-1, logits.shape[-1])[kept_row[positions]]
    else:
        logits = model(**kwargs).logits
        logits = logits.reshape(-1, logits.shape[-1])[positions]
    token_logps = selected_token_logps(logits, batch["score_targets"])
    sequences = batch["score_sequences"]
    num_sequences = 2 * input_ids.shape[0]
    sums = torch.zeros(num_sequences, dtype=token_logps.dtype, device=token_logps.device)
    counts = torch.zeros(num_sequences, dtype=torch.long, device=token_logps.device)
    counts.index_add_(0, sequences, torch.ones_like(sequences))
    return sums.index_add(0, sequences, token_logps), counts
