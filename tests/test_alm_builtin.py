"""The built-in audio-text model `qwen2audio-smollm2-tones` (issue #37): what ships is the
trained encoder and projector only, and the folder assembled from them with SmolLM2 on first use
loads with transformers' Auto classes alone and answers the held-out questions exactly as the
build measured them (`build.json`, written by scripts/build_builtin_alm.py)."""

from __future__ import annotations

import json

import pytest
import torch

from align_anything.families.language import alm_tones

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_process_offline")]

ROWS = 16  # one batch of the build's check, so the padding and the numbers are the same


def test_the_shipped_parts_are_the_encoder_and_projector_only() -> None:
    from safetensors import safe_open

    path = alm_tones.SHIPPED_DIR / alm_tones.PARTS_FILE
    assert path.stat().st_size < 3_000_000
    with safe_open(str(path), "pt") as parts:
        names = list(parts.keys())
    assert names and all(name.startswith(alm_tones.TRAINED_PREFIXES) for name in names)
    assert any(".audio_tower." in n for n in names)
    assert any(".multi_modal_projector." in n for n in names)


def test_the_assembled_model_loads_with_transformers_and_answers_as_built() -> None:
    from safetensors import safe_open
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    from align_anything.data.builtin import shapes_answer_matches
    from align_anything.data.formats import load_records
    from align_anything.data.media import load_audio
    from align_anything.families.zoo import resolve_model_path

    folder = resolve_model_path(alm_tones.NAME)
    model = AutoModelForMultimodalLM.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2AudioForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2AudioProcessor"
    # the language model is SmolLM2's own weights; its output layer a copy of its embedding
    # (Qwen2-Audio's class ties none: `alm_tones.build_model`)
    assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    smollm2 = resolve_model_path(alm_tones.LANGUAGE_MODEL)
    with safe_open(f"{smollm2}/model.safetensors", "pt") as weights:
        q_proj = weights.get_tensor("model.layers.0.self_attn.q_proj.weight")
        embed = weights.get_tensor("model.embed_tokens.weight")
    language = model.model.language_model
    assert torch.equal(language.layers[0].self_attn.q_proj.weight, q_proj)
    assert torch.equal(language.embed_tokens.weight[: embed.shape[0]], embed)
    built = json.loads((alm_tones.SHIPPED_DIR / "build.json").read_text())
    records, _ = load_records("tones-qa-prompts-eval")
    records = records[:ROWS]
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    # Content blocks, as TRL and transformers' pipelines pass them: the shipped template
    # renders them as the project renders its audio rows (`alm_tones.AUDIO_BLOCK`).
    prompts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "audio"},
                                          {"type": "text", "text": r["prompt"][0]["content"]}]}],
            add_generation_prompt=True, tokenize=False,
        )
        for r in records
    ]  # fmt: skip
    first = records[0]["prompt"][0]["content"]
    assert "<|im_start|>user\n" + alm_tones.AUDIO_BLOCK + first in prompts[0]
    waves = [load_audio(r["audio"][0], None, alm_tones.SAMPLING_RATE) for r in records]
    batch = processor(text=prompts, audio=waves, sampling_rate=alm_tones.SAMPLING_RATE,
                      padding=True, return_tensors="pt")  # fmt: skip
    assert int((batch["input_ids"] == processor.audio_token_id).sum()) == (
        ROWS * alm_tones.AUDIO_TOKENS
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the build's check ran: the same sums
    try:
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    finally:
        torch.set_num_threads(threads)
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :],
                                     skip_special_tokens=True)  # fmt: skip
    assert answers == built["answers"][:ROWS]
    # one-word answers, as trained; and the designed confusion leaves room for alignment
    right = [shapes_answer_matches(r["answer"], a) for r, a in zip(records, answers, strict=True)]
    assert all(len(a.split()) == 1 for a in answers), answers
    assert built["check"]["check"] <= 0.5 and sum(right) < ROWS


def test_the_processor_renders_plain_strings_as_smollm2_does() -> None:
    from transformers import AutoProcessor

    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.language.vlm_shapes import content_block_template
    from align_anything.families.zoo import resolve_model_path

    processor = AutoProcessor.from_pretrained(resolve_model_path(alm_tones.NAME))
    own = load_tokenizer(resolve_model_path(alm_tones.LANGUAGE_MODEL)).chat_template
    messages = [{"role": "user", "content": alm_tones.AUDIO_BLOCK + "How many beeps?"}]

    def render(template: str | None = None) -> str:
        return processor.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip

    assert render() == render(own)
    assert content_block_template(processor.chat_template) == processor.chat_template
