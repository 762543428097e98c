"""Forward passes and log-probabilities: the one place a batch meets the model.

- `sequence_logps(model, layout)`: summed log-probs of each sequence's scored tokens and their
  counts, for every layout of `data.batches` (the one dispatch on the layout's type):
  `completion_forward` for `Rows` and `Packed` (rows concatenated, position ids restarting at
  each), `shared_prefix_logps` for `SharedPrefix`; with `completion_only`, the LM head runs only
  where a scored token is predicted.
- `sequence_token_logps(model, layout, width)`: the same per token, left-aligned [B, C]
  (online RL's ratio, KL and loss are per token).
- `token_logps` / `selected_token_logps` / `completion_logps`: log p of target tokens from
  logits, chunked over the sequence so the fp32 softmax never exists for the whole batch.
- `sequence_scores`: a reward model's score per sequence; `shared_prefix_scores` the same for
  a shared-prompt batch (a pair's chosen and rejected after one prompt).
- `completion_token_logps` (with `…_and_entropy`), `completion_token_values`: online RL's
  per-token log-probs, entropy and critic values of the completion tokens, left-aligned [B, C];
  `sequence_token_logps_and_entropy` and `sequence_token_values` do the same for either layout
  of a prompt's completions (plain rows, or one shared-prompt row).

Label convention (shared with the data pipeline): `labels` has the shape of `input_ids`,
positions that are not scored (prompt, padding, media placeholders) hold `IGNORE_INDEX` (-100),
and the next-token shift happens here: `logits[:, t]` predicts `labels[:, t + 1]`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from align_anything.families.language import lora
from align_anything.families.language.batches import Layout, Packed, Rows, SharedPrefix
from align_anything.families.language.encode import IGNORE_INDEX
from align_anything.losses.ppo import token_entropy

# Sequence positions per chunk in `token_logps`. Peak extra memory is about
# batch × chunk_size × vocab × 4 bytes (one fp32 chunk, plus one temporary in backward).
DEFAULT_CHUNK_SIZE = 256


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 at least: bf16/fp16 logsumexp over a 100k+ vocabulary loses most of its digits.
    # fp64 stays fp64 so that gradcheck can test the hand-written backward.
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTokenLogps(torch.autograd.Function):
    """log p(label) per position, computed chunk by chunk over the sequence.

    Autograd through `logits.float().log_softmax(-1).gather(...)` would keep an fp32 copy of
    the whole [B, T, V] logits alive until backward. Here forward keeps only the per-position
    logsumexp ([B, T-1]), and backward recomputes softmax one chunk at a time, so the extra
    memory is one fp32 chunk in either direction.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, logits: Tensor, labels: Tensor, chunk_size: int, shift: bool
    ) -> Tensor:
        batch, seq_len, _ = logits.shape
        # shift=True: logits[:, t] predicts labels[:, t+1] (the last position predicts nothing);
        # shift=False: logits[:, t] predicts labels[:, t] (positions already selected).
        targets = labels[:, 1:] if shift else labels
        positions = seq_len - 1 if shift else seq_len
        scored = targets != IGNORE_INDEX
        # gather needs a valid index at ignored positions; their values are zeroed below.
        safe_targets = targets.masked_fill(~scored, 0)
        dtype = _compute_dtype(logits.dtype)
        logps = torch.empty((batch, positions), dtype=dtype, device=logits.device)
        lse = torch.empty_like(logps)
        for start in range(0, positions, chunk_size):
            end = min(start + chunk_size, positions)
            chunk = logits[:, start:end].to(dtype)
            chunk_lse = torch.logsumexp(chunk, dim=-1)
            target_logit = chunk.gather(-1, safe_targets[:, start:end, None]).squeeze(-1)
            logps[:, start:end] = target_logit - chunk_lse
            lse[:, start:end] = chunk_lse
        logps.masked_fill_(~scored, 0.0)
        ctx.save_for_backward(logits, safe_targets, scored, lse)
        ctx.chunk_size = chunk_size  # type: ignore[attr-defined]
        return logps

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logps: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        logits, safe_targets, scored, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk_size: int = ctx.chunk_size  # type: ignore[attr-defined]
        positions = lse.shape[1]
        dtype = lse.dtype
        # Ignored positions were set to a constant 0 in forward, so they pass no gradient.
        grad = grad_logps.to(dtype) * scored
        grad_logits = torch.empty_like(logits)
        # With the shift, the last position predicts nothing (there is no label after it).
        grad_logits[:, positions:].zero_()
        for start in range(0, positions, chunk_size):
            end = min(start + chunk_size, positions)
            chunk = logits[:, start:end].to(dtype)
            g = grad[:, start:end, None]
            # d(logit[y] - logsumexp(logit)) / d logit = onehot(y) - softmax(logit)
            chunk_grad = (chunk - lse[:, start:end, None]).exp_().mul_(-g)
            chunk_grad.scatter_add_(-1, safe_targets[:, start:end, None], g)
            grad_logits[:, start:end] = chunk_grad
        return grad_logits, None, None, None


