"""The generation check of built-in data: greedy answers to held-out prompts, checked for the
dataset's preferred property (a program can tell whether an answer has it). The preference
tasks (DPO, KTO) run it before and after training, where the held-out data defines a check."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from align_anything.backend import distributed as comm
from align_anything.backend.engine import Engine
from align_anything.data.builtin import has_preferred_property, shapes_vqa_check
from align_anything.training.batching import shard_chunks
from align_anything.training.run import Run

# Built-in datasets whose preferred property a program can check on a generated answer.
PROPERTY_CHECKS: dict[str, Callable[[dict, str], bool]] = {
    "arith-pref": has_preferred_property,
    "arith-pref-eval": has_preferred_property,
    "arith-kto": has_preferred_property,
    "arith-prompts": has_preferred_property,
    "arith-prompts-eval": has_preferred_property,
    # Questions about pictures: the greedy answer is exactly the row's `answer`.
    "shapes-vqa-prompts": shapes_vqa_check,
    "shapes-vqa-prompts-eval": shapes_vqa_check,
    "shapes-vqa-pref": shapes_vqa_check,
    "shapes-vqa-pref-eval": shapes_vqa_check,
    # Questions about clips (`tones-qa`): the same comparison with the row's one-word `answer`.
    "tones-qa-prompts": shapes_vqa_check,
    "tones-qa-prompts-eval": shapes_vqa_check,
    "tones-qa-pref": shapes_vqa_check,
    "tones-qa-pref-eval": shapes_vqa_check,
}
# Prompts generated for at once.
CHUNK = 16


def property_check(data_path: Any) -> Callable[[dict, str], bool] | None:
    """The generation check of a built-in dataset, or None for other data (and mixtures)."""
    return PROPERTY_CHECKS.get(data_path) if isinstance(data_path, str) else None


def held_out_check(
    *, policy: Engine, tokenizer: Any, data_path: Any, records: Sequence[dict], samples: int,
    max_new_tokens: int, rank: int, world: int, media: Any = None,
) -> dict[str, float]:  # fmt: skip
    """`eval/generation_check`: the share of the first `samples` held-out `records` whose
    greedy answer has the held-out data's (`data_path`: `data.eval_path or data.path`)
    preferred property; nothing for data without a check, with `samples` 0 or without
    held-out rows. An image-text or audio-text model (`media`, the model side's
    `MediaSupport`) answers with each row's own pictures or sounds. Collective."""
    check = property_check(data_path)
    if not samples or check is None or not len(records):
        return {}
    passed = generation_check(
        policy, tokenizer, records[:samples], check, max_new_tokens=max_new_tokens, rank=rank,
        world=world, media=media,
    )  # fmt: skip
    return {"eval/generation_check": passed}


def held_out_checker(
    run: Run, *, samples: int, max_new_tokens: int
) -> Callable[[], dict[str, float]]:
    """`held_out_check` on the run's policy, tokenizer and held-out records (what DPO and KTO
    evaluate before and after training)."""
    cfg = run.cfg
    return lambda: held_out_check(
        policy=run.policy, tokenizer=run.model.tokenizer,
        data_path=cfg.data.eval_path or cfg.data.path, records=run.data.eval_records,
        samples=samples, max_new_tokens=max_new_tokens, rank=run.dist.rank,
        world=run.dist.world_size, media=run.model.media,
    )  # fmt: skip


@torch.no_grad()
def generation_check(
    policy: Engine, tokenizer: Any, records: Sequence[dict], check: Callable[[dict, str], bool],
    *, max_new_tokens: int, rank: int, world: int, media: Any = None,
) -> float:  # fmt: skip
    """Share of `records` whose greedy answer has the dataset's preferred property. With
    `media` (a model that takes pictures or sounds), the records' prompts carry their media
    placeholders and each is answered with its own media (`MediaSupport.features`, in row
    order); a chunk mixing rows with and without media is answered one row at a time."""
    module = policy.module
    module.eval()
    passed = 0
    for chunk in shard_chunks(len(records), chunk=CHUNK, rank=rank, world=world):
        real = chunk is not None
        chunk = chunk or [0]
        rows = [records[i] for i in chunk]
        if (
            media is not None
            and not media.has_all_media(rows)
            and any(media.has_all_media([row]) for row in rows)
        ):
            groups = [[row] for row in rows]  # mixed: each row with its own media or none
        else:
            groups = [rows]
        texts = [
            text
            for group in groups
            for text in _greedy(module, tokenizer, group, media, policy, max_new_tokens, world)
        ]
        if real:
            passed += sum(bool(check(row, text)) for row, text in zip(rows, texts, strict=True))
    policy.train()
    total = torch.tensor([float(passed)], dtype=torch.float64)
    comm.all_reduce_sum(total)
    return float(total[0]) / len(records)


def _greedy(module: Any, tokenizer: Any, rows: Sequence[dict], media: Any, policy: Engine,
            max_new_tokens: int, world: int) -> list[str]:  # fmt: skip
    """Greedy answers to `rows`' prompts (left-padded), with their media where they have it."""
    prompts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for row in rows
    ]
    tokenizer.padding_side = "left"
    try:
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = "right"
    inputs = dict(encoded)
    if media is not None and media.has_all_media(rows):
        inputs.update(media.features(rows))
    inputs = {k: v.to(policy.device) for k, v in inputs.items()}
    output = module.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=tokenizer.pad_token_id, synced_gpus=world > 1 and policy.zero_stage == 3,
    )  # fmt: skip
    return tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :],
                                  skip_special_tokens=True)  # fmt: skip
