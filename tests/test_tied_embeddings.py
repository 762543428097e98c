"""A tied embedding/LM head accumulating its gradient in place gives the plain gradient, with
one vocab×hidden matrix allocated in the backward pass instead of three."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SFT_ARGS, RunResult, run_inline
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from align_anything.families.language import IGNORE_INDEX
from align_anything.families.language.batches import Rows
from align_anything.families.language.forward import completion_forward
from align_anything.families.language.tied_embeddings import accumulate_in_place, tied_weight
from align_anything.families.zoo import resolve_model_path


def _tiny() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny-random-llama"), dtype=torch.float32
    )


def _batch(pad_id: int, seed: int) -> Rows:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 1000, (3, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, 7:] = pad_id  # right padding
    attention_mask[1, 7:] = 0
    # The pad token attended inside a row: its embedding output has a gradient, but
    # `nn.Embedding(padding_idx=…)` gives the padding row none; the patch must keep that.
    input_ids[2, 2] = pad_id
    labels = input_ids.clone()
    labels[:, :4] = IGNORE_INDEX
    labels[1, 7:] = IGNORE_INDEX
    return Rows(input_ids, attention_mask, labels)


def _accumulated_grads(model: torch.nn.Module, batches: list[Rows]) -> dict[str, torch.Tensor]:
    """Gradients after one backward pass per batch, accumulated (gradient accumulation)."""
    model.zero_grad(set_to_none=True)
    for batch in batches:
        sums, _ = completion_forward(model, batch, completion_only=True)
        (sums * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_in_place_gradient_equals_autograds_sum() -> None:
    plain, patched = _tiny(), _tiny()
    pad_id = plain.config.pad_token_id
    assert plain.get_input_embeddings().padding_idx == pad_id  # the case the patch must keep
    assert accumulate_in_place(patched)
    batches = [_batch(pad_id, seed) for seed in (0, 1)]
    expected, got = _accumulated_grads(plain, batches), _accumulated_grads(patched, batches)
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        # Two accumulation orders of the same float sums: equal to float rounding.
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    # The same parameter object still holds both uses (state dict, optimizer) and no-grad
    # forward passes (evaluation, generation) give the very same logits.
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    with torch.no_grad():
        batch = batches[0]
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
        torch.testing.assert_close(patched(**inputs).logits, plain(**inputs).logits)


class _CountShaped(TorchDispatchMode):
    """Counts the tensors of one shape that ops create (outputs that are new allocations)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            is_new = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
            if is_new and t.shape == self.shape:
                self.count += 1
        return out


@pytest.mark.parametrize("in_place", [False, True])
def test_backward_allocates_one_weight_sized_gradient(in_place: bool) -> None:
    model = _tiny()
    if in_place:
        assert accumulate_in_place(model)
    batch = _batch(model.config.pad_token_id, 0)
    sums, _ = completion_forward(model, batch, completion_only=True)
    counter = _CountShaped(model.lm_head.weight.shape)
    with counter:
        sums.sum().backward()
    # Plain autograd: the head's gradient, the embedding's, and their sum; in place: the head's
    # gradient only, into which the embedding's rows are added.
    assert counter.count == (1 if in_place else 3)


def test_only_a_trainable_plain_tied_pair_is_patched() -> None:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    assert tied_weight(LlamaForCausalLM(config)) is None  # untied
    config.tie_word_embeddings = True
    tied = LlamaForCausalLM(config)
    assert tied_weight(tied) is tied.lm_head.weight
    tied.lm_head.weight.requires_grad_(False)  # e.g. LoRA: the matrix does not train
    assert tied_weight(tied) is None and not accumulate_in_place(tied)

    class ScaledEmbedding(torch.nn.Embedding):  # like Gemma's: forward scales the rows
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 4.0

    scaled = LlamaForCausalLM(config)
    scaled.model.embed_tokens = ScaledEmbedding(64, 16)
    scaled.lm_head.weight = scaled.model.embed_tokens.weight
    assert tied_weight(scaled) is None


@pytest.mark.slow
def test_training_run_equals_the_autograd_path(sft_single: RunResult, runs_dir: Path) -> None:
    """The default SFT run (ZeRO-0, fp32) uses it and says so; switched off, the losses are the
    same to float rounding; under ZeRO-2 (hooks on gradient accumulation) it stays off."""
    sft_single.check()
    assert "its gradient accumulates in place" in sft_single.output
    off = run_inline(
        [*SFT_ARGS, "deepspeed=z0", "train.per_device_batch_size=4",
         "speed.tied_grads_in_place=false"],
        runs_dir / "sft-1rank-tied-autograd",
    ).check()  # fmt: skip
    assert "accumulates in place" not in off.output
    losses = sft_single.losses()
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert losses == pytest.approx(off.losses(), rel=1e-6, abs=1e-7)
    z2 = run_inline(
        [*SFT_ARGS, "deepspeed=z2", "train.per_device_batch_size=4", "train.max_steps=1"],
        runs_dir / "sft-1rank-z2-tied",
    ).check()
    assert "accumulates in place" not in z2.output