def _check_logits_labels(logits: Tensor, labels: Tensor, chunk_size: int) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, seq, vocab], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"labels must have the shape of input_ids, {tuple(logits.shape[:2])} here "
            f"(logits {tuple(logits.shape)}), got {tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}")


def token_logps(logits: Tensor, labels: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Per-position log-probability of the next-token target.

    Args:
        logits: [B, T, V] model outputs, any float dtype.
        labels: [B, T] token ids aligned with `input_ids`; `IGNORE_INDEX` where not scored.
        chunk_size: sequence positions processed at once; bounds the fp32 working memory to
            about B × chunk_size × V × 4 bytes in forward and in backward.

    Returns:
        [B, T-1] tensor in fp32 (fp64 for fp64 logits): entry t is log p(labels[:, t+1] | ..t),
        0 at ignored positions.
    """
    _check_logits_labels(logits, labels, chunk_size)
    return _ChunkedTokenLogps.apply(logits, labels.long(), chunk_size, True)


def selected_token_logps(
    logits: Tensor, targets: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """Log-probability of `targets[i]` under `logits[i]` for logits already taken at the scored
    positions only ([N, V] and [N]); used when the model projects only those positions onto
    the vocabulary. Same numerics and memory bound as `token_logps`."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [N, V] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    return _ChunkedTokenLogps.apply(logits[None], targets.long()[None], chunk_size, False)[0]


def completion_logps(
    logits: Tensor, labels: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[Tensor, Tensor]:
    """Summed log-probability of each sequence's scored tokens, and how many there are.

    Args: as for `token_logps`.

    Returns:
        (logps [B] fp32: sum of log p over the scored target tokens,
         token_counts [B] int64: number of scored target tokens).
        Divide the first by the second for the length-normalised log-prob.
    """
    per_token = token_logps(logits, labels, chunk_size=chunk_size)
    token_counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=-1)
    return per_token.sum(dim=-1), token_counts


def supports_logits_to_keep(module: torch.nn.Module) -> bool:
    """Whether a causal LM's forward can project only selected positions onto the vocabulary
    (transformers' `logits_to_keep` with a boolean [B, T] mask). A PEFT model passes the
    argument through to its base model."""
    if lora.is_peft_model(module):
        module = module.get_base_model()
    # Boolean masks came with `slice_logits_to_keep` (transformers 5.2x); before it a mask
    # indexes the wrong dimension (e.g. in the vLLM environment, which pins transformers < 5.20).
    import transformers.modeling_utils

    masks = hasattr(transformers.modeling_utils, "slice_logits_to_keep")
    return masks and "logits_to_keep" in inspect.signature(module.forward).parameters


def sequence_logps(model: Any, layout: Layout, *, completion_only: bool) -> tuple[Tensor, Tensor]:
    """Summed log-probs of each sequence's scored tokens and their counts ([S], [S]), whatever
    the layout: S rows of `Rows` (real rows only) or `Packed`, or `SharedPrefix`'s
    `num_sequences` sequences."""
    if isinstance(layout, SharedPrefix):
        return shared_prefix_logps(model, layout, completion_only=completion_only)
    return completion_forward(model, layout, completion_only=completion_only)


def sequence_token_logps(
    model: Any, layout: Rows | SharedPrefix, *, width: int, completion_only: bool
) -> Tensor:
    """[S, width] per-token log-probs of each sequence's completion, left-aligned (entry
    (s, j): completion token j of sequence s; 0 past its end), from either layout of a
    sequence's completion after its prompt."""
    if isinstance(layout, SharedPrefix):
        flat = shared_prefix_token_logps(model, layout, completion_only=completion_only)
        return _shared_left_aligned(flat, layout, width)
    logps = completion_token_logps(model, layout, completion_only=completion_only)
    return _pad_width(logps, width)


def sequence_token_logps_and_entropy(
    model: Any, layout: Rows | SharedPrefix, *, width: int, completion_only: bool
) -> tuple[Tensor, Tensor]:
    """`sequence_token_logps` and, from the same logits, the entropy of the distribution each
    completion token was chosen from ([S, width] each, the entropy without gradient; for
    logging: online RL's rollout passes)."""
    if isinstance(layout, SharedPrefix):
        logits = _shared_prefix_scored_logits(model, layout, completion_only=completion_only)
        flat = selected_token_logps(logits, layout.score_targets)
        with torch.no_grad():
            entropy = token_entropy(logits)
        return (
            _shared_left_aligned(flat, layout, width),
            _shared_left_aligned(entropy, layout, width),
        )
    logps, entropy = completion_token_logps_and_entropy(
        model, layout, completion_only=completion_only
    )
    return _pad_width(logps, width), _pad_width(entropy, width)


def sequence_token_values(model: Any, layout: Rows | SharedPrefix, *, width: int) -> Tensor:
    """A critic's values of each sequence's completion tokens, [S, width] fp32 left-aligned as
    `sequence_token_logps` (entry (s, j): V of the state in which completion token j is
    chosen; 0 past its end), from either layout."""
    if isinstance(layout, SharedPrefix):
        return _shared_left_aligned(shared_prefix_token_values(model, layout), layout, width)
    return _pad_width(completion_token_values(model, layout), width)


def _pad_width(values: Tensor, width: int) -> Tensor:
    """[S, C] right-padded with zeros to [S, width]."""
    if values.shape[1] < width:
        values = torch.nn.functional.pad(values, (0, width - values.shape[1]))
    return values


def _shared_left_aligned(flat: Tensor, layout: SharedPrefix, width: int) -> Tensor:
    """[S, width] from values at a shared-prefix batch's scored positions (in `score_targets`
    order, each sequence's in turn): sequence s's values first, 0 past its end."""
    lengths = torch.bincount(layout.score_sequences, minlength=layout.num_sequences)
    lengths = lengths.to(flat.device)
    slots = torch.arange(width, device=flat.device)[None, :] < lengths[:, None]
    out = torch.zeros(lengths.shape[0], width, dtype=flat.dtype, device=flat.device)
    return out.masked_scatter(slots, flat)


def completion_forward(
    model: Any, batch: Rows | Packed, *, completion_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of each sequence's completion tokens and their counts ([B], [B]).

    With `completion_only`, the LM head runs only at positions whose next token is scored:
    prompt logits are never needed, and the vocabulary projection is a large share of a small
    model's FLOPs. The numbers equal the full path (same per-position maths).
    """
    labels = batch.labels
    if isinstance(batch, Packed):  # sft.packing: restarting positions, no 2D mask
        real = labels.shape[0]
        inputs = {"input_ids": batch.input_ids, "attention_mask": None,
                  "position_ids": batch.position_ids, "use_cache": False}  # fmt: skip
    else:
        # A multimodal batch may end with a dummy row (see MediaSupport.attach): cut it off.
        real = batch.num_real
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                  **batch.media}  # fmt: skip
    if not completion_only:
        logits = model(**inputs).logits
        sums, counts = completion_logps(logits, labels)
        return sums[:real], counts[:real]
    # Position t is kept when it predicts a scored token t+1.
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    logits = model(**inputs, logits_to_keep=keep).logits
    targets = labels[:, 1:][keep[:, :-1]]
    token_logps = selected_token_logps(logits, targets)
    rows = keep.nonzero()[:, 0]
    sums = torch.zeros(labels.shape[0], dtype=token_logps.dtype, device=token_logps.device)
    return sums.index_add(0, rows, token_logps)[:real], keep.sum(dim=1)[:real]


def shared_prefix_logps(
    model: Any, batch: SharedPrefix, *, completion_only: bool
) -> tuple[Tensor, Tensor]:
    """Summed log-probs of the scored tokens and their counts per sequence ([S], [S]; for DPO
    S = 2B: chosen of every pair, then rejected), from a `collate_shared_prefix` batch.

    With `completion_only`, the LM head runs only at the predicting positions (transformers'
    `logits_to_keep` mask); otherwise on every position, and the needed rows are picked after.
    """
    token_logps = shared_prefix_token_logps(model, batch, completion_only=completion_only)
    sequences = batch.score_sequences
    num_sequences = batch.num_sequences
    sums = torch.zeros(num_sequences, dtype=token_logps.dtype, device=token_logps.device)
    counts = torch.zeros(num_sequences, dtype=torch.long, device=token_logps.device)
    counts.index_add_(0, sequences, torch.ones_like(sequences))
    return sums.index_add(0, sequences, token_logps), counts


def shared_prefix_token_logps(model: Any, batch: SharedPrefix, *, completion_only: bool) -> Tensor:
    """The log-prob of every scored token of a `collate_shared_prefix` batch, flat, in the
    batch's `score_targets` order (`score_sequences` says whose each is)."""
    logits = _shared_prefix_scored_logits(model, batch, completion_only=completion_only)
    return selected_token_logps(logits, batch.score_targets)


def _shared_prefix_scored_logits(
    model: Any, batch: SharedPrefix, *, completion_only: bool
) -> Tensor:
    """[scored, V] the logits at a shared-prefix batch's scored positions, in `score_targets`
    order (with `completion_only` the LM head runs only there)."""
    input_ids = batch.input_ids
    positions = batch.score_positions
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": batch.shared_prefix_mask,
        "position_ids": batch.position_ids,
        **batch.media,
    }
    if completion_only:
        keep = torch.zeros(input_ids.numel(), dtype=torch.bool, device=input_ids.device)
        keep[positions] = True
        # Row of each kept position in the [kept, V] logits (row-major order of the mask).
        kept_row = keep.long().cumsum(0) - 1
        logits = model(**kwargs, logits_to_keep=keep.view_as(input_ids)).logits
        return logits.reshape(-1, logits.shape[-1])[kept_row[positions]]
    logits = model(**kwargs).logits
    return logits.reshape(-1, logits.shape[-1])[positions]


def sequence_scores(model: Any, batch: Rows) -> Tensor:
    """A reward model's score of each sequence ([B] fp32), read by the model at its last real
    token; a multimodal batch's dummy row (see `MediaSupport.attach`) is cut off."""
    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **batch.media)
    return output.logits.squeeze(-1).float()[: batch.num_real]


