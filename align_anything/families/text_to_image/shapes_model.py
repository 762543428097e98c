"""The project's own tiny text-to-image model, `tiny-t2i-shapes`: its architecture and its files.

A Stable-Diffusion-shaped diffusers pipeline small enough to train and sample on a CPU:
- tokenizer: a CLIP BPE tokenizer whose vocabulary is the letters plus every caption word of
  the built-in shapes data (`data/shapes.py`) as one token each; 8 tokens per prompt;
- text encoder: a 2-layer `CLIPTextModel`, width 64;
- VAE: an `AutoencoderKL` with three blocks (8, 16, 32 channels), 4 latent channels: 32x32
  images <-> 4x8x8 latents;
- denoiser: a `UNet2DConditionModel` on the 8x8 latents, two blocks (32 and 64 channels), cross
  attention to the text at 4x4 (the coarse level is where a global property like colour is
  decided; attention at 8x8 would cost more and add nothing a 32-pixel shape needs);
- scheduler: DDIM, epsilon prediction, SD's scaled-linear betas, trailing timesteps (few
  inference steps then still start from pure noise).

The shipped weights (`SHIPPED_DIR`, safetensors) are trained by `scripts/build_builtin_t2i.py`
(its docstring: the command and its time). The weights are deliberately good at shapes and poor
at colour (trained on captions whose colour word is usually a random one), so that an
alignment run has something to fix; see that script.

`build_components(seed)` gives the same architecture with random weights (for tests that need a
pipeline but no trained one), `save_pipeline` writes a `StableDiffusionPipeline` folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align_anything.families.diffusion.tiny_text import word_tokenizer_files
from align_anything.families.text_to_image.shapes import COLOURS, IMAGE_SIZE, SHAPES

NAME = "tiny-t2i-shapes"
SHIPPED_DIR = Path(__file__).parent / "builtin" / NAME

MAX_TOKENS = 8  # <start> a <colour> <shape> <end> fits with room for a two-word prompt
TEXT_WIDTH = 64
LATENT_CHANNELS = 4
LATENT_SIZE = IMAGE_SIZE // 4  # three VAE blocks: two 2x downsamplings
# Words that get one token each; any other word is spelt out in letters (never unknown).
VOCAB_WORDS: tuple[str, ...] = ("a", "an", "the", *COLOURS, *SHAPES)


def tokenizer_files(
    words: tuple[str, ...] = VOCAB_WORDS,
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a CLIP BPE tokenizer in which each of `words` is one token
    (`tiny_text.word_tokenizer_files`, which the text-to-video model's tokenizer shares)."""
    return word_tokenizer_files(words)


def build_tokenizer() -> Any:
    """The CLIP tokenizer of `tokenizer_files`, padding and truncating to `MAX_TOKENS`."""
    from transformers import CLIPTokenizer

    vocab, merges = tokenizer_files()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)


def text_encoder_config(vocab_size: int) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=TEXT_WIDTH, intermediate_size=2 * TEXT_WIDTH,
        projection_dim=TEXT_WIDTH, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip


def vae_kwargs() -> dict[str, Any]:
    return dict(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 32), layers_per_block=1, norm_num_groups=4,
        sample_size=IMAGE_SIZE,
    )  # fmt: skip


def unet_kwargs() -> dict[str, Any]:
    return dict(
        sample_size=LATENT_SIZE, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
        cross_attention_dim=TEXT_WIDTH, attention_head_dim=8,
    )  # fmt: skip


def scheduler_kwargs() -> dict[str, Any]:
    return dict(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
        beta_schedule="scaled_linear", prediction_type="epsilon", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1, timestep_spacing="trailing",
    )  # fmt: skip


def build_components(seed: int = 0) -> dict[str, Any]:
    """The pipeline's parts with random weights (seeded): tokenizer, text_encoder, vae, unet,
    scheduler; every module fp32."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    return {
        "tokenizer": tokenizer,
        "text_encoder": CLIPTextModel(text_encoder_config(len(tokenizer))),
        "vae": AutoencoderKL(**vae_kwargs()),
        "unet": UNet2DConditionModel(**unet_kwargs()),
        "scheduler": DDIMScheduler(**scheduler_kwargs()),
    }


def pipeline_from(components: dict[str, Any]) -> Any:
    """A `StableDiffusionPipeline` of `components` (no safety checker, no feature extractor)."""
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(
        **components, safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )


def save_pipeline(components: dict[str, Any], folder: Path) -> None:
    """Write `components` as a diffusers pipeline folder (safetensors weights). The tokenizer
    folder also gets `vocab.json` and `merges.txt`, which transformers 4.x's CLIPTokenizer
    reads (5.x reads `tokenizer.json`)."""
    pipeline_from(components).save_pretrained(folder, safe_serialization=True)
    vocab, merges = tokenizer_files()
    tokenizer_dir = Path(folder) / "tokenizer"
    (tokenizer_dir / "vocab.json").write_text(json.dumps(vocab, indent=1) + "\n")
    (tokenizer_dir / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    )


def sample_images(pipeline: Any, captions: list[str], seeds: list[int], steps: int) -> list[Any]:
    """One PIL image per caption, each from its own seeded CPU generator (the pipeline's own
    scheduler with `steps` steps, no classifier-free guidance): the same seeds give the same
    images whatever the batch."""
    import torch

    generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
    with torch.no_grad():
        return pipeline(
            list(captions), num_inference_steps=steps, guidance_scale=1.0,
            generator=generators, output_type="pil",
        ).images  # fmt: skip
