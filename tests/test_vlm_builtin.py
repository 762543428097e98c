"""The built-in image-text model `llava-smollm2-shapes` (issue #37): what ships is the trained
tower and projector only, and the folder assembled from them with SmolLM2 on first use loads
with transformers' Auto classes alone and answers the held-out questions exactly as the build
measured them (`build.json`, written by scripts/build_builtin_vlm.py)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from align_anything.families.language import vlm_shapes

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_process_offline")]

ROWS = 16  # one batch of the build's check, so the padding and the numbers are the same


def test_the_shipped_parts_are_the_tower_and_projector_only() -> None:
    from safetensors import safe_open

    path = vlm_shapes.SHIPPED_DIR / vlm_shapes.PARTS_FILE
    assert path.stat().st_size < 4_000_000
    with safe_open(str(path), "pt") as parts:
        names = list(parts.keys())
    assert names and all(name.startswith(vlm_shapes.TRAINED_PREFIXES) for name in names)
    assert any(".vision_tower." in n for n in names)
    assert any(".multi_modal_projector." in n for n in names)


def test_the_assembled_model_loads_with_transformers_and_answers_as_built() -> None:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from align_anything.data.builtin import shapes_answer_matches
    from align_anything.data.formats import load_records
    from align_anything.families.zoo import resolve_model_path

    folder = resolve_model_path(vlm_shapes.NAME)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    # the tied embedding is one tensor, and the language model is SmolLM2's own weights
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    from safetensors import safe_open

    smollm2 = resolve_model_path(vlm_shapes.LANGUAGE_MODEL)
    with safe_open(f"{smollm2}/model.safetensors", "pt") as weights:
        q_proj = weights.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(model.model.language_model.layers[0].self_attn.q_proj.weight, q_proj)
    built = json.loads((vlm_shapes.SHIPPED_DIR / "build.json").read_text())
    records, _ = load_records("shapes-vqa-prompts-eval")
    records = records[:ROWS]
    # each picture is its 16 tokens in the prompt
    picture = Image.open(io.BytesIO(records[0]["images"][0])).convert("RGB")
    one = processor(text=["<image>\nq"], images=[picture], return_tensors="pt")
    assert int((one["input_ids"] == processor.image_token_id).sum()) == vlm_shapes.IMAGE_TOKENS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the build's check ran: the same sums
    try:
        answers = vlm_shapes.greedy_answers(model, processor, records)
    finally:
        torch.set_num_threads(threads)
    assert answers == built["answers"][:ROWS]
    # one-word answers, as trained; and the designed confusion leaves room for alignment
    right = [shapes_answer_matches(r["answer"], a) for r, a in zip(records, answers, strict=True)]
    assert all(len(a.split()) == 1 for a in answers), answers
    assert built["check"]["check"] <= 0.5 and sum(right) < ROWS


def test_the_processor_renders_content_blocks_as_the_project_renders_picture_rows() -> None:
    """TRL and transformers' pipelines pass a picture question as content blocks; the shipped
    chat template (SmolLM2's, extended: `vlm_shapes.content_block_template`) renders them as the
    project's picture rows (the marker on its own line before the question), and plain strings
    exactly as SmolLM2's own template does."""
    from transformers import AutoProcessor

    from align_anything.families.language.loading import load_tokenizer
    from align_anything.families.zoo import resolve_model_path

    processor = AutoProcessor.from_pretrained(resolve_model_path(vlm_shapes.NAME))
    own = load_tokenizer(resolve_model_path(vlm_shapes.LANGUAGE_MODEL)).chat_template
    question = "Which shape is in the picture? Answer with one word."
    as_string = [{"role": "user", "content": "<image>\n" + question}]
    blocks = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]

    def render(messages: list, template: str | None = None) -> str:
        return processor.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip

    assert render(as_string) == render(as_string, own)
    assert render(blocks) == render(as_string, own)
    assert "<|im_start|>user\n<image>\n" + question in render(blocks)
    assert vlm_shapes.content_block_template(processor.chat_template) == processor.chat_template


def test_dpo_checks_held_out_answers_with_their_pictures(tmp_path) -> None:
    """DPO's `eval/generation_check` on the picture questions answers each with its own
    picture: before training it is the share of the first 16 `shapes-vqa-pref-eval` rows whose
    greedy answer, computed here with transformers alone, is the row's answer."""
    from conftest import run_inline
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from align_anything.data.builtin import shapes_answer_matches
    from align_anything.data.formats import load_records
    from align_anything.families.zoo import resolve_model_path

    result = run_inline([
        "task=dpo", "deepspeed=z0", f"model.name_or_path={vlm_shapes.NAME}",
        "data.path=shapes-vqa-pref", "data.eval_path=shapes-vqa-pref-eval",
        "data.max_train_samples=8", f"data.max_eval_samples={ROWS}", "train.max_steps=1",
        "train.per_device_batch_size=8", f"dpo.generation_check_samples={ROWS}",
        "dpo.generation_max_new_tokens=6", "checkpoint.save_final=false",
    ], tmp_path / "dpo").check()  # fmt: skip
    measured = result.eval("before")["eval/generation_check"]

    folder = resolve_model_path(vlm_shapes.NAME)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    records = load_records("shapes-vqa-pref-eval")[0][:ROWS]
    assert sum(len(r["images"]) for r in records) > ROWS  # rows with two pictures among them
    answers = vlm_shapes.greedy_answers(model, processor, records)
    right = [shapes_answer_matches(r["answer"], a) for r, a in zip(records, answers, strict=True)]
    assert 0 < sum(right) < ROWS  # the model reads the pictures, with its designed confusions
    assert measured == sum(right) / ROWS