def shared_prefix_scores(model: Any, batch: SharedPrefix) -> Tensor:
    """A reward model's score of each sequence of a shared-prefix batch ([S] fp32), read at
    the sequence's last token (`batch.sequence_ends`).

    The model's own forward (through the engine, so ZeRO-3 gathers as usual) applies its
    one-output `score` head at every position and pools one position per row, which cannot
    serve two sequences in one row: the head's per-position output [G, L, 1] is taken from
    a forward hook instead, and the pooled output is left unused. The head is a
    hidden → 1 projection, so scoring every position costs next to nothing."""
    head = _score_head(model)
    per_position: list[Tensor] = []
    handle = head.register_forward_hook(lambda _m, _a, out: per_position.append(out))
    try:
        model(
            input_ids=batch.input_ids,
            attention_mask=batch.shared_prefix_mask,
            position_ids=batch.position_ids,
            use_cache=False,
        )
    finally:
        handle.remove()
    if len(per_position) != 1:
        raise RuntimeError(f"the score head ran {len(per_position)} times in one forward")
    return per_position[0].reshape(-1)[batch.sequence_ends].float()


def _score_head(model: Any) -> torch.nn.Module:
    """The `score` module a reward model's forward calls (an engine's wrapped model; a PEFT
    model's trained copy is called through the wrapper PEFT puts in its place)."""
    module = model.module if not isinstance(model, torch.nn.Module) else model
    if lora.is_peft_model(module):
        module = module.get_base_model()
    head = getattr(module, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"{type(module).__name__} has no `score` head")
    return head


