"""Tied input embedding and LM head: one gradient buffer instead of three.

SmolLM2, Qwen2.5-0.5B/1.5B, Llama-3.2-1B/3B and Gemma use one vocab×hidden matrix W both to
embed the input tokens and as the LM head. Autograd gives W one gradient that is the sum of both
uses: the head's contribution is ready first and waits in autograd's input buffer for the whole
backward pass, the embedding's backward then allocates a second full matrix, and the sum is a
third (measured on CPU: three vocab×hidden matrices live at once at the end of the backward
pass, 3 × 108 MiB for SmolLM2-135M in fp32, the run's peak memory).

`accumulate_in_place(model)` routes both contributions into `W.grad` itself: the head multiplies
by an alias of W (same storage, its own leaf) whose gradient is moved into `W.grad` as soon as it
is ready, and the embedding's backward adds its rows into `W.grad` with `index_add_`. The
gradient is the same sum, up to float rounding (the rows are added onto the head's gradient
rather than onto zeros); no other matrix the size of W is allocated (tested by counting). No
torch or transformers option does this, hence the code here.

It bypasses autograd's accumulation into W, so it is only correct where nothing else watches that
accumulation: DeepSpeed ZeRO stage 0 with an fp32 torch optimizer (ZeRO-1/2/3 and the bf16/fp16
optimizers hook the gradient accumulation of every parameter). The engine applies it only there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def tied_weight(model: nn.Module) -> nn.Parameter | None:
    """W when the model's LM head and input embedding share it, are the plain torch modules
    (a subclass such as Gemma's scaled embedding computes something else) and W trains."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    embedding, head = get_in(), get_out()
    if type(embedding) is not nn.Embedding or type(head) is not nn.Linear:
        return None
    if head.bias is not None or head.weight is not embedding.weight:
        return None
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return None
    weight = embedding.weight
    return weight if weight.requires_grad else None


def _add_into_grad(weight: nn.Parameter, grad: torch.Tensor) -> None:
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad.add_(grad)


class _EmbeddingIntoGrad(torch.autograd.Function):
    """Embedding lookup whose backward adds the row gradients straight into `weight.grad`."""

    @staticmethod
    def forward(
        ctx: Any, ids: torch.Tensor, weight: nn.Parameter, padding_idx: int | None
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight.detach(), padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        ids = ids.reshape(-1)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # F.embedding gives the padding row no gradient
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, rows.to(weight.grad.dtype))
        return None, None, None


def accumulate_in_place(model: nn.Module) -> bool:
    """Patch the model's tied embedding and head (see the module docstring). Returns whether the
    model has a tied, trainable W to patch. Forward passes without gradients are unchanged."""
    weight = tied_weight(model)
    if weight is None:
        return False
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()

    def embed(ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.embedding(ids, weight, embedding.padding_idx)
        return _EmbeddingIntoGrad.apply(ids, weight, embedding.padding_idx)

    def move_into_weight(alias: torch.Tensor) -> None:
        _add_into_grad(weight, alias.grad)
        alias.grad = None

    def project(hidden: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(hidden, weight)
        alias = weight.detach().requires_grad_()
        alias.register_post_accumulate_grad_hook(move_into_weight)
        return F.linear(hidden, alias)

    embedding.forward = embed
    head.forward = project
    return True
