"""The completion-only LM head (`train.completion_only_logits`) gives exactly the numbers of the
full-vocabulary path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from align_anything.families.language import IGNORE_INDEX
from align_anything.families.language.batches import Rows
from align_anything.families.language.forward import completion_forward, supports_logits_to_keep
from align_anything.families.zoo import resolve_model_path


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    path = resolve_model_path("tiny-random-llama")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _batch() -> Rows:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 1000, (3, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0  # right padding on row 1
    labels = input_ids.clone()
    labels[0, :5] = IGNORE_INDEX  # prompt of row 0
    labels[1, :3] = IGNORE_INDEX
    labels[1, 9:] = IGNORE_INDEX  # padding
    labels[2, :8] = IGNORE_INDEX
    return Rows(input_ids, attention_mask, labels)


def test_completion_only_equals_full_path(tiny_model: torch.nn.Module) -> None:
    assert supports_logits_to_keep(tiny_model)
    batch = _batch()
    results = {}
    for completion_only in (False, True):
        tiny_model.zero_grad()
        sums, counts = completion_forward(tiny_model, batch, completion_only=completion_only)
        sums.sum().backward()
        grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
        results[completion_only] = (sums.detach(), counts, grads)
    full, fast = results[False], results[True]
    # Counts: scored targets labels[:, 1:] != -100 → row 0: 11-4=7, row 1: 9-3=6, row 2: 4.
    assert fast[1].tolist() == full[1].tolist() == [7, 6, 4]
    torch.testing.assert_close(fast[0], full[0], rtol=1e-5, atol=1e-5)
    for name, grad in full[2].items():
        torch.testing.assert_close(fast[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
