"""Online RL on audio prompts (Qwen2-Audio: `layouts.MEDIA_IN_PLACE`), in process on
`tiny-random-qwen2-audio` and the built-in `tones-qa-prompts` (FLAC bytes), seconds: the
shared-prompt rows (the prompt with its clip once, its completions after it) give the plain
rows' per-token log-probs, and each audio prompt prefilled once and its cache copied
(`decode.sample_completions(media=...)`) samples the very tokens `generate` samples with the
same seeds. Through the entry point (slow): GRPO on `tones-qa-prompts` with the waveform-rule
reward `tones_audio`, the shared rows on and off: the same losses and rewards."""

from __future__ import annotations

import pytest
import torch
from conftest import launch

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


# ---------------------------------------------------------------------------- through the entry point

GRPO_ALM = [
    "task=grpo", f"model.name_or_path={TINY}", "train.precision=fp32", "train.seed=42",
    "deepspeed=z0",
    "data.path=tones-qa-prompts", "data.eval_path=tones-qa-prompts-eval",
    "data.max_train_samples=8", "train.max_steps=2", "train.per_device_batch_size=8",
    "train.learning_rate=1e-3", "grpo.num_generations=4", "grpo.max_completion_length=4",
    "grpo.eval_samples=4", "reward.functions=[align_anything.rewards:tones_audio]",
    "checkpoint.save_final=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("alm-grpo")
    return {
        share: launch(
            [*GRPO_ALM, f"speed.share_prefix={str(share).lower()}"], root / f"share-{share}"
        ).check()  # fmt: skip
        for share in (True, False)
    }


@pytest.mark.slow
def test_grpo_on_clips_shared_rows_change_nothing(grpo_runs) -> None:
    """GRPO on the built-in clips (FLAC bytes) rewarded by the waveform rule: the shared rows
    (the prompt and its clip once per group) give the plain rows' losses and rewards; the rule
    had an opinion on every completion (one clip each, a known question)."""
    shared, plain = grpo_runs[True], grpo_runs[False]
    assert "the prompt's media once" in shared.summary_line("rows")
    for a, b in zip(shared.train_steps(), plain.train_steps(), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["reward"] == b["reward"]
    for step in shared.train_steps():
        assert step["frac_reward_none"] == 0.0 and "rewards/tones_audio/mean" in step
    for phase in ("before", "after"):
        evaluation = shared.eval(phase)
        assert 0.0 <= evaluation["eval/generation_check"] <= 1.0
        assert "eval/rewards/tones_audio" in evaluation