def _plain_inputs(batch: Rows) -> dict[str, Any]:
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, **batch.media}


def _predicting(labels: Tensor) -> Tensor:
    """[B, T] bool: position t predicts a completion token (t + 1 is scored). Row-major, these
    are each row's completion tokens in order, which `_left_aligned` relies on."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return keep


def _left_aligned(flat: Tensor, keep: Tensor) -> Tensor:
    """[B, C] from the values at `keep`'s positions in row-major order: row b's values first,
    0 past its end; C is the longest row's count."""
    lengths = keep.sum(dim=1)
    width = int(lengths.max()) if lengths.numel() else 0
    slots = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    out = torch.zeros(keep.shape[0], width, dtype=flat.dtype, device=flat.device)
    return out.masked_scatter(slots, flat)


def _completion_pass(
    model: Any, batch: Rows, *, completion_only: bool, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """One forward of a plain online-RL batch: per-token completion log-probs [B, C] and, with
    `entropy`, the entropy at the same positions [B, C] (without gradient)."""
    labels = batch.labels
    real = batch.num_real
    inputs = _plain_inputs(batch)
    keep = _predicting(labels)
    targets = labels[:, 1:][keep[:, :-1]]
    if completion_only:
        logits = model(**inputs, logits_to_keep=keep).logits
        flat = selected_token_logps(logits, targets)
    else:
        logits = model(**inputs).logits
        if entropy:  # the entropy needs the completion positions' logits on their own
            logits = logits[:, :-1][keep[:, :-1]]
            flat = selected_token_logps(logits, targets)
        else:
            flat = token_logps(logits, labels)[keep[:, :-1]]
    if not entropy:
        return _left_aligned(flat, keep)[:real], None
    with torch.no_grad():
        entropies = token_entropy(logits)
    return _left_aligned(flat, keep)[:real], _left_aligned(entropies, keep)[:real]


def completion_token_logps(model: Any, batch: Rows, *, completion_only: bool) -> torch.Tensor:
    """Per-token log-probs of each sequence's completion, left-aligned: [B, C] where C is the
    longest completion of the batch and entry (b, j) is log p of completion token j of row b (0
    past its end). Online RL's ratio, KL and loss are per token. The batch is a plain one
    (`labels` = the completion ids after the prompt, IGNORE_INDEX elsewhere) whose completions
    are contiguous; a multimodal batch's dummy row (see `MediaSupport.attach`) is cut off."""
    return _completion_pass(model, batch, completion_only=completion_only, entropy=False)[0]


def completion_token_logps_and_entropy(
    model: Any, batch: Rows, *, completion_only: bool
) -> tuple[Tensor, Tensor]:
    """`completion_token_logps` and, from the same logits, the policy's entropy at each of
    those positions (`losses.token_entropy`, without gradient: for logging): ([B, C], [B, C]).
    Without `completion_only` the logits of the completion positions are copied out of the
    full [B, T, V] ones first (an extra [tokens, V] tensor)."""
    logps, entropies = _completion_pass(model, batch, completion_only=completion_only, entropy=True)
    assert entropies is not None
    return logps, entropies


def completion_token_values(model: Any, batch: Rows) -> Tensor:
    """A critic's values of each sequence's completion tokens, aligned with
    `completion_token_logps`: [B, C] fp32, entry (b, j) = V(prompt + completion tokens < j),
    the value of the state in which completion token j is chosen (read at the position that
    predicts it, as OpenRLHF's and TRL's critics read it), 0 past a row's end. `model` returns
    [B, T] values (`models.value.ValueModel`, or an engine around one); the batch is the plain
    one `completion_token_logps` takes."""
    labels = batch.labels
    real = batch.num_real
    keep = _predicting(labels)
    values = model(**_plain_inputs(batch))
    return _left_aligned(values[keep].float(), keep)[:real]


def shared_prefix_token_values(model: Any, batch: SharedPrefix) -> Tensor:
    """A critic's values at every scored position of a `collate_shared_prefix` batch, flat, in
    the batch's `score_targets` order (as `shared_prefix_token_logps`), fp32."""
    values = model(
        input_ids=batch.input_ids,
        attention_mask=batch.shared_prefix_mask,
        position_ids=batch.position_ids,
    )
    return values.reshape(-1)[batch.score_positions].float()
