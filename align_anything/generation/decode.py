"""The built-in generator's decode loop: n sampled completions of each prompt, the prompt
computed once.

`transformers`' `generate` given n copies of a prompt runs the prompt n times (prefill is most
of a rollout's compute when prompts are long: the built-in arithmetic prompts are a worked
example of ~100 tokens for completions of at most 12), keeps every finished sequence in the
batch until the longest is done, and spends Python work per token in its logits processors and
stopping criteria. This loop:

1. prefills each distinct prompt once (left-padded, the LM head on the last position only);
2. copies its KV cache n times (`DynamicCache.batch_repeat_interleave`);
3. decodes one token per step for the sequences still running, sampling each with its own
   generator (`rollout.GumbelSampler`'s rule: temperature, top-p, Gumbel noise), and
4. drops a sequence from the cache as soon as it emits a stop token
   (`DynamicCache.batch_select_indices`), so finished sequences cost nothing.

Positions follow the left padding (position ids = the attention mask's running count), as
`generate` computes them, so each completion is the one `generate` samples from the same
weights and seed (tested: `tests/test_grpo.py`). Image prompts of a model whose images enter as
features at their placeholder tokens, on ordinary positions (LLaVA: `layouts.media_in_place`),
take the same loop with their media inputs at the prefill (`media`); other image-text models go
through `generate` (their media enter at prefill in model-specific ways, M-RoPE positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


@torch.no_grad()
def sample_completions(
    module: torch.nn.Module, prompts: Sequence[Sequence[int]], n: int, *,
    sample: torch.nn.Module | None, max_new_tokens: int, stop: Sequence[int], pad_id: int,
    device: torch.device, media: dict[str, Tensor] | None = None,
) -> list[list[int]]:  # fmt: skip
    """n completions of each prompt (prompt i's are rows i·n … i·n+n−1): the tokens each
    generated, up to and including its first stop token or `max_new_tokens` of them.
    `sample(rows, logits) -> tokens` picks the next token of the given rows (their indices
    into the n·P completions) from their logits; None picks the most likely (greedy).
    `media`: the prompts' media inputs (`pixel_values`, ... of every prompt's placeholders, in
    prompt order), given to the prefill only."""
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[b, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    cache = DynamicCache()  # filled in place by each forward
    kw = cache_keyword(module)
    media = {k: v.to(device) for k, v in (media or {}).items()}
    out = module(input_ids=ids, attention_mask=mask, position_ids=positions,
                 use_cache=True, logits_to_keep=1, **{kw: cache}, **media)  # fmt: skip
    logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
    if n > 1:
        cache.batch_repeat_interleave(n)
    mask = mask.repeat_interleave(n, dim=0)
    next_position = positions[:, -1].repeat_interleave(n, dim=0) + 1
    active = torch.arange(len(prompts) * n, device=device)  # completion index of each cache row
    tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    stop_ids = torch.tensor(sorted(set(stop)) or [-1], device=device)
    for step in range(max_new_tokens):
        chosen = logits.argmax(-1) if sample is None else sample(active, logits)
        for row, token in zip(active.tolist(), chosen.tolist(), strict=True):
            tokens[row].append(token)
        running = ~torch.isin(chosen, stop_ids)
        if step == max_new_tokens - 1 or not bool(running.any()):
            break
        if not bool(running.all()):  # retire the finished sequences
            keep = running.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            active, chosen, mask = active[keep], chosen[keep], mask[keep]
            next_position = next_position[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = module(input_ids=chosen[:, None], attention_mask=mask,
                     position_ids=next_position[:, None], use_cache=True,
                     **{kw: cache})  # fmt: skip
        logits = out.logits[:, -1].float()
        next_position = next_position + 1
    return tokens


def cache_keyword(module: Any) -> str:
    """The forward's KV-cache argument: `cache` in newer transformers (which warns that
    `past_key_values` goes away), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def row_sampler(
    generators: Sequence[torch.Generator], *, temperature: float, top_p: float, top_k: int = 0
):
    """A `sample(rows, logits)` for `sample_completions`: row r draws from `generators[r]`
    with the Gumbel-max rule of `rollout.GumbelSampler` (the same noise in the same order as
    `generate` with that processor, so the same completions); top-k (0: none) before top-p."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    top = TopKLogitsWarper(top_k) if top_k > 0 else None
    warper = TopPLogitsWarper(top_p) if top_p < 1.0 else None

    def sample(rows: Tensor, logits: Tensor) -> Tensor:
        scores = logits / temperature
        if top is not None:
            scores = top(None, scores)
        if warper is not None:
            scores = warper(None, scores)
        vocab = scores.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=generators[r]) for r in rows.tolist()])
        uniform = uniform.clamp_(torch.finfo(torch.float32).tiny, 1.0 - 1e-7).to(scores.device)
        return (scores - torch.log(-torch.log(uniform))).argmax(-1)

    return sample
