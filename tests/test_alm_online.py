"""Online RL on audio prompts (Qwen2-Audio: `layouts.MEDIA_IN_PLACE`), in process on
`tiny-random-qwen2-audio` and the built-in `tones-qa-prompts` (FLAC bytes), seconds: the
shared-prompt rows (the prompt with its clip once, its completions after it) give the plain
rows' per-token log-probs, and each audio prompt prefilled once and its cache copied
(`decode.sample_completions(media=...)`) samples the very tokens `generate` samples with the
same seeds."""

from __future__ import annotations

import pytest
import torch

from align_anything.data.builtin import builtin_path
from align_anything.families.language import IGNORE_INDEX
from align_anything.families.language.collate import pad_rows
from align_anything.families.language.forward import (
    sequence_token_logps,
    supports_logits_to_keep,
)
from align_anything.families.language.layouts import (
    PrefixGroup,
    collate_shared_prefix,
    media_in_place,
    supports_shared_media_prompt,
)
from align_anything.families.language.loading import load_model, load_processor
from align_anything.families.language.multimodal import MediaSupport
from align_anything.families.language.prompts import encode_prompt
from align_anything.families.text_to_image import shapes
from align_anything.families.zoo import resolve_model_path
from align_anything.generation.decode import row_sampler, sample_completions
from align_anything.generation.rollout import GumbelSampler, completion_seed

pytestmark = pytest.mark.usefixtures("in_process_offline")

TINY = "tiny-random-qwen2-audio"


@pytest.fixture(scope="module")
def tiny() -> dict:
    """The tiny Qwen2-Audio, its media support and three encoded audio prompts of
    `tones-qa-prompts` (clips as embedded FLAC bytes)."""
    path = resolve_model_path(TINY)
    processor = load_processor(path)
    media = MediaSupport(processor, ("audio",), context=1024)
    rows = shapes.read_parquet(builtin_path("tones-qa-prompts"))[:3]
    prompts = []
    for row in rows:
        record = media.prepare_record({**row, "prompt": [{"role": "user",
                                                          "content": row["prompt"]}]}, None)  # fmt: skip
        prompts.append(encode_prompt(record, processor.tokenizer, max_prompt_length=512))
    model = load_model(path, dtype=torch.float32, reward=False).eval()
    return {"model": model, "media": media, "prompts": prompts, "tokenizer": processor.tokenizer}


def test_qwen2_audio_takes_the_shared_prompt_layouts(tiny) -> None:
    config = tiny["model"].config
    assert media_in_place(config) and supports_shared_media_prompt(config)


def test_shared_prompt_rows_with_audio_give_the_plain_log_probs(tiny) -> None:
    """Three prompts x completions of different lengths (EOS or not): the group's row
    `prompt(+clip) + c1 + c2 + c3` against one padded row per completion. (Qwen2-Audio's
    forward takes no `logits_to_keep`, so its logits are always every position's.)"""
    tokenizer, media = tiny["tokenizer"], tiny["media"]
    assert not supports_logits_to_keep(tiny["model"])
    completion_only = False
    eos = tokenizer.eos_token_id
    rows = [{**p, "row": i, "completion_ids": c} for i, p in enumerate(tiny["prompts"])
            for c in ([5, 6, eos], [7, eos], [9, 10, 11, 12])]  # fmt: skip
    sequences = [[*r["prompt_ids"], *r["completion_ids"]] for r in rows]
    labels = [[IGNORE_INDEX] * len(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    plain = media.attach(pad_rows(sequences, labels, tokenizer.pad_token_id), rows, copies=1)
    groups = [
        PrefixGroup(list(p["prompt_ids"]), [r["completion_ids"] for r in rows[3 * i : 3 * i + 3]],
                    [list(r["completion_ids"]) for r in rows[3 * i : 3 * i + 3]],
                    [3 * i, 3 * i + 1, 3 * i + 2])
        for i, p in enumerate(tiny["prompts"])
    ]  # fmt: skip
    shared = collate_shared_prefix(
        groups, num_sequences=len(rows), pad_id=tokenizer.pad_token_id, additive_mask_dtype=None
    )
    shared.media = media.features(tiny["prompts"])
    assert shared.input_ids.numel() < plain.input_ids.numel() / 2  # the prompts once
    with torch.no_grad():
        expected = sequence_token_logps(tiny["model"], plain, width=4,
                                        completion_only=completion_only)  # fmt: skip
        got = sequence_token_logps(tiny["model"], shared, width=4, completion_only=completion_only)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    assert (expected[:, 0] != 0).all()


def test_audio_prompts_prefilled_once_sample_what_generate_samples(tiny) -> None:
    """n = 3 sampled completions of each prompt with per-completion seeds: the decode loop
    (prefill with the clips once, the cache copied) against `generate` on each completion."""
    from transformers import GenerationConfig, LogitsProcessorList

    model, media, tokenizer = tiny["model"], tiny["media"], tiny["tokenizer"]
    prompts, n, seeds = tiny["prompts"], 3, [11, 22, 33]
    stop = [tokenizer.eos_token_id]
    generators = [torch.Generator().manual_seed(completion_seed(seeds[i], j))
                  for i in range(len(prompts)) for j in range(n)]  # fmt: skip
    ours = sample_completions(
        model, [p["prompt_ids"] for p in prompts], n,
        sample=row_sampler(generators, temperature=1.0, top_p=1.0), max_new_tokens=5, stop=stop,
        pad_id=tokenizer.pad_token_id, device=torch.device("cpu"), media=media.features(prompts),
    )  # fmt: skip
    theirs = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            ids = torch.tensor([prompt["prompt_ids"]])
            sampler = GumbelSampler([completion_seed(seeds[i], j)], temperature=1.0, top_p=1.0)
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **media.features([prompt]),
                generation_config=GenerationConfig(max_new_tokens=5, do_sample=False,
                                                   pad_token_id=tokenizer.pad_token_id,
                                                   eos_token_id=stop),
                logits_processor=LogitsProcessorList([sampler]),
            )  # fmt: skip
            tokens = out[0, ids.shape[1] :].tolist()
            theirs.append(tokens[: tokens.index(stop[0]) + 1] if stop[0] in tokens else tokens)
    assert ours == theirs
    assert len({tuple(t) for t in ours}) > 1  # sampled, not one greedy answer repeated
